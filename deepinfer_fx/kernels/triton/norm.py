"""RMSNorm as one Triton kernel: the CUDA implementation of ``deepinfer::rms_norm``.

Rows of ``x`` (all leading dims flattened) are normalised independently. A program owns
``ROWS`` rows: one row for wide norms (the hidden size, the 4 x hidden mHC input), several for
narrow ones (per-head q norms of 512 or less), so every program moves a few thousand elements.
Rows up to ``_MAX_FUSED`` elements stay in registers between the statistics and the scaling;
wider rows are read twice in chunks. The launch configuration depends on shapes only, so the
launcher can run inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import ops  # noqa: F401  (declares deepinfer::rms_norm before we register for it)
from ...graphs.norm import rms_norm
from .pdl import pdl_args, wait_previous

# The unswapped math: a swap (graphs/swap.py) may route the graphs function to this op.
_reference = getattr(rms_norm, "reference", rms_norm)

# Widest row kept whole in registers: 16384 fp32 over 16 warps is 32 values per thread.
_MAX_FUSED = 16384
# Elements a program aims for when it takes several narrow rows.
_TILE = 4096


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    n_rows,
    stride_x,
    stride_out,
    eps,
    # The row width is a compile-time constant: a model has a handful of norm widths, and the
    # compiler then drops the column masks of power-of-two widths.
    D: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    FUSED: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    row_ok = rows < n_rows
    cols = tl.arange(0, BLOCK)
    x_rows = x_ptr + rows[:, None] * stride_x
    o_rows = out_ptr + rows[:, None] * stride_out
    if FUSED:
        mask = row_ok[:, None] & (cols[None, :] < D)
        x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        y = x * inv[:, None]
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
            y = w[None, :] * y
        tl.store(o_rows + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Wide rows: one pass for the sum of squares, a second that re-reads and scales.
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for start in range(0, D, BLOCK):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < D)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            acc += x * x
        inv = tl.math.rsqrt(tl.sum(acc, axis=1) / D + eps)
        for start in range(0, D, BLOCK):
            c = start + cols
            mask = row_ok[:, None] & (c[None, :] < D)
            x = tl.load(x_rows + c[None, :], mask=mask, other=0.0).to(tl.float32)
            y = x * inv[:, None]
            if HAS_WEIGHT:
                w = tl.load(w_ptr + c, mask=c < D, other=0.0).to(tl.float32)
                y = w[None, :] * y
            tl.store(o_rows + c[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch_config(n_rows: int, d: int) -> tuple[int, int, bool, int]:
    """(ROWS, BLOCK, FUSED, num_warps) from the shape alone."""
    fused = d <= _MAX_FUSED
    block = triton.next_power_of_2(d) if fused else _MAX_FUSED
    rows = max(1, min(_TILE // block, triton.next_power_of_2(n_rows)))
    num_warps = max(1, min(16, rows * block // 512))
    return rows, block, fused, num_warps


def _as_rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t`` as ``[rows, d]`` with unit column stride, viewing rather than copying when it can."""
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``weight * x * rsqrt(mean(x^2) + eps)`` over the last dim, fp32 inside, x's dtype out.

    ``out`` (x's shape and dtype) receives the result when given. Without it the result has
    ``torch.empty_like(x)``'s layout, which is what the op's fake promises to the compiler.
    """
    d = x.shape[-1]
    if weight is not None and tuple(weight.shape) != (d,):
        # A weight that broadcasts some other way: rare enough for the reference.
        y = _reference(x, weight, eps)
        return y if out is None else out.copy_(y)
    if out is None:
        out = torch.empty_like(x)
    if x.numel() == 0:
        return out
    x2 = _as_rows(x, d)
    # The kernel writes rows with unit column stride; any other layout goes through a buffer.
    direct = out.is_contiguous()
    dst = out.view(-1, d) if direct else torch.empty(x2.shape, dtype=out.dtype, device=out.device)
    w = weight.contiguous() if weight is not None else x2
    n_rows = x2.shape[0]
    rows, block, fused, num_warps = _launch_config(n_rows, d)
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x2, w, dst, n_rows, x2.stride(0), dst.stride(0), eps,
        D=d, HAS_WEIGHT=weight is not None, ROWS=rows, BLOCK=block, FUSED=fused, num_warps=num_warps,
        **pdl_args(x.device),
    )
    if not direct:
        out.copy_(dst.view(out.shape))
    return out


torch.library.register_kernel("deepinfer::rms_norm", "cuda", rms_norm_triton)
