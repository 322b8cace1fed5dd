"""Batch-invariant inference (``LLM(batch_invariant=True)``, ``DEEPINFER_BATCH_INVARIANT=1``):
the one table of what stands at each ``graphs/swap.py`` place while it is on.

Every place is in the table: where the reference could depend on the batch, its batch-invariant
form (``graphs/batch_invariant.py``), whose reductions run in ``deepinfer::bi_*`` ops
(``kernels/ops_bi.py``: the fixed-order torch math on the CPU, Triton kernels on CUDA); where
the accelerator has a kernel that is batch-invariant at every size (``INVARIANT_KERNELS``,
``INVARIANT_PLACES``), that kernel; everywhere else the reference itself, so that no other kernel
swap (built for speed, some choosing their reduction by the batch's size) stands in while the
flag is on. The step runner installs the table innermost, eagerly and compiled, over the
pipeline's kernel swaps (``engine/runner.py``): the flag declines them.
On a mesh, the sharding's places keep their replacement: expert parallelism's dispatch runs the
routed experts' form on the received pairs, and the form's routing lists each token's experts in
ascending id, so the combine's k order (``sharding/ep.py``) is the one process's expert order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..graphs import batch_invariant as bi
from ..graphs import model as _model  # noqa: F401  (importing the model registers every place)
from ..graphs.moe import dequant_experts, held_format
from ..graphs.norm import dequant_dense
from ..graphs.rope import apply_rope
from ..graphs.swap import places, reference
from ..kernels import ops_bi  # noqa: F401  (declares the deepinfer::bi_* ops)
from .manager import registered_passes
from .swap_calls import apply_rope_call, cos_sin_call


def _project(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    y = torch.ops.deepinfer.bi_matmul(x.reshape(-1, x.shape[-1]), w, out_fp32)
    return y.view(*x.shape[:-1], w.shape[0])


def _project_blocks(x: torch.Tensor, w: torch.Tensor, blocks: int, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``norm.project_blocks`` through ``deepinfer::bi_matmul_blocks`` (a block-FP8 weight dequantised first)."""
    w = dequant_dense(w, scale, x.dtype)
    y = torch.ops.deepinfer.bi_matmul_blocks(x.reshape(-1, x.shape[-1]), w, blocks)
    return y.view(*x.shape[:-1], w.shape[0])


def _sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    return torch.ops.deepinfer.bi_sum(x, dim, keepdim)


def _mean(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    return torch.ops.deepinfer.bi_mean(x, dim, keepdim)


def _cumsum(x: torch.Tensor, dim: int) -> torch.Tensor:
    return torch.ops.deepinfer.bi_cumsum(x, dim)


def _attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    k_pos: torch.Tensor,
    bias: torch.Tensor,
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """``attention.attend`` with each query's keys summed in the canonical order (``bi.canonical_order``)."""
    order, count = bi.canonical_order(k_pos, bias)
    return apply_rope(torch.ops.deepinfer.bi_attend(q, keys, order, count, sink), cos, sin, inverse=True)


def _routed_experts(p: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``moe.routed_experts`` through ``deepinfer::bi_moe_experts`` (experts held as stored are
    dequantised first: the op reads bf16/fp32 weights)."""
    if held_format(p):
        p = dequant_experts(p, x.dtype)
    return torch.ops.deepinfer.bi_moe_experts(x, p["w1"], p["w3"], p["w2"], idx, w, limit)


def _index_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    dot_scale: float,
    slots: torch.Tensor | None = None,
    key_rows: str | None = None,
) -> torch.Tensor:
    return torch.ops.deepinfer.bi_index_scores(q, keys, head_w, visible, dot_scale, slots, key_rows)


# The places whose reference could change with the batch, and what replaces each.
FORMS: dict[str, Callable[..., Any]] = {
    "norm.project": _project,
    "norm.project_blocks": _project_blocks,
    "pointwise.sigmoid": bi.sigmoid,
    "pointwise.silu": bi.silu,
    "pointwise.softplus": bi.softplus,
    "pointwise.softmax": bi.softmax,
    "pointwise.log_softmax": bi.log_softmax,
    "reduce.sum_over": _sum,
    "reduce.mean_over": _mean,
    "reduce.cumsum_over": _cumsum,
    "reduce.top_values": bi.top_values,
    "moe.route_weights": bi.route_weights,
    "moe.routed_experts": _routed_experts,
    "attention.attend": _attend,
    "attention.mqa_ring": bi.mqa_ring,
    "indexer.index_scores": _index_scores,
    "indexer.score_topk": bi.score_topk,
    "indexer.top_k_mask": bi.top_k_mask,
}


assert set(FORMS) <= set(places()), sorted(set(FORMS) - set(places()))


def _rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return torch.ops.deepinfer.rms_norm(x, weight, eps)


def _mhc_expand(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    return torch.ops.deepinfer.mhc_expand(X, y, post, comb)


# Where the accelerator has kernels that give a row the same bits alone and in any batch, at
# every size (their tests assert it: tests/kernels/test_triton_{mhc,compressor,norm,indexer}.py;
# the pointwise RoPE and mHC-expand kernels hold it by construction), the flag keeps them, eagerly
# too, in place of the forms' dozens of launches a call: kernel swaps by pass name (which
# DEEPINFER_DISABLE_PASSES turns off here as well), then places of their own. RoPE's kernels stand
# at every size, not from the pipeline's thresholds up, so a token gets the same bits at prefill
# and at decode. On an H100 they took P8's decode step from 1147 launches to 270 (docs/decisions.md).
INVARIANT_KERNELS: dict[str, tuple[str, ...]] = {
    "nvidia": (
        "mhc_site_kernel",
        "mhc_head_kernel",
        "compressor_kernel",
        "norm_rope_kernel",
        "indexer_topk_kernel",  # the selection by threshold search: ties to the lower index, as the forms'
        "topk_mask_kernel",
    ),
}
INVARIANT_PLACES: dict[str, dict[str, Callable[..., Any]]] = {
    "nvidia": {
        "norm.rms_norm": _rms_norm,
        "mhc.mhc_expand": _mhc_expand,
        "rope.apply_rope": functools.partial(apply_rope_call, smallest=0),
        "rope.cos_sin": functools.partial(cos_sin_call, smallest=0),
    },
}


def batch_invariant_swaps(
    sharded: Iterable[str] = (), accelerator: str = "cpu", disabled: Iterable[str] = ()
) -> dict[str, Callable[..., Any]]:
    """Every place but ``sharded`` (those a mesh's sharding replaces: expert parallelism's
    dispatch, which runs the routed experts' form on each rank): the accelerator's invariant
    kernel where it has one (and the swap is not ``disabled``), else its batch-invariant form,
    else its reference."""
    table = {name: reference(name) for name in places()}
    table.update(FORMS)
    passes = registered_passes()
    for name in INVARIANT_KERNELS.get(accelerator, ()):
        if name not in set(disabled):
            table.update(passes[name].swap())
    table.update(INVARIANT_PLACES.get(accelerator, {}))
    return {name: f for name, f in table.items() if name not in set(sharded)}
