"""Custom ops (``torch.ops.deepinfer.*``): pure-torch references plus fake impls; the
accelerator kernels register on top of them. Importing this package registers the ops."""

from . import ops  # noqa: F401  (registration side effect)
from . import ops_fp8  # noqa: F401  (registration side effect)
from . import ops_compressor  # noqa: F401  (registration side effect)
from . import ops_bi, ops_linear  # noqa: F401  (registration side effect)
from . import ops_mhc  # noqa: F401  (registration side effect)
from . import ops_rope  # noqa: F401  (registration side effect)
from . import ops_engram  # noqa: F401  (registration side effect)
