"""``deepinfer::mhc_site``: one mHC site up to the sublayer input.

The op is ``graphs/mhc.py::mhc_site``: the fp32 mixing GEMV of the RMS-normed streams, the
``pre`` / ``post`` coefficients, the Sinkhorn ``comb``, the collapse of the streams with
``pre_in`` (or the site's own ``pre``) and, given ``norm_w``, the sublayer's RMSNorm of the
collapse. Left to the compiler a site is about six launches at decode (the GEMV and its
split-K reduction, the norm, Sinkhorn, pointwise kernels, the collapse) plus the sublayer's
norm, 16 sites a step; the Triton kernel (``kernels/triton/mhc.py``) does it in two.
The reference is the graphs function itself, followed by ``graphs/norm.py::rms_norm`` where
``norm_w`` is given: the model writes the norm after the site (``graphs/model.py::block``) and
the ``mhc_norm_fusion`` pass (``passes/mhc_norm.py``) hands it to the op on the traced graph.

``norm_w`` has no default: Inductor fills an op's defaults into the node it lowers and then
asserts that the argument count did not change, so every call spells all nine out.

No ``from __future__ import annotations``: ``custom_op`` infers the schema from the annotations.
"""

from typing import Optional

import torch

from ..graphs.mhc import mhc_site as _graphs_mhc_site
from ..graphs.norm import rms_norm
from .ops import NAMESPACE


def site_reference(
    X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, rms_eps: float, hc_eps: float, iters: int,
    pre_in: Optional[torch.Tensor], norm_w: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, ...]:
    """The op's math: the graphs site, then with ``norm_w`` the sublayer's norm of its collapse,
    as ``model.block`` writes the two (the ``mhc_norm_fusion`` pass joins them on the graph)."""
    pre, post, comb, u = _graphs_mhc_site.reference(X, fn, base, scale, rms_eps, hc_eps, iters, pre_in)  # type: ignore[attr-defined]
    return pre, post, comb, u if norm_w is None else rms_norm(u, norm_w, rms_eps)


@torch.library.custom_op(f"{NAMESPACE}::mhc_site", mutates_args=())
def mhc_site(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    iters: int,
    pre_in: Optional[torch.Tensor],
    norm_w: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """X ``[..., N, D]`` -> fp32 pre ``[..., N]``, post ``[..., N]``, comb ``[..., N, N]`` and the
    sublayer input ``[..., D]`` in X's dtype: the collapsed ``u``, or ``rms_norm(u, norm_w,
    rms_eps)`` with ``norm_w`` ``[D]`` (all contiguous)."""
    outs = site_reference(X, fn, base, scale, rms_eps, hc_eps, iters, pre_in, norm_w)
    return tuple(t.contiguous() for t in outs)  # type: ignore[return-value]


@mhc_site.register_fake
def _mhc_site_fake(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    iters: int,
    pre_in: Optional[torch.Tensor],
    norm_w: Optional[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lead, n, d = X.shape[:-2], X.shape[-2], X.shape[-1]
    return (
        X.new_empty((*lead, n), dtype=torch.float32),
        X.new_empty((*lead, n), dtype=torch.float32),
        X.new_empty((*lead, n, n), dtype=torch.float32),
        X.new_empty((*lead, d)),
    )
