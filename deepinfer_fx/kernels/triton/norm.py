"""RMSNorm as one Triton kernel: the CUDA implementation of ``deepinfer::rms_norm`` and, with
the rotation of each row's tail fused in, of ``deepinfer::rms_norm_rope``.

Rows of ``x`` (all leading dims flattened) are normalised independently. A program owns
``ROWS`` rows: one row for wide norms (the hidden size, the 4 x hidden mHC input), several for
narrow ones (per-head q norms of 512 or less), so every program moves a few thousand elements.
Rows up to ``_MAX_FUSED`` elements stay in registers between the statistics and the scaling;
wider rows are read twice in chunks. The launch configuration depends on shapes only, so the
launcher can run inside a CUDA graph.

With rope tables (``HALF`` > 0 pairs) a row kept in registers is rounded to the output dtype as
the norm alone stores it, then its last ``2 * HALF`` channels turn in adjacent pairs (2i, 2i+1)
by the angle of the row's position (row r reads table row ``r // heads``), as
``graphs/rope.py::apply_rope`` turns the stored norm: the same roundings, in one pass over the
row. Pairs before the tail take cos 1, sin 0, which leaves them as they are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import ops  # noqa: F401  (declares deepinfer::rms_norm before we register for it)
from ..ops_rope import NORM_ROPE_MAX_WIDTH, norm_rope_unserved  # (importing it declares deepinfer::rms_norm_rope)
from ...graphs.norm import rms_norm
from ...graphs.rope import norm_rope
from .pdl import pdl_args, wait_previous

# The unswapped math: a swap (graphs/swap.py) may route the graphs functions to these ops.
_reference = getattr(rms_norm, "reference", rms_norm)
_rope_reference = getattr(norm_rope, "reference", norm_rope)

# Widest row kept whole in registers: 16384 fp32 over 16 warps is 32 values per thread.
_MAX_FUSED = NORM_ROPE_MAX_WIDTH
# Elements a program aims for when it takes several narrow rows.
_TILE = 4096


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    cos_ptr,
    sin_ptr,
    n_rows,
    heads,
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
    HALF: tl.constexpr,
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
        if HALF > 0:
            a, b = tl.split(tl.reshape(y.to(out_ptr.dtype.element_ty).to(tl.float32), (ROWS, BLOCK // 2, 2)))
            pair = tl.arange(0, BLOCK // 2) - (D // 2 - HALF)  # index into the tables; < 0 before the tail
            tab_ok = row_ok[:, None] & (pair[None, :] >= 0) & (pair[None, :] < HALF)
            table = (rows // heads)[:, None] * HALF + pair[None, :]
            cos = tl.load(cos_ptr + table, mask=tab_ok, other=1.0).to(tl.float32)
            sin = tl.load(sin_ptr + table, mask=tab_ok, other=0.0).to(tl.float32)
            y = tl.reshape(tl.join(a * cos - b * sin, a * sin + b * cos), (ROWS, BLOCK))
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


def _launch_config(d: int) -> tuple[int, int, bool, int]:
    """(ROWS, BLOCK, FUSED, num_warps) from the row width alone, never the row count: the tile's
    layout, and with it the order in which a row's squares are summed, is then the same in every
    batch (batch invariance), at the cost of masked rows in a program at tiny row counts."""
    fused = d <= _MAX_FUSED
    block = triton.next_power_of_2(d) if fused else _MAX_FUSED
    rows = max(1, _TILE // block)
    num_warps = max(1, min(16, rows * block // 512))
    return rows, block, fused, num_warps


def _as_rows(t: torch.Tensor, d: int) -> torch.Tensor:
    """``t`` as ``[rows, d]`` with unit column stride, viewing rather than copying when it can."""
    t2 = t.reshape(-1, d)
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    out: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
) -> torch.Tensor:
    """``weight * x * rsqrt(mean(x^2) + eps)`` over the last dim, fp32 inside, x's dtype out;
    with ``cos`` / ``sin`` (``[*P, rd/2]``, exactly x's leading dims) the result's tails then
    rotate (``graphs/rope.py::norm_rope``).

    ``out`` (x's shape and dtype) receives the result when given. Without it the result has
    ``torch.empty_like(x)``'s layout, which is what the ops' fakes promise to the compiler.
    """
    d = x.shape[-1]
    half = 0 if cos is None else cos.shape[-1]
    if cos is not None and (
        sin is None or sin.shape != cos.shape or x.shape[: cos.dim() - 1] != cos.shape[:-1] or not 0 < 2 * half <= d
    ):
        raise ValueError(
            f"rms_norm_rope: x {tuple(x.shape)} with cos {tuple(cos.shape)}, "
            f"sin {None if sin is None else tuple(sin.shape)}: the tables need x's leading dims and rd/2 <= d/2"
        )
    if cos is None:
        unserved = weight is not None and tuple(weight.shape) != (d,)
    else:  # the norm_rope_kernel swap declines these calls
        unserved = bool(norm_rope_unserved(x.shape, None if weight is None else weight.shape, cos.shape, sin.shape))
    if unserved:
        # A weight that broadcasts some other way, an odd or a very wide rotated row: rare enough
        # for the reference.
        y = _reference(x, weight, eps) if cos is None else _rope_reference(x, weight, eps, cos, sin)
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
    rows, block, fused, num_warps = _launch_config(d)
    # Without tables the table pointers are never read: x stands in for them.
    tables = (x2, x2, 1) if cos is None else (cos.contiguous(), sin.contiguous(), n_rows // cos[..., 0].numel())
    _rms_norm_kernel[(triton.cdiv(n_rows, rows),)](
        x2,
        w,
        dst,
        tables[0],
        tables[1],
        n_rows,
        tables[2],
        x2.stride(0),
        dst.stride(0),
        eps,
        D=d,
        HAS_WEIGHT=weight is not None,
        ROWS=rows,
        BLOCK=block,
        FUSED=fused,
        HALF=half,
        num_warps=num_warps,
        **pdl_args(x.device),
    )
    if not direct:
        out.copy_(dst.view(out.shape))
    return out


def _rms_norm_rope_cuda(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    return rms_norm_triton(x, weight, eps, None, cos, sin)


torch.library.register_kernel("deepinfer::rms_norm", "cuda", rms_norm_triton)
torch.library.register_kernel("deepinfer::rms_norm_rope", "cuda", _rms_norm_rope_cuda)
