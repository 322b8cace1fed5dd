"""``deepinfer::bi_sum`` / ``bi_mean`` / ``bi_cumsum`` on CUDA (``kernels/ops_bi.py``): a float sum,
mean or inclusive scan over one dim whose bits do not depend on how many rows are reduced, for
batch-invariant inference.

torch's CUDA reductions split a row over threads, warps and even blocks by the number of rows
(few rows, more threads a row), so a row's sum follows the batch. Here every row of length L is
summed alike: ``ROWS`` rows a program, the row walked in ascending ``BLOCK``-wide steps into an
fp32 vector, then one ``tl.sum``; ``ROWS``, ``BLOCK`` and the warps are functions of L alone, and
a row's reduction tree is the same at every row of the tile. fp32 accumulation, one rounding to
the input's dtype at the end, as torch's sum and mean of bf16 do. A scan walks its row in the
same steps, each a ``tl.cumsum`` plus the carry of the steps before (one program a row).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import ops_bi  # noqa: F401  (declares the ops before we register for them)

_MAX_BLOCK = 1024  # elements of a row per step
_TILE = 2048  # elements a program holds per step: short rows go several to a program


@triton.jit(do_not_specialize=["R"])  # one binary for every row count
def _row_sum_kernel(x_ptr, y_ptr, R, L: tl.constexpr, MEAN: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK)
    acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for c0 in range(0, L, BLOCK):
        mask = (rows[:, None] < R) & (c0 + cols[None, :] < L)
        acc += tl.load(x_ptr + rows[:, None] * L + c0 + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=1)
    if MEAN:
        total = total / L
    tl.store(y_ptr + rows, total.to(y_ptr.dtype.element_ty), mask=rows < R)


@triton.jit(do_not_specialize=["R"])
def _row_scan_kernel(x_ptr, y_ptr, R, L: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    carry = tl.zeros((), dtype=tl.float32)
    for c0 in range(0, L, BLOCK):
        mask = c0 + cols < L
        v = tl.load(x_ptr + row * L + c0 + cols, mask=mask, other=0.0).to(tl.float32)
        run = tl.cumsum(v, axis=0) + carry
        tl.store(y_ptr + row * L + c0 + cols, run.to(y_ptr.dtype.element_ty), mask=mask)
        carry += tl.sum(v, axis=0)


def _rows(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, int]:
    """x with ``dim`` moved last, contiguous, as ``[R, L]``, and L."""
    rows = x.movedim(dim, -1).contiguous()
    n = rows.shape[-1]
    return rows.reshape(rows.shape[:-1].numel(), n), n


def _reduce(x: torch.Tensor, dim: int, keepdim: bool, mean: bool) -> torch.Tensor:
    if not x.is_floating_point():  # integer sums are exact in any order
        return x.mean(dim, keepdim=keepdim) if mean else x.sum(dim, keepdim=keepdim)
    dim = dim % x.dim()
    flat, n = _rows(x, dim)
    out = torch.empty(flat.shape[0], dtype=x.dtype, device=x.device)
    if out.numel():
        block = min(_MAX_BLOCK, triton.next_power_of_2(max(n, 1)))
        per = max(1, _TILE // block)
        _row_sum_kernel[(triton.cdiv(flat.shape[0], per),)](
            flat, out, flat.shape[0], L=n, MEAN=mean and n > 0, ROWS=per, BLOCK=block, num_warps=4
        )
    if mean and n == 0:
        out.fill_(float("nan"))  # torch's mean of nothing
    out = out.view(x.movedim(dim, -1).shape[:-1])
    return out.unsqueeze(dim) if keepdim else out


def bi_sum_triton(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``x.sum(dim, keepdim)`` with each row reduced in an order fixed by its length."""
    return _reduce(x, dim, keepdim, False)


def bi_mean_triton(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """``x.mean(dim, keepdim)``: the fixed-order sum divided by L in fp32, then rounded once."""
    return _reduce(x, dim, keepdim, True)


def bi_cumsum_triton(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``torch.cumsum(x, dim)`` with each row scanned in steps fixed by its length."""
    if not x.is_floating_point():  # integer scans are exact in any order
        return torch.cumsum(x, dim=dim)
    dim = dim % x.dim()
    flat, n = _rows(x, dim)
    out = torch.empty_like(flat)
    if out.numel():
        block = min(_MAX_BLOCK, triton.next_power_of_2(n))
        _row_scan_kernel[(flat.shape[0],)](flat, out, flat.shape[0], L=n, BLOCK=block, num_warps=4)
    return out.view(x.movedim(dim, -1).shape).movedim(-1, dim)


torch.library.register_kernel("deepinfer::bi_sum", "cuda", bi_sum_triton)
torch.library.register_kernel("deepinfer::bi_cumsum", "cuda", bi_cumsum_triton)
torch.library.register_kernel("deepinfer::bi_mean", "cuda", bi_mean_triton)
