"""SwiGLU with the V4 clamps as one Triton kernel: the CUDA implementation of
``deepinfer::swiglu_clamp``.

``gate`` and ``up`` are read as ``[rows, I]`` with their own row strides, so the two halves of
a fused ``[..., 2I]`` projection are read in place. A program covers a ``[BLOCK_M, BLOCK_N]``
tile of about ``_TILE`` elements; the result is fp32 and contiguous. Launch configuration
depends on shapes only (CUDA-graph safe); ``limit`` is a Python float of the op, and whether it
is zero selects the kernel variant.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import ops  # noqa: F401  (declares deepinfer::swiglu_clamp before we register for it)
from ...graphs.moe import swiglu_act
from .pdl import pdl_args, wait_previous

# The unswapped math: a swap (graphs/swap.py) may route the graphs function to this op.
_reference = getattr(swiglu_act, "reference", swiglu_act)

# Measured on an H200 (bf16 in, fp32 out): whole 2048-wide rows per program with 8 warps reach
# ~4.1 TB/s at 49152 x 2048, 5% above 1024-wide halves.
_TILE = 2048
_MAX_BLOCK_N = 2048


@triton.jit
def _swiglu_clamp_kernel(
    gate_ptr,
    up_ptr,
    out_ptr,
    n_rows,
    n_cols,
    stride_gate,
    stride_up,
    limit,
    CLAMP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < n_cols)
    g = tl.load(gate_ptr + rows[:, None] * stride_gate + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows[:, None] * stride_up + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        # Comparisons rather than min/max so that NaN passes through, as torch.clamp does.
        g = tl.where(g > limit, limit, g)
        u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + rows[:, None] * n_cols + cols[None, :], y, mask=mask)


def _as_rows(t: torch.Tensor, n: int) -> torch.Tensor:
    """``t`` as ``[rows, n]`` with unit column stride, viewing rather than copying when it can."""
    t2 = t.reshape(-1, n)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def swiglu_clamp_triton(
    gate: torch.Tensor, up: torch.Tensor, limit: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu(min(gate, limit)) * clamp(up, -limit, limit)`` in fp32 (limit 0: no clamps).

    ``out`` (contiguous fp32 of the inputs' shape) receives the result when given. Inputs
    whose shapes differ (broadcasting) go to the reference.
    """
    if gate.shape != up.shape:
        y = _reference(gate, up, limit)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty(gate.shape, dtype=torch.float32, device=gate.device)
    if gate.numel() == 0:
        return out
    if not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError("swiglu_clamp_triton writes a contiguous fp32 out")
    n = gate.shape[-1]
    g2, u2 = _as_rows(gate, n), _as_rows(up, n)
    n_rows = g2.shape[0]
    block_n = min(triton.next_power_of_2(n), _MAX_BLOCK_N)
    block_m = max(1, min(_TILE // block_n, triton.next_power_of_2(n_rows)))
    num_warps = max(1, min(8, block_m * block_n // 256))
    grid = (triton.cdiv(n_rows, block_m), triton.cdiv(n, block_n))
    _swiglu_clamp_kernel[grid](
        g2,
        u2,
        out,
        n_rows,
        n,
        g2.stride(0),
        u2.stride(0),
        float(limit),
        CLAMP=bool(limit),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=num_warps,
        **pdl_args(out.device),
    )
    return out


torch.library.register_kernel("deepinfer::swiglu_clamp", "cuda", swiglu_clamp_triton)
