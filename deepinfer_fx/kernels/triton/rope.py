"""Rotary embedding as one Triton kernel: the CUDA implementation of ``deepinfer::rope``.

x ``[*P, *M, d]`` is read as rows of d channels (positions x middle dims flattened); row r takes
the cos / sin row of position ``r // prod(M)``. A program owns ``ROWS`` whole rows: it copies
the first ``d - rd`` channels and rotates the last ``rd`` in adjacent pairs (2i, 2i+1), in fp32,
storing x's dtype. Both parts are loaded as contiguous vectors; the pairs are split apart in
registers, so every byte of x is read once and written once (the tables are a few KiB per
program, shared by the middle dims through the cache). The launch configuration depends on
shapes only, so the launcher can run inside a CUDA graph.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import ops_rope  # noqa: F401  (declares deepinfer::rope before we register for it)
from .buffers import out_buffer

# Elements a program moves: 8 rows of 512 at the model's widths, 16 bf16 values per thread.
_TILE = 4096
_NUM_WARPS = 8


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_rows,
    heads,
    stride_x,
    # Widths are compile-time constants (a model has a few): power-of-two parts then need no
    # column masks and their loads vectorise.
    D: tl.constexpr,
    HALF: tl.constexpr,
    INVERSE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    PASS: tl.constexpr = D - 2 * HALF
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    x_rows = x_ptr + rows[:, None] * stride_x
    o_rows = out_ptr + rows[:, None] * D
    if PASS > 0:  # the unrotated head of the row, copied in x's dtype
        c = tl.arange(0, BLOCK_PASS)
        mask = row_ok[:, None] & (c[None, :] < PASS)
        tl.store(o_rows + c[None, :], tl.load(x_rows + c[None, :], mask=mask), mask=mask)

    i = tl.arange(0, BLOCK_HALF)
    pair_mask = row_ok[:, None] & (i[None, :] < HALF)
    table = (rows // heads)[:, None] * HALF + i[None, :]
    cos = tl.load(cos_ptr + table, mask=pair_mask, other=0.0).to(tl.float32)
    sin = tl.load(sin_ptr + table, mask=pair_mask, other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin
    j = tl.arange(0, 2 * BLOCK_HALF)
    tail_mask = row_ok[:, None] & (j[None, :] < 2 * HALF)
    tail = tl.load(x_rows + PASS + j[None, :], mask=tail_mask, other=0.0).to(tl.float32)
    a, b = tl.split(tl.reshape(tail, (ROWS, BLOCK_HALF, 2)))
    rotated = tl.reshape(tl.join(a * cos - b * sin, a * sin + b * cos), (ROWS, 2 * BLOCK_HALF))
    tl.store(o_rows + PASS + j[None, :], rotated.to(out_ptr.dtype.element_ty), mask=tail_mask)


def launch_config(n_rows: int, d: int, half: int) -> dict[str, int]:
    """The kernel's block constants and warps, from the shape alone."""
    width = triton.next_power_of_2(d)
    rows = max(1, min(_TILE // width, triton.next_power_of_2(n_rows)))
    return {
        "ROWS": rows,
        "BLOCK_PASS": triton.next_power_of_2(max(d - 2 * half, 1)),
        "BLOCK_HALF": triton.next_power_of_2(half),
        "num_warps": max(1, min(_NUM_WARPS, rows * width // 512)),
    }


def rope_triton(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``apply_rope(x, cos, sin, inverse)`` in x's dtype; cos / sin (any float dtype) must have
    exactly x's leading dims (the op's contract). ``out`` (contiguous, x's shape and dtype)
    receives the result when given; otherwise it is a new contiguous tensor, as the op's fake
    promises the compiler."""
    half, d = cos.shape[-1], x.shape[-1]
    lead = cos.shape[:-1]
    if sin.shape != cos.shape or x.shape[: len(lead)] != lead or not 0 < 2 * half <= d:
        raise ValueError(f"rope: x {tuple(x.shape)} with cos {tuple(cos.shape)}, sin {tuple(sin.shape)}")
    out = out_buffer(out, x.shape, x.dtype, x.device, "rope")
    if x.numel() == 0:
        return out
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:  # the kernel reads rows with unit column stride
        x2 = x2.contiguous()
    n_rows = x2.shape[0]
    cfg = launch_config(n_rows, d, half)
    _rope_kernel[(triton.cdiv(n_rows, cfg["ROWS"]),)](
        x2, cos.reshape(-1, half).contiguous(), sin.reshape(-1, half).contiguous(), out,
        n_rows, n_rows // math.prod(lead), x2.stride(0), D=d, HALF=half, INVERSE=inverse, **cfg,
    )
    return out


torch.library.register_kernel("deepinfer::rope", "cuda", rope_triton)
