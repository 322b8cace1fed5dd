"""``deepinfer::engram_rows``: the rows of an Engram table that a step's hash ids address, read
where the table lives (device memory, or pinned host memory that a GPU reads through unified
addressing) and dequantised to float32 on the ids' device.

Compiled steps on a GPU whose tables sit in host memory (``engine/engram_tables.py``) put this op
in place of ``graphs/engram.py::gather_rows``: the ids stay on the device and the Triton kernel
(``kernels/triton/engram.py``) reads only their rows over the bus, so no step waits on the host
and the op can be captured in a CUDA graph. The reference (CPU, or a table beside its ids) is
``gather_rows`` itself.
"""

from __future__ import annotations

import torch

from ..graphs.engram import gather_rows
from .declare import declare_op

# float32 ``[*ids.shape, head_dim]`` rows ``ids`` of ``weight`` (float8_e4m3fn with ue8m0 bytes
# ``scale``, or unquantised), on ``ids.device``.
engram_rows = declare_op(
    "engram_rows",
    gather_rows,
    lambda weight, ids, **_: ids.new_empty((*ids.shape, weight.shape[1]), dtype=torch.float32),
)
