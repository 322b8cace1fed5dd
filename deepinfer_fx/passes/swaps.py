"""Kernel swaps: passes that put a ``deepinfer`` op in place of a whole model function.

Some regions are too large or too shape-dependent for a pattern match on the ATen graph (the
sort-by-expert grouped GEMMs, the unrolled Sinkhorn loop, the masked attention core), yet each
is one function in ``graphs/``. Those functions are swap places (``graphs/swap.py``); a swap
pass names a place and the op that replaces it, and the step runner installs the replacement
of every enabled swap pass while it traces and runs a compiled step (``Pipeline.swaps``). The
op then stands in the captured graph as one node, which the accelerator's kernel executes.

Like every pass a swap has a name, the accelerators it serves and a uuid, and can be switched
off by name (the function's reference math is traced instead). On the graph itself a swap pass
only counts the op nodes it put there: its rewrites in the start-up report and the dumps.
The cpu pipeline runs the swaps too, so the plumbing is tested where everyone can run it (the
ops' CPU kernels are the references).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.fx

from ..graphs.attention import mqa_with_sink
from ..graphs.mhc import sinkhorn
from ..graphs.moe import routed_experts
from ..kernels.ops import OPS
from .manager import GraphPass, register_pass

_SERVED: frozenset[str] = frozenset({"cpu", "nvidia"})  # Ascend has no kernels for these yet


class KernelSwap(GraphPass):
    place: ClassVar[str]  # a graphs/swap.py place, e.g. "moe.routed_experts"
    op: ClassVar[str]  # the deepinfer op that replaces it

    @abstractmethod
    def replacement(self) -> Callable[..., Any]:
        """The callable installed at the place: the place's signature, calling the op."""

    def swap(self) -> dict[str, Callable[..., Any]]:
        return {self.place: self.replacement()}

    def sources(self) -> tuple[object, ...]:
        return (type(self).replacement,)

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        target = OPS[self.op]
        return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def _moe_experts(p: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.deepinfer.moe_experts(x, p["w1"], p["w3"], p["w2"], idx, w, limit)


@register_pass
class MoEExpertsSwap(KernelSwap):
    """``moe.routed_experts`` => ``deepinfer.moe_experts`` (Triton grouped GEMMs with fused
    SwiGLU-with-clamp on NVIDIA)."""

    name: ClassVar[str] = "moe_experts_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "moe.routed_experts", "moe_experts"

    def replacement(self) -> Callable[..., Any]:
        return _moe_experts


@register_pass
class SinkhornSwap(KernelSwap):
    """``mhc.sinkhorn`` => ``deepinfer.mhc_sinkhorn`` (all iterations in one kernel instead of
    two launches per iteration)."""

    name: ClassVar[str] = "mhc_sinkhorn_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "mhc.sinkhorn", "mhc_sinkhorn"

    def replacement(self) -> Callable[..., Any]:
        return torch.ops.deepinfer.mhc_sinkhorn


@register_pass
class SparseMQASwap(KernelSwap):
    """``attention.mqa_with_sink`` => ``deepinfer.sparse_mqa`` (online-softmax attention over
    the selected window and compressed entries)."""

    name: ClassVar[str] = "sparse_mqa_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "attention.mqa_with_sink", "sparse_mqa"

    def replacement(self) -> Callable[..., Any]:
        return torch.ops.deepinfer.sparse_mqa


# the places exist where the functions are defined; importing them above registered them
assert {routed_experts.place, sinkhorn.place, mqa_with_sink.place} == {  # type: ignore[attr-defined]
    MoEExpertsSwap.place, SinkhornSwap.place, SparseMQASwap.place
}
