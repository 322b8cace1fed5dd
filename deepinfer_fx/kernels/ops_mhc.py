"""``deepinfer::mhc_site``: one mHC site up to the sublayer input; ``deepinfer::mhc_head``: the
final learned collapse of the streams.

The op is ``graphs/mhc.py::mhc_site``: the fp32 mixing GEMV of the RMS-normed streams, the
``pre`` / ``post`` coefficients, the Sinkhorn ``comb`` and the collapse of the streams with
``pre_in`` (or the site's own ``pre``). Left to the compiler a site is about six launches at
decode (the GEMV and its split-K reduction, the norm, Sinkhorn, pointwise kernels, the
collapse), 16 sites a step; the Triton kernel (``kernels/triton/mhc.py``) does it in two.
The reference is the graphs function itself.

``mhc_expand`` is ``graphs/mhc.py::mhc_expand``, the streams' update after a sublayer, which
Inductor fuses by itself; eager and aot_eager steps (batch-invariant inference) ran it as ~13
launches a site, the Triton kernel (``kernels/triton/mhc_expand.py``) in one.

``mhc_head`` is ``graphs/mhc.py::hc_head``, the same GEMV (``N`` rows of ``fn``), ``pre`` alone
and the collapse with it, once a step; compiled it is ~5 launches at decode, two of them cuBLAS's
dot and its reduction. The Triton launcher runs it through the site's two kernels.
"""

from __future__ import annotations

import torch

from ..graphs.mhc import hc_head, mhc_expand as _graphs_mhc_expand, mhc_site as _graphs_mhc_site
from .declare import declare_op

# The mHC kernels (site, head, Sinkhorn) hold a stream count's n x n tile: a power of two up to this.
MAX_STREAMS = 16


def streams_unserved(n: int) -> str | None:
    """Why the mHC kernels cannot tile ``n`` streams (``hc_mult``), or None; every released model has 4."""
    if 0 < n <= MAX_STREAMS and not n & (n - 1):
        return None
    return f"{n} mHC streams: the mHC kernels tile a power of two up to {MAX_STREAMS}"


def _site_fake(X: torch.Tensor, **_: object) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lead, n, d = X.shape[:-2], X.shape[-2], X.shape[-1]
    return (
        X.new_empty((*lead, n), dtype=torch.float32),
        X.new_empty((*lead, n), dtype=torch.float32),
        X.new_empty((*lead, n, n), dtype=torch.float32),
        X.new_empty((*lead, d)),
    )


# X ``[..., N, D]`` -> fp32 pre ``[..., N]``, post ``[..., N]``, comb ``[..., N, N]`` and the
# collapsed ``u`` ``[..., D]`` in X's dtype (all contiguous).
mhc_site = declare_op("mhc_site", _graphs_mhc_site, _site_fake, fresh=True)

# X ``[..., N, D]``, fn ``[N, N*D]``, base ``[N]``, scale ``[1]`` -> the collapsed streams
# ``[..., D]`` in X's dtype (contiguous).
mhc_head = declare_op("mhc_head", hc_head, lambda X, **_: X.new_empty((*X.shape[:-2], X.shape[-1])), fresh=True)

# X ``[..., N, D]``, y ``[..., D]`` in X's dtype, post ``[..., N]``, comb ``[..., N, N]`` fp32 ->
# the updated streams ``[..., N, D]`` in X's dtype (contiguous).
mhc_expand = declare_op("mhc_expand", _graphs_mhc_expand, lambda X, **_: torch.empty_like(X), fresh=True)
