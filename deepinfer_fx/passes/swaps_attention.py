"""Kernel swaps of the attention side (``swaps.py`` says what a swap is): the sparse MQA core
(gathered keys, or the window ring and entry pool read in place), the KV compressor, the
Lightning indexer, and RoPE (tables, rotations, norm + rotation)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ..graphs.attention import mqa_ring, mqa_with_sink
from ..graphs.compressor import pool_windows
from ..graphs.indexer import index_scores, score_topk
from ..graphs.rope import apply_rope, cos_sin, norm_rope
from ..kernels.ops_compressor import compressor_unserved
from ..kernels.ops_rope import norm_rope_unserved
from .manager import register_pass
from .swaps import _SERVED, KernelSwap


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

    def unserved(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor | None,
        rows_kv: torch.Tensor,
        rows_gate: torch.Tensor,
        slots: torch.Tensor,
        starts: torch.Tensor,
        lens: torch.Tensor,
        norm: torch.Tensor,
        *args: Any,
    ) -> str | None:
        return compressor_unserved(norm.shape[0])

    def sources(self) -> tuple[object, ...]:
        return (*super().sources(), compressor_unserved)


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


@register_pass
class NormRopeSwap(KernelSwap):
    """``rope.norm_rope`` (the V4 query heads' norm, the K = V latent's norm, each then rotated)
    => ``deepinfer.rms_norm_rope`` at every size: one pass over each row, where the compiled
    step ran the norm kernel, a rotation of the tail and a concatenation (three launches a call
    at decode; at prefill the norm and the in-place rotation read the rows twice). Declines
    tables that broadcast otherwise and rows the kernel does not hold (``norm_rope_unserved``)."""

    name: ClassVar[str] = "norm_rope_kernel"
    accelerators: ClassVar[frozenset[str]] = _SERVED
    place, op = "rope.norm_rope", "rms_norm_rope"

    def replacement(self) -> Callable[..., Any]:
        return torch.ops.deepinfer.rms_norm_rope

    def unserved(
        self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
    ) -> str | None:
        return norm_rope_unserved(x.shape, None if weight is None else weight.shape, cos.shape, sin.shape)

    def sources(self) -> tuple[object, ...]:
        return (*super().sources(), norm_rope_unserved)


# the places exist where the functions are defined; importing them above registered them
assert {
    mqa_with_sink.place,
    mqa_ring.place,
    pool_windows.place,
    score_topk.place,
    index_scores.place,  # type: ignore[attr-defined]
    cos_sin.place,
    apply_rope.place,
    norm_rope.place,
} == {  # type: ignore[attr-defined]
    SparseMQASwap.place,
    RingMQASwap.place,
    CompressorSwap.place,
    IndexerTopkSwap.place,
    IndexerScoresSwap.place,
    RopeTableSwap.place,
    RopeSwap.place,
    NormRopeSwap.place,
}
