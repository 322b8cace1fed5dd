"""Engram row gather as one Triton kernel: the CUDA implementation of ``deepinfer::engram_rows``.

A program copies ``BLOCK_M`` addressed rows of ``HEAD`` channels and dequantises them to fp32: a
float8_e4m3fn byte becomes fp32 through its fp16 bit pattern (exponent and mantissa moved up by
7 bits, times 2^8: exact, subnormals included), times the row's ue8m0 scale of its 32 channels.
The table may live in pinned host memory (``engine/engram_tables.py`` registers it): Triton's
launcher resolves a host pointer to its device mapping, so the loads cross the bus for exactly
the rows addressed, 256 contiguous bytes plus 8 scale bytes a row of a released table. A launch
depends on shapes only (CUDA-graph safe).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import ops_engram  # noqa: F401  (declares deepinfer::engram_rows before we register for it)
from .pdl import pdl_args, wait_previous

BLOCK_M = 16  # rows a program: 16 x 256 B in flight from host memory per program


@triton.jit
def _engram_rows_kernel(
    w_ptr,
    s_ptr,
    ids_ptr,
    out_ptr,
    n_ids,
    HEAD: tl.constexpr,
    FP8: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = m < n_ids
    row = tl.load(ids_ptr + m, mask=live, other=0).to(tl.int64)
    cols = tl.arange(0, HEAD)
    mask = live[:, None]
    if FP8:
        b = tl.load(w_ptr + row[:, None] * HEAD + cols[None, :], mask=mask, other=0).to(tl.int32)
        bits = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        x = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
        e = tl.load(s_ptr + row[:, None] * (HEAD // 32) + cols[None, :] // 32, mask=mask, other=127).to(tl.int32)
        # 2^(e - 127) from its bit pattern; byte 0 is the subnormal 2^-127
        scale = tl.where(e == 0, 1 << 22, e << 23).to(tl.float32, bitcast=True)
        x = x * scale
    else:
        x = tl.load(w_ptr + row[:, None] * HEAD + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m[:, None] * HEAD + cols[None, :], x, mask=mask)


def engram_rows_triton(weight: torch.Tensor, scale: torch.Tensor | None, ids: torch.Tensor) -> torch.Tensor:
    """``deepinfer::engram_rows`` on CUDA ids; ``weight`` / ``scale`` on the same GPU or pinned on the host."""
    head = weight.shape[1]
    out = torch.empty((*ids.shape, head), dtype=torch.float32, device=ids.device)
    fp8 = weight.dtype == torch.float8_e4m3fn
    if fp8 != (scale is not None) or head & (head - 1) or head % 32 or not weight.is_contiguous():
        raise ValueError(
            f"engram_rows: contiguous fp8 rows with ue8m0 scales (or unquantised rows without) of a power-of-two "
            f"head_dim >= 32; got {weight.dtype} {tuple(weight.shape)}, scale "
            f"{None if scale is None else (scale.dtype, tuple(scale.shape))}"
        )
    flat = ids.reshape(-1)
    if flat.numel() == 0:
        return out
    _engram_rows_kernel[(triton.cdiv(flat.numel(), BLOCK_M),)](
        weight.view(torch.uint8) if fp8 else weight,
        scale if fp8 else weight,  # unread without FP8
        flat.contiguous(),
        out,
        flat.numel(),
        HEAD=head,
        FP8=fp8,
        BLOCK_M=BLOCK_M,
        num_warps=4,
        **pdl_args(out.device),
    )
    return out


torch.library.register_kernel("deepinfer::engram_rows", "cuda", engram_rows_triton)
