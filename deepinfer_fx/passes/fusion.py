"""Fusion passes that swap a model function's reference subgraph for a ``deepinfer`` op.

The patterns are traced from the model code itself (``graphs/norm.py::rms_norm``) or from the
op reference that restates the model's lines (``graphs/moe.py::swiglu_act`` for the tail
of ``graphs/moe.py::swiglu``), so a model edit that changes the math stops the match instead of
fusing something different; both are ``sources`` of the pass and so enter its uuid.

On the CPU the ops run their references, so fusing there gains nothing by itself; the cpu
pipeline runs these passes anyway so the rewrite is exercised and tested where everyone can run
it. Accelerators gain once they register fast kernels for the ops.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch

from ..graphs import norm as graphs_norm
from ..graphs.moe import swiglu_act
from .. import kernels  # noqa: F401  (registers torch.ops.deepinfer.*, which the fusions insert)
from .manager import register_pass
from .pattern import PatternFusionPass

_ALL: frozenset[str] = frozenset({"cpu", "nvidia", "ascend"})

# Placeholder values the scalars take while a pattern is traced; the matcher turns them into
# wildcards, so they only need to be values no other literal in the pattern takes.
_EPS_TRACE = 1.25e-5
_LIMIT_TRACE = 3.25


def _example(dtype: torch.dtype, *shape: int) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype)


# --- RMSNorm ---------------------------------------------------------------------------------


def _rms_weighted(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return graphs_norm.rms_norm(x, weight, eps)


def _rms_weighted_fused(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.deepinfer.rms_norm(x, weight, eps)


def _rms_unweighted(x: torch.Tensor, eps: float) -> torch.Tensor:
    return graphs_norm.rms_norm(x, None, eps)


def _rms_unweighted_fused(x: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.deepinfer.rms_norm(x, None, eps)


@register_pass
class RMSNormFusion(PatternFusionPass):
    """float -> square -> mean -> + eps -> rsqrt -> mul (-> mul weight) (-> cast back)
    => ``deepinfer.rms_norm``."""

    name: ClassVar[str] = "rms_norm_fusion"
    accelerators: ClassVar[frozenset[str]] = _ALL

    def sources(self) -> tuple[object, ...]:
        return (graphs_norm.rms_norm, _rms_weighted, _rms_unweighted, _rms_weighted_fused, _rms_unweighted_fused)

    def register_patterns(self, add: Callable[..., None]) -> None:
        # The graph differs by dtype: an fp32 input has no casts, a bf16 one is cast up and back,
        # and the weight is cast unless it already is fp32. One low-precision dtype suffices
        # (matches are re-checked with the real dtypes, so bf16 also finds fp16).
        low, f32 = torch.bfloat16, torch.float32
        variants = [(low, low), (low, f32), (low, None), (f32, low), (f32, f32), (f32, None)]
        for x_dt, w_dt in variants:  # casting variants first: they absorb more nodes
            if w_dt is None:
                add(_rms_unweighted, _rms_unweighted_fused, [_example(x_dt, 2, 8)], {"eps": _EPS_TRACE})
            else:
                example = [_example(x_dt, 2, 8), _example(w_dt, 8)]
                add(_rms_weighted, _rms_weighted_fused, example, {"eps": _EPS_TRACE})


# --- SwiGLU with clamp -------------------------------------------------------------------------


def _swiglu_fused(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return torch.ops.deepinfer.swiglu_clamp(gate, up, limit)


@register_pass
class SwiGLUClampFusion(PatternFusionPass):
    """The tail of ``graphs/moe.py::swiglu`` after its two projections: cast to fp32,
    ``clamp(gate, max=limit)``, ``clamp(up, -limit, limit)``, ``silu(gate) * up``
    => ``deepinfer.swiglu_clamp``. Only the clamped form (every V4 config has a limit); an
    unclamped ``silu(a) * b`` is too generic a pattern to claim as this op."""

    name: ClassVar[str] = "swiglu_clamp_fusion"
    accelerators: ClassVar[frozenset[str]] = _ALL

    def sources(self) -> tuple[object, ...]:
        return (swiglu_act, _swiglu_fused)

    def register_patterns(self, add: Callable[..., None]) -> None:
        # -limit is traced as a literal of its own; the matcher ignores float literals in the
        # search and re-traces each match with the matched limit, which checks it is -limit.
        for dt in (torch.bfloat16, torch.float32):  # with the up-casts first
            add(
                swiglu_act,
                _swiglu_fused,
                [_example(dt, 2, 8), _example(dt, 2, 8)],
                {"limit": _LIMIT_TRACE},
            )
