"""Rotary embedding in place as one Triton kernel: the CUDA implementation of ``deepinfer::rope_``.

x ``[*P, *M, d]`` is read as rows of d channels (positions x middle dims flattened); row r takes
the cos / sin row of position ``r // prod(M)``. A program owns ``ROWS`` rows and rotates their
last ``rd`` channels in adjacent pairs (2i, 2i+1), in fp32, storing x's dtype back where it read
them: the other ``d - rd`` channels are never touched, so a ``[T, 64, 512]`` query moves an
eighth of its bytes. The tail is loaded as one contiguous vector a row and its pairs are split
apart in registers (the tables are a few KiB per program, shared by the middle dims through the
cache). The launch configuration depends on shapes only, so the launcher can run inside a CUDA
graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import ops_rope  # noqa: F401  (declares deepinfer::rope_ before we register for it)
from .pdl import pdl_args, wait_previous

# Elements a program rotates: 64 rows of a 64-channel tail, 16 bf16 values per thread.
_TILE = 4096
_NUM_WARPS = 8


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    n_rows,
    heads,
    stride_x,
    # Widths are compile-time constants (a model has a few): power-of-two tails then need no
    # column masks and their loads vectorise.
    D: tl.constexpr,
    HALF: tl.constexpr,
    INVERSE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    i = tl.arange(0, BLOCK_HALF)
    pair_mask = row_ok[:, None] & (i[None, :] < HALF)
    table = (rows // heads)[:, None] * HALF + i[None, :]
    cos = tl.load(cos_ptr + table, mask=pair_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + table, mask=pair_mask, other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin
    j = tl.arange(0, 2 * BLOCK_HALF)
    tail_mask = row_ok[:, None] & (j[None, :] < 2 * HALF)
    tail_ptrs = x_ptr + rows[:, None] * stride_x + (D - 2 * HALF) + j[None, :]
    tail = tl.load(tail_ptrs, mask=tail_mask, other=0.0).to(tl.float32)
    a, b = tl.split(tl.reshape(tail, (ROWS, BLOCK_HALF, 2)))
    rotated = tl.reshape(tl.join(a * cos - b * sin, a * sin + b * cos), (ROWS, 2 * BLOCK_HALF))
    tl.store(tail_ptrs, rotated.to(x_ptr.dtype.element_ty), mask=tail_mask)


def launch_config(n_rows: int, half: int) -> dict[str, int]:
    """The kernel's block constants and warps, from the shape alone."""
    width = 2 * triton.next_power_of_2(half)
    rows = max(1, min(_TILE // width, triton.next_power_of_2(n_rows)))
    return {"ROWS": rows, "BLOCK_HALF": width // 2, "num_warps": max(1, min(_NUM_WARPS, rows * width // 512))}


def rope_triton_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> None:
    """``x = apply_rope(x, cos, sin, inverse)`` in place, touching only the rotated tail;
    cos / sin (any float dtype) must have exactly x's leading dims (the op's contract)."""
    half, d = cos.shape[-1], x.shape[-1]
    lead = cos.shape[:-1]
    if sin.shape != cos.shape or x.shape[: len(lead)] != lead or not 0 < 2 * half <= d:
        raise ValueError(f"rope: x {tuple(x.shape)} with cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    if x.numel() == 0:
        return
    try:  # rows of d channels a fixed stride apart, without a copy (a copy would be rotated instead of x)
        rows = x.view(-1, d)
    except RuntimeError:
        rows = None
    if rows is None or rows.stride(-1) != 1:
        tail = x[..., d - 2 * half :].contiguous()
        rope_triton_(tail, cos, sin, inverse)
        x[..., d - 2 * half :] = tail
        return
    n_rows = rows.shape[0]
    cfg = launch_config(n_rows, half)
    _rope_kernel[(triton.cdiv(n_rows, cfg["ROWS"]),)](
        rows,
        cos.reshape(-1, half).contiguous(),
        sin.reshape(-1, half).contiguous(),
        n_rows,
        n_rows // math.prod(lead),
        rows.stride(0),
        D=d,
        HALF=half,
        INVERSE=inverse,
        **cfg,
        **pdl_args(x.device),
    )


torch.library.register_kernel("deepinfer::rope_", "cuda", rope_triton_)
