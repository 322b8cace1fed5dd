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

from ..graphs.attention import mqa_ring, mqa_with_sink
from ..graphs.compressor import pool_windows
from ..graphs.indexer import index_scores, score_topk
from ..graphs.mhc import hc_head, mhc_site, sinkhorn
from ..graphs.moe import EXPERT_WEIGHTS, expert_parallel, experts_with_shared, fp8_held, route_weights, routed_experts
from ..graphs.norm import project, project_blocks
from ..graphs.params import scale_path
from ..graphs.rope import apply_rope, cos_sin, norm_rope
from ..graphs.swap import active
from ..io.quant import fp8_block_of
from ..kernels.ops_linear import ALIGN, decode_sized
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

    def targets(self) -> tuple[Any, ...]:
        """The op overloads whose nodes count as this pass's rewrites."""
        return (getattr(torch.ops.deepinfer, self.op).default,)

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        # An op that writes an argument (the compressor's ring, RoPE in place) is wrapped by
        # functionalisation in an auto_functionalized node whose first argument is the op.
        targets = self.targets()
        wrappers = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
        return sum(
            1 for n in gm.graph.nodes
            if n.op == "call_function" and (n.target in targets or (n.target in wrappers and n.args[0] in targets))
        )


def _moe_experts(p: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    if fp8_held(p):  # experts kept as the checkpoint stores them: the kernel dequantises tile by tile
        s1, s3, s2 = (p[scale_path(n)] for n in EXPERT_WEIGHTS)
        block = fp8_block_of(p["w1"].shape, s1.shape)
        return torch.ops.deepinfer.moe_experts_fp8(x, p["w1"], s1, p["w3"], s3, p["w2"], s2, idx, w, limit, block)
    return torch.ops.deepinfer.moe_experts(x, p["w1"], p["w3"], p["w2"], idx, w, limit)


@register_pass
class MoEExpertsSwap(KernelSwap):
    """``moe.routed_experts`` => ``deepinfer.moe_experts``, or ``deepinfer.moe_experts_fp8`` for
    experts held in fp8 (Triton grouped GEMMs with fused SwiGLU-with-clamp on NVIDIA). Reached
    where ``moe_shared_fused_kernel`` is off or falls back (fp8 experts, expert parallelism)."""

    name: ClassVar[str] = "moe_experts_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "moe.routed_experts", "moe_experts"

    def replacement(self) -> Callable[..., Any]:
        return _moe_experts

    def targets(self) -> tuple[Any, ...]:
        return (torch.ops.deepinfer.moe_experts.default, torch.ops.deepinfer.moe_experts_fp8.default)  # by the experts' storage


# The most tokens a step folds the shared expert in for: decode batches. A prefill chunk's shared
# expert is a GEMM of thousands of rows, which cuBLAS runs faster than the grouped GEMM tiles
# (and the fold there is unmeasured); every decode bucket up to here takes the same path, so a
# token's bits do not depend on the decode batch it is in.
FOLD_MAX_TOKENS = 64


def _experts_with_shared(
    pe: dict, ps: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, real: torch.Tensor
) -> torch.Tensor:
    # fp8-held experts keep their own kernel (one weight format a launch); under expert
    # parallelism the routed experts are the EP region, which must run; a shared expert wider
    # than a routed one (n_shared_experts > 1) is no extra expert of the stack. All static.
    foldable = all(ps[n].shape == pe[n].shape[1:] and ps[n].dtype == pe[n].dtype for n in EXPERT_WEIGHTS)
    if fp8_held(pe) or expert_parallel.place in active() or not foldable or x.shape[0] > FOLD_MAX_TOKENS:  # type: ignore[attr-defined]
        return experts_with_shared.reference(pe, ps, limit, x, idx, w, real)  # type: ignore[attr-defined]
    return torch.ops.deepinfer.moe_experts_shared(x, pe["w1"], pe["w3"], pe["w2"], ps["w1"], ps["w3"], ps["w2"], idx, w, limit)


@register_pass
class MoESharedSwap(KernelSwap):
    """``moe.experts_with_shared`` => ``deepinfer.moe_experts_shared``: the shared expert runs as
    one more routed expert that every token takes with weight 1, inside the routed experts'
    launches (at decode its own two skinny GEMVs and SwiGLU were three launches a layer, the
    GEMVs slower than the grouped GEMMs' weight streaming). With it in force ``moe.routed_experts``
    is inside the op, so ``moe_experts_kernel`` counts rewrites only where this swap falls back
    to the reference: experts held in fp8, expert parallelism in force, a shared expert of
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


@register_pass
class SparseMQASwap(KernelSwap):
    """``attention.mqa_with_sink`` => ``deepinfer.sparse_mqa`` (online-softmax attention over
    the selected window and compressed entries)."""

    name: ClassVar[str] = "sparse_mqa_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "attention.mqa_with_sink", "sparse_mqa"

    def replacement(self) -> Callable[..., Any]:
        return torch.ops.deepinfer.sparse_mqa


@register_pass
class RingMQASwap(KernelSwap):
    """``attention.mqa_ring`` => ``deepinfer.ring_mqa`` (decode attention reading the window ring
    and the chosen compressed entries from their pools, with the window mask made in the kernel:
    no gathered keys, no bias tensor for the window)."""

    name: ClassVar[str] = "ring_mqa_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "attention.mqa_ring", "ring_mqa"

    def replacement(self) -> Callable[..., Any]:
        return torch.ops.deepinfer.ring_mqa


@register_pass
class CompressorSwap(KernelSwap):
    """``compressor.pool_windows`` => ``deepinfer.compressor_pool`` (ring update, window gather,
    gate softmax and RMSNorm of the KV compressor in two launches instead of ~15)."""

    name: ClassVar[str] = "compressor_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "compressor.pool_windows", "compressor_pool"

    def replacement(self) -> Callable[..., Any]:
        return torch.ops.deepinfer.compressor_pool


@register_pass
class IndexerTopkSwap(KernelSwap):
    """``indexer.score_topk`` => ``deepinfer.indexer_topk`` (V4's indexer scores without the
    ``[T, Hi, N]`` intermediate, then a per-query top-k by threshold search instead of a sort)."""

    name: ClassVar[str] = "indexer_topk_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "indexer.score_topk", "indexer_topk"

    def replacement(self) -> Callable[..., Any]:
        return torch.ops.deepinfer.indexer_topk


@register_pass
class IndexerScoresSwap(KernelSwap):
    """``indexer.index_scores`` => ``deepinfer.indexer_scores`` (the same scoring kernel, for
    V4.1's two-level selection, which goes on from the scores)."""

    name: ClassVar[str] = "indexer_scores_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "indexer.index_scores", "indexer_scores"

    def replacement(self) -> Callable[..., Any]:
        return torch.ops.deepinfer.indexer_scores


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


# Fewer positions than this (decode) keep the inline tables: recomputing a few thousand
# elements costs less than the op's extra launches, and Inductor fuses them.
_TABLE_MIN_POSITIONS = 1024


def _cos_sin(positions: torch.Tensor, freq: torch.Tensor, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    if not shared and positions.numel() < _TABLE_MIN_POSITIONS:
        return cos_sin.reference(positions, freq)  # type: ignore[attr-defined]
    return torch.ops.deepinfer.rope_table(positions, freq.to(positions.device))


@register_pass
class RopeTableSwap(KernelSwap):
    """``rope.cos_sin`` => ``deepinfer.rope_table`` for prefill-sized position sets, so the
    tables are computed once per call instead of once per element of every tensor they rotate
    (``kernels/ops_rope.py`` says why Inductor would recompute them), and for the tables a whole
    forward shares at any size (``shared``): Inductor copies an unrealised input for each custom
    op that reads it, so at decode every ``rms_norm_rope`` and ``sparse_mqa`` call had its own
    table kernels; one op call a forward builds them once."""

    name: ClassVar[str] = "rope_table_op"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "rope.cos_sin", "rope_table"

    def replacement(self) -> Callable[..., Any]:
        return _cos_sin


# Rotations smaller than this stay with the reference, fused by Inductor with their inline
# tables: at 2^20 bf16 elements (4 MiB moved) the kernel saves ~2 us over Inductor's 1.5 TB/s,
# about one extra launch. A 64-request P8 decode rotates 2^21 query elements; there Inductor's
# rotation took ~16 us a call (12 calls, ~190 us of a 8.9 ms step). With no threshold, a P8
# decode step's rotations took 69.5 against 52.9 us at batch 1 (54 launches against 30: the
# tables become launches of their own) and 67.7 against 69.9 us at batch 8
# (``bench/results/p8_decode_rope_mhc_ab_s9.json``), so small decodes keep the reference.
_ROPE_MIN_ELEMENTS = 2**20


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    lead = cos.shape[:-1]
    # Tables that broadcast over x's leading dims are not the op's layout. Decode-sized tables
    # (a few positions) are computed inline and materialised for the op: a tiny kernel.
    if x.numel() < _ROPE_MIN_ELEMENTS or x.shape[: len(lead)] != lead or sin.shape != cos.shape:
        return apply_rope.reference(x, cos, sin, inverse)  # type: ignore[attr-defined]
    # a functional rewrite: Inductor drops the clone when nothing else reads x (ops_rope.py)
    out = x.clone()
    torch.ops.deepinfer.rope_(out, cos, sin, inverse)
    return out


@register_pass
class RopeSwap(KernelSwap):
    """``rope.apply_rope`` => ``deepinfer.rope_`` for rotations of at least ``_ROPE_MIN_ELEMENTS``
    (the query heads and the attention output, ``[T, 64, 512]``, at prefill and large decode
    batches): one kernel rotating the tail of each row in place, where Inductor's code for the
    interleaved pairs rewrote whole rows at about a third of HBM bandwidth.
    The choice reads static shapes only, so it is made once per traced bucket."""

    name: ClassVar[str] = "rope_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "rope.apply_rope", "rope_"

    def replacement(self) -> Callable[..., Any]:
        return _apply_rope


def _norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    lead = cos.shape[:-1]
    if x.shape[: len(lead)] != lead or sin.shape != cos.shape:  # tables that broadcast otherwise
        return norm_rope.reference(x, weight, eps, cos, sin)  # type: ignore[attr-defined]
    return torch.ops.deepinfer.rms_norm_rope(x, weight, eps, cos, sin)


@register_pass
class NormRopeSwap(KernelSwap):
    """``rope.norm_rope`` (the V4 query heads' norm, the K = V latent's norm, each then rotated)
    => ``deepinfer.rms_norm_rope`` at every size: one pass over each row, where the compiled
    step ran the norm kernel, a rotation of the tail and a concatenation (three launches a call
    at decode; at prefill the norm and the in-place rotation read the rows twice)."""

    name: ClassVar[str] = "norm_rope_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "rope.norm_rope", "rms_norm_rope"

    def replacement(self) -> Callable[..., Any]:
        return _norm_rope


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


def _route_weights(logits: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor | None, k: int, kind: str,
                   temp: float, norm: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
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


# the places exist where the functions are defined; importing them above registered them
assert {routed_experts.place, experts_with_shared.place, sinkhorn.place, mqa_with_sink.place, mqa_ring.place,  # type: ignore[attr-defined]
        pool_windows.place, score_topk.place, index_scores.place, project.place, cos_sin.place,  # type: ignore[attr-defined]
        apply_rope.place, mhc_site.place, route_weights.place, norm_rope.place, hc_head.place} == {  # type: ignore[attr-defined]
    MoEExpertsSwap.place, MoESharedSwap.place, SinkhornSwap.place, SparseMQASwap.place, RingMQASwap.place, CompressorSwap.place,
    IndexerTopkSwap.place, IndexerScoresSwap.place, SkinnyLinearSwap.place, RopeTableSwap.place, RopeSwap.place,
    MHCSiteSwap.place, RouterSwap.place, NormRopeSwap.place, MHCHeadSwap.place,
}
