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

A call whose shapes the op's kernel cannot serve (``KernelSwap.unserved``: an mHC stream count
that is no power of two, a router wider than its tile, ...) is declined: the reference runs
there, and the reason is noted once, while the step is traced, and comes back in the pass's
record of that graph (``PassRecord.declined``, the dumps, ``DeepinferBackend.declines``) and as
a warning. The predicates live beside the ops (``kernels/ops*.py``), where the kernels' own
launchers use them too, so a call of the op on such shapes runs its reference as well.

Here: the swap pass base, and the swaps of the MoE, mHC, router and projection places; those of
the attention core, compressor, indexer and RoPE places are in ``swaps_attention.py``.
"""

from __future__ import annotations

import warnings
from abc import abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.fx

from ..graphs.mhc import hc_head, mhc_site, sinkhorn
from ..graphs.moe import (
    EXPERT_WEIGHTS,
    expert_parallel,
    experts_with_shared,
    held_format,
    route_weights,
    routed_experts,
)
from ..graphs.norm import project, project_blocks
from ..graphs.param_spec import scale_path
from ..graphs.swap import active, reference
from ..io.quant import fp8_block_of
from ..kernels.ops import route_unserved
from ..kernels.ops_fp8 import fp8_block_unserved
from ..kernels.ops_linear import ALIGN, decode_sized
from ..kernels.ops_mhc import streams_unserved
from .manager import GraphPass, register_pass

_SERVED: frozenset[str] = frozenset({"cpu", "nvidia"})  # Ascend has no kernels for these yet

# Reasons each swap declined calls for, by pass name, in the order first seen; drained into the
# record of the graph being compiled (KernelSwap.declines).
_DECLINED: dict[str, dict[str, None]] = {}


@torch._dynamo.assume_constant_result  # run while Dynamo traces (once), not in the compiled step
def _note_declined(swap: str, why: str) -> bool:
    if why not in _DECLINED.setdefault(swap, {}):
        _DECLINED[swap][why] = None
        warnings.warn(f"kernel swap {swap!r} declines a call: {why}; the reference runs there")
    return True


class KernelSwap(GraphPass):
    place: ClassVar[str]  # a graphs/swap.py place, e.g. "moe.routed_experts"
    op: ClassVar[str]  # the deepinfer op that replaces it

    @abstractmethod
    def replacement(self) -> Callable[..., Any]:
        """The callable installed at the place: the place's signature, calling the op."""

    def unserved(self, *args: Any, **kwargs: Any) -> str | None:
        """Why the op's kernel cannot serve a call with the place's arguments, or None (it can).
        Reads static shapes, dtypes and Python values only, so a trace decides it once."""
        return None

    def swap(self) -> dict[str, Callable[..., Any]]:
        impl = self.replacement()
        if type(self).unserved is KernelSwap.unserved:  # serves every call: nothing to check
            return {self.place: impl}
        ref = reference(self.place)

        def checked(*args: Any, **kwargs: Any) -> Any:
            why = self.unserved(*args, **kwargs)
            if why is None:
                return impl(*args, **kwargs)
            _note_declined(self.name, why)
            return ref(*args, **kwargs)

        return {self.place: checked}

    def declines(self) -> tuple[str, ...]:
        return tuple(_DECLINED.pop(self.name, ()))

    def sources(self) -> tuple[object, ...]:
        return (type(self).replacement,)

    def targets(self) -> tuple[Any, ...]:
        """The op overloads whose nodes count as this pass's rewrites."""
        return (getattr(torch.ops.deepinfer, self.op).default,)

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        # An op that writes an argument (the compressor's ring, RoPE in place) is wrapped by
        # functionalisation in an auto_functionalized node whose first argument is the op.
        targets = self.targets()
        wrappers = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
        return sum(
            1
            for n in gm.graph.nodes
            if n.op == "call_function" and (n.target in targets or (n.target in wrappers and n.args[0] in targets))
        )


def _moe_experts(p: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    held = held_format(p)  # experts kept as the checkpoint stores them: the kernel dequantises tile by tile
    if held:
        s1, s3, s2 = (p[scale_path(n)] for n in EXPERT_WEIGHTS)
        if held == "fp4":
            return torch.ops.deepinfer.moe_experts_fp4(x, p["w1"], s1, p["w3"], s3, p["w2"], s2, idx, w, limit)
        block = fp8_block_of(p["w1"].shape, s1.shape)
        return torch.ops.deepinfer.moe_experts_fp8(x, p["w1"], s1, p["w3"], s3, p["w2"], s2, idx, w, limit, block)
    return torch.ops.deepinfer.moe_experts(x, p["w1"], p["w3"], p["w2"], idx, w, limit)


@register_pass
class MoEExpertsSwap(KernelSwap):
    """``moe.routed_experts`` => ``deepinfer.moe_experts``, or ``deepinfer.moe_experts_fp8`` /
    ``deepinfer.moe_experts_fp4`` for experts held as stored (Triton grouped GEMMs with fused
    SwiGLU-with-clamp on NVIDIA). Reached where ``moe_shared_fused_kernel`` is off or falls back
    (held experts, expert parallelism)."""

    name: ClassVar[str] = "moe_experts_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "moe.routed_experts", "moe_experts"

    def replacement(self) -> Callable[..., Any]:
        return _moe_experts

    def unserved(self, p: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> str | None:
        if held_format(p) != "fp8":  # MXFP4's blocks of 32 always fit the k tiles
            return None
        return fp8_block_unserved(fp8_block_of(p["w1"].shape, p[scale_path("w1")].shape))

    def sources(self) -> tuple[object, ...]:
        return (*super().sources(), fp8_block_unserved)

    def targets(self) -> tuple[Any, ...]:
        return (
            torch.ops.deepinfer.moe_experts.default,
            torch.ops.deepinfer.moe_experts_fp8.default,
            torch.ops.deepinfer.moe_experts_fp4.default,
        )  # by the experts' storage


# The most tokens a step folds the shared expert in for: decode batches. A prefill chunk's shared
# expert is a GEMM of thousands of rows, which cuBLAS runs faster than the grouped GEMM tiles
# (and the fold there is unmeasured); every decode bucket up to here takes the same path, so a
# token's bits do not depend on the decode batch it is in.
FOLD_MAX_TOKENS = 64


def _experts_with_shared(
    pe: dict, ps: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, real: torch.Tensor
) -> torch.Tensor:
    # held experts (fp8, fp4) keep their own kernel (one weight format a launch); under expert
    # parallelism the routed experts are the EP region, which must run; a shared expert wider
    # than a routed one (n_shared_experts > 1) is no extra expert of the stack. All static.
    foldable = all(ps[n].shape == pe[n].shape[1:] and ps[n].dtype == pe[n].dtype for n in EXPERT_WEIGHTS)
    if held_format(pe) or expert_parallel.place in active() or not foldable or x.shape[0] > FOLD_MAX_TOKENS:  # type: ignore[attr-defined]
        return experts_with_shared.reference(pe, ps, limit, x, idx, w, real)  # type: ignore[attr-defined]
    return torch.ops.deepinfer.moe_experts_shared(
        x, pe["w1"], pe["w3"], pe["w2"], ps["w1"], ps["w3"], ps["w2"], idx, w, limit
    )


@register_pass
class MoESharedSwap(KernelSwap):
    """``moe.experts_with_shared`` => ``deepinfer.moe_experts_shared``: the shared expert runs as
    one more routed expert that every token takes with weight 1, inside the routed experts'
    launches (at decode its own two skinny GEMVs and SwiGLU were three launches a layer, the
    GEMVs slower than the grouped GEMMs' weight streaming). With it in force ``moe.routed_experts``
    is inside the op, so ``moe_experts_kernel`` counts rewrites only where this swap falls back
    to the reference: experts held as stored, expert parallelism in force, a shared expert of
    another width than a routed one, or more than ``FOLD_MAX_TOKENS`` tokens (prefill)."""

    name: ClassVar[str] = "moe_shared_fused_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "moe.experts_with_shared", "moe_experts_shared"

    def replacement(self) -> Callable[..., Any]:
        return _experts_with_shared

    def sources(self) -> tuple[object, ...]:
        return (*super().sources(), _experts_with_shared)


@register_pass
class SinkhornSwap(KernelSwap):
    """``mhc.sinkhorn`` => ``deepinfer.mhc_sinkhorn`` (all iterations in one kernel instead of
    two launches per iteration)."""

    name: ClassVar[str] = "mhc_sinkhorn_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "mhc.sinkhorn", "mhc_sinkhorn"

    def replacement(self) -> Callable[..., Any]:
        return torch.ops.deepinfer.mhc_sinkhorn

    def unserved(self, logits: torch.Tensor, eps: float, iters: int) -> str | None:
        return streams_unserved(logits.shape[-1])

    def sources(self) -> tuple[object, ...]:
        return (*super().sources(), streams_unserved)


def _project(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    if not decode_sized(x, w):  # prefill-sized or unaligned: the reference's GEMM serves it
        return project.reference(x, w, out_fp32)  # type: ignore[attr-defined]
    y = torch.ops.deepinfer.skinny_linear(x.reshape(-1, x.shape[-1]), w, out_fp32)
    return y.view(*x.shape[:-1], w.shape[0])


@register_pass
class SkinnyLinearSwap(KernelSwap):
    """``norm.project`` (every ``linear`` / ``linear_fp32``) => ``deepinfer.skinny_linear`` for
    decode-sized calls (``ops_linear.decode_sized``: <= 16 rows, bf16, aligned weight), a
    GEMM that streams the weight at close to HBM bandwidth; the rest trace the reference.
    The choice reads static shapes only, so it is made once per traced bucket."""

    name: ClassVar[str] = "skinny_linear_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "norm.project", "skinny_linear"

    def replacement(self) -> Callable[..., Any]:
        return _project


def _project_blocks(x: torch.Tensor, w: torch.Tensor, blocks: int) -> torch.Tensor:
    # each block's rows aligned as well, so that a column tile never straddles two blocks
    if not decode_sized(x, w) or (w.shape[0] // blocks) % ALIGN:
        return project_blocks.reference(x, w, blocks)  # type: ignore[attr-defined]
    y = torch.ops.deepinfer.skinny_linear_blocks(x.reshape(-1, x.shape[-1]), w, blocks)
    return y.view(*x.shape[:-1], w.shape[0])


@register_pass
class SkinnyBlocksSwap(KernelSwap):
    """``norm.project_blocks`` (the grouped ``wo_a``) => ``deepinfer.skinny_linear_blocks`` for
    decode-sized calls: the skinny GEMV over the stacked blocks, where the reference's batched
    matmul was a cuBLAS launch that ends the PDL chain before and after it (twice a layer)."""

    name: ClassVar[str] = "skinny_linear_blocks_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "norm.project_blocks", "skinny_linear_blocks"

    def replacement(self) -> Callable[..., Any]:
        return _project_blocks


@register_pass
class MHCSiteSwap(KernelSwap):
    """``mhc.mhc_site`` => ``deepinfer.mhc_site`` at every size (an mHC site's fp32 mixing GEMV,
    its coefficients, Sinkhorn and the collapse of the streams in two launches instead of ~6; on
    the H200 1.1x to 5x faster than the cuBLAS + Inductor reference from 1 to 16384 tokens,
    ``bench/results/mhc_kernel_p8.json``). With it in force ``mhc.sinkhorn`` is inside the op,
    so ``mhc_sinkhorn_kernel`` counts rewrites only where this swap is switched off."""

    name: ClassVar[str] = "mhc_site_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "mhc.mhc_site", "mhc_site"

    def replacement(self) -> Callable[..., Any]:
        return torch.ops.deepinfer.mhc_site

    def unserved(self, X: torch.Tensor, *args: Any) -> str | None:
        return streams_unserved(X.shape[-2])

    def sources(self) -> tuple[object, ...]:
        return (*super().sources(), streams_unserved)


@register_pass
class MHCHeadSwap(KernelSwap):
    """``mhc.hc_head`` => ``deepinfer.mhc_head`` at every size: the final learned collapse (the
    fp32 mixing GEMV against the N rows of ``fn``, ``pre``, the collapse of the streams) in the
    site's two launches (the finish kernel's ``HEAD`` variant), where compiled it was five at a
    decode step, two of them cuBLAS's dot and reduction, which PDL does not chain."""

    name: ClassVar[str] = "mhc_head_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "mhc.hc_head", "mhc_head"

    def replacement(self) -> Callable[..., Any]:
        return torch.ops.deepinfer.mhc_head

    def unserved(self, X: torch.Tensor, *args: Any) -> str | None:
        return streams_unserved(X.shape[-2])

    def sources(self) -> tuple[object, ...]:
        return (*super().sources(), streams_unserved)


def _route_weights(
    logits: torch.Tensor,
    bias: torch.Tensor | None,
    ids: torch.Tensor | None,
    k: int,
    kind: str,
    temp: float,
    norm: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.ops.deepinfer.route_topk(logits, bias, ids, k, kind, float(temp), bool(norm), float(scale))


@register_pass
class RouterSwap(KernelSwap):
    """``moe.route_weights`` => ``deepinfer.route_topk``: a layer's expert choice and routing
    weights in one launch after the gate GEMV, where the traced code was up to four (scores,
    torch.topk's radix select, gather and sum, normalisation; ``kernels/triton/router.py``)."""

    name: ClassVar[str] = "route_topk_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "moe.route_weights", "route_topk"

    def replacement(self) -> Callable[..., Any]:
        return _route_weights

    def unserved(
        self, logits: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor | None, k: int, kind: str, *args: Any
    ) -> str | None:
        return route_unserved(logits.shape[-1], k, kind, ids is not None, bias is not None)

    def sources(self) -> tuple[object, ...]:
        return (*super().sources(), route_unserved)


# the places exist where the functions are defined; importing them above registered them
assert {
    routed_experts.place,
    experts_with_shared.place,
    sinkhorn.place,
    project.place,
    project_blocks.place,  # type: ignore[attr-defined]
    mhc_site.place,
    route_weights.place,
    hc_head.place,
} == {  # type: ignore[attr-defined]
    MoEExpertsSwap.place,
    MoESharedSwap.place,
    SinkhornSwap.place,
    SkinnyLinearSwap.place,
    SkinnyBlocksSwap.place,
    MHCSiteSwap.place,
    RouterSwap.place,
    MHCHeadSwap.place,
}
