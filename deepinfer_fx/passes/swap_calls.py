"""What the kernel swaps of ``swaps.py`` put at their places where that is more than their op
called with the place's arguments (``*_call``), and how a swap reads a place's arguments to say
which calls its kernel cannot serve (``*_unserved``, over the predicates of ``kernels/ops*.py``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..graphs.moe import EXPERT_WEIGHTS, expert_parallel, experts_with_shared, held_format
from ..graphs.norm import project, project_blocks, project_fp8
from ..graphs.param_spec import scale_path
from ..graphs.rope import apply_rope, cos_sin
from ..graphs.swap import active
from ..io.quant import fp8_block_of
from ..kernels.ops import route_unserved
from ..kernels.ops_compressor import compressor_unserved
from ..kernels.ops_fp8 import fp8_block_unserved
from ..kernels.ops_linear import ALIGN, decode_sized, fp8_decode_sized
from ..kernels.ops_mhc import streams_unserved
from ..kernels.ops_rope import norm_rope_unserved as rows_unserved

# --- MoE -----------------------------------------------------------------------------------------


def routed_experts_call(p: dict, limit: float, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    held = held_format(p)  # experts kept as the checkpoint stores them: the kernel dequantises tile by tile
    if held:
        s1, s3, s2 = (p[scale_path(n)] for n in EXPERT_WEIGHTS)
        if held == "fp4":
            return torch.ops.deepinfer.moe_experts_fp4(x, p["w1"], s1, p["w3"], s3, p["w2"], s2, idx, w, limit)
        block = fp8_block_of(p["w1"].shape, s1.shape)
        return torch.ops.deepinfer.moe_experts_fp8(x, p["w1"], s1, p["w3"], s3, p["w2"], s2, idx, w, limit, block)
    return torch.ops.deepinfer.moe_experts(x, p["w1"], p["w3"], p["w2"], idx, w, limit)


def routed_experts_unserved(p: dict, *args: Any) -> str | None:
    if held_format(p) != "fp8":  # MXFP4's blocks of 32 always fit the k tiles
        return None
    return fp8_block_unserved(fp8_block_of(p["w1"].shape, p[scale_path("w1")].shape))


# The most tokens a step folds the shared expert in for: decode batches. A prefill chunk's shared
# expert is a GEMM of thousands of rows, which cuBLAS runs faster than the grouped GEMM tiles
# (and the fold there is unmeasured); every decode bucket up to here takes the same path, so a
# token's bits do not depend on the decode batch it is in.
FOLD_MAX_TOKENS = 64


def experts_with_shared_call(
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


def route_weights_call(logits: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor | None, *rest: Any) -> Any:
    k, kind, temp, norm, scale = rest
    return torch.ops.deepinfer.route_topk(logits, bias, ids, k, kind, float(temp), bool(norm), float(scale))


def route_weights_unserved(logits: torch.Tensor, bias: Any, ids: Any, k: int, kind: str, *rest: Any) -> str | None:
    return route_unserved(logits.shape[-1], k, kind, ids is not None, bias is not None)


# --- projections ---------------------------------------------------------------------------------


def project_call(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    if not decode_sized(x, w):  # prefill-sized or unaligned: the reference's GEMM serves it
        return project.reference(x, w, out_fp32)  # type: ignore[attr-defined]
    y = torch.ops.deepinfer.skinny_linear(x.reshape(-1, x.shape[-1]), w, out_fp32)
    return y.view(*x.shape[:-1], w.shape[0])


def project_fp8_call(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    if not fp8_decode_sized(x, w, scale):
        return project_fp8.reference(x, w, scale, out_fp32)  # type: ignore[attr-defined]
    y = torch.ops.deepinfer.skinny_linear_fp8(x.reshape(-1, x.shape[-1]), w, scale, out_fp32)
    return y.view(*x.shape[:-1], w.shape[0])


def project_blocks_call(
    x: torch.Tensor, w: torch.Tensor, blocks: int, scale: torch.Tensor | None = None
) -> torch.Tensor:
    # each block's rows aligned as well, so that a column tile never straddles two blocks
    sized = decode_sized(x, w) if scale is None else fp8_decode_sized(x, w, scale)
    if not sized or (w.shape[0] // blocks) % ALIGN:
        return project_blocks.reference(x, w, blocks, scale)  # type: ignore[attr-defined]
    y = torch.ops.deepinfer.skinny_linear_blocks(x.reshape(-1, x.shape[-1]), w, blocks, scale)
    return y.view(*x.shape[:-1], w.shape[0])


# --- mHC -----------------------------------------------------------------------------------------


def sinkhorn_unserved(logits: torch.Tensor, *args: Any) -> str | None:
    return streams_unserved(logits.shape[-1])


def streams_of_x_unserved(X: torch.Tensor, *args: Any) -> str | None:
    """``mhc.mhc_site`` and ``mhc.hc_head``: X ``[..., N, D]`` holds N streams."""
    return streams_unserved(X.shape[-2])


# --- attention side ------------------------------------------------------------------------------


def pool_windows_unserved(kv: torch.Tensor, gate: Any, *args: Any) -> str | None:
    norm = args[5]  # after rows_kv, rows_gate, slots, starts, lens: the latents' norm weight [dim]
    return compressor_unserved(norm.shape[0])


# Fewer positions than this (decode) keep the inline tables: recomputing a few thousand
# elements costs less than the op's extra launches, and Inductor fuses them.
_TABLE_MIN_POSITIONS = 1024


def cos_sin_call(
    positions: torch.Tensor, freq: torch.Tensor, shared: bool = False, *, smallest: int = _TABLE_MIN_POSITIONS
) -> tuple[torch.Tensor, torch.Tensor]:
    if not shared and positions.numel() < smallest:
        return cos_sin.reference(positions, freq)  # type: ignore[attr-defined]
    return torch.ops.deepinfer.rope_table(positions, freq.to(positions.device))


# Rotations smaller than this stay with the reference, fused by Inductor with their inline
# tables: at 2^20 bf16 elements (4 MiB moved) the kernel saves ~2 us over Inductor's 1.5 TB/s,
# about one extra launch. A 64-request P8 decode rotates 2^21 query elements; there Inductor's
# rotation took ~16 us a call (12 calls, ~190 us of a 8.9 ms step). With no threshold, a P8
# decode step's rotations took 69.5 against 52.9 us at batch 1 (54 launches against 30: the
# tables become launches of their own) and 67.7 against 69.9 us at batch 8
# (``bench/results/p8_decode_rope_mhc_ab_s9.json``), so small decodes keep the reference.
_ROPE_MIN_ELEMENTS = 2**20


def apply_rope_call(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    inverse: bool = False,
    *,
    smallest: int = _ROPE_MIN_ELEMENTS,
) -> torch.Tensor:
    lead = cos.shape[:-1]
    # Tables that broadcast over x's leading dims are not the op's layout. Decode-sized tables
    # (a few positions) are computed inline and materialised for the op: a tiny kernel.
    if x.numel() < smallest or x.shape[: len(lead)] != lead or sin.shape != cos.shape:
        return apply_rope.reference(x, cos, sin, inverse)  # type: ignore[attr-defined]
    # a functional rewrite: Inductor drops the clone when nothing else reads x (ops_rope.py)
    out = x.clone()
    torch.ops.deepinfer.rope_(out, cos, sin, inverse)
    return out


def norm_rope_unserved(x: torch.Tensor, weight: torch.Tensor | None, eps: float, *tables: torch.Tensor) -> str | None:
    cos, sin = tables
    return rows_unserved(x.shape, None if weight is None else weight.shape, cos.shape, sin.shape)
