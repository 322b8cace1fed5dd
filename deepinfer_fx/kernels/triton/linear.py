"""Skinny GEMM ``y = x @ w.T`` for few rows and a large weight: the CUDA implementation of
``deepinfer::skinny_linear`` (``kernels/ops_linear.py``).

With M <= 64 rows the work is streaming ``w`` ``[N, K]`` once from HBM, so the tiling serves
bandwidth rather than FLOPs (the decode tiles of the MoE kernels, ``moe_kernels.py``): 16-row
blocks (the smallest ``tl.dot`` takes), many programs over N, each streaming its weight tiles
through a software pipeline with fp32 accumulation. When N has too few column tiles to fill the
GPU (about two programs per SM), K is split as well: each split writes an fp32 partial and a
second launch sums them in split order.

Batch invariance: the tiles and the split depend on N and K only, M is not specialised on, and
every row's dot products run the same k order in every 16-row block, whatever M or the other
rows are; partials are summed in a fixed order (no atomics). So row m's result is the same
bits alone or inside a batch, which decode needs (a request must not change with its company).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .. import ops_linear  # noqa: F401  (declares deepinfer::skinny_linear before we register for it)

BM = 16  # rows per block: fixed, never chosen from M (batch invariance)
# About two programs per SM of an H200 (132 SMs), as the MoE decode tiles aim for.
_MIN_PROGRAMS = 256
_MAX_SPLIT = 16
_SUM_BLOCK = 1024


class Tiles(NamedTuple):
    """Launch configuration: column tile, k tile, K splits, warps, pipeline stages."""

    bn: int
    bk: int
    split: int
    warps: int
    stages: int


def choose_tiles(n: int, k: int) -> Tiles:
    """The tiling for a weight ``[n, k]``; never a function of the row count.

    Wide weights (the head, ``wq_b``) fill the GPU with column tiles alone: the widest tile
    that still gives ``_MIN_PROGRAMS`` programs. Narrower ones (``wo_b``, ``wq_a``, ``wkv``)
    take 64- or 32-column tiles and split K until they do, each split keeping at least two k
    tiles; fewer splits where possible, since the partials cost traffic that grows with M."""
    bk = min(128, max(16, triton.next_power_of_2(k)))
    for bn, stages in ((128, 3), (64, 4), (32, 4)):
        if triton.cdiv(n, bn) >= _MIN_PROGRAMS:
            return Tiles(bn, bk, 1, 4, stages)
    bn = 64 if triton.cdiv(n, 64) >= 64 else 32
    split = 1
    while triton.cdiv(n, bn) * split < _MIN_PROGRAMS and split < _MAX_SPLIT and k >= 4 * split * bk:
        split *= 2
    return Tiles(bn, bk, split, 4, 4)


@triton.jit(do_not_specialize=["M", "stride_os"])  # M-dependent: one binary for every M
def _skinny_kernel(
    x_ptr, w_ptr, out_ptr, M, N,
    stride_xm, stride_xk, stride_wn, stride_wk, stride_os,
    K: tl.constexpr, K_SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    EVEN: tl.constexpr, PREC: tl.constexpr,
):
    """out[split, rows, cols] = x[rows, ks] @ w[cols, ks].T over the split's k range ``ks``,
    fp32 accumulation, stored in out's dtype: the result itself when there is one split, else
    the split's fp32 partial. Axis 0 runs over row blocks so that the blocks sharing a weight
    tile run side by side and all but the first read it from L2."""
    tile_m = tl.program_id(0)
    tile_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = tile_m * BM + tl.arange(0, BM)
    cols = tile_n * BN + tl.arange(0, BN)
    offs_k = split * K_SPLIT + tl.arange(0, BK)
    rmask = rows < M
    nmask = cols < N
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + cols.to(tl.int64)[None, :] * stride_wn + offs_k[:, None] * stride_wk
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BK):
        if EVEN:
            a = tl.load(x_ptrs, mask=rmask[:, None], other=0.0)
            b = tl.load(w_ptrs)
        else:
            # Splits tile [0, K) exactly, so a split's own k range needs no bound but K.
            kmask = offs_k < K - k0
            a = tl.load(x_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
        acc = tl.dot(a, b.to(dtype), acc, input_precision=PREC)
        x_ptrs += BK * stride_xk
        w_ptrs += BK * stride_wk
    out_ptrs = out_ptr + split.to(tl.int64) * stride_os + rows.to(tl.int64)[:, None] * N + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, N, stride_s, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out[row, cols] = part[0, row, cols] + part[1, row, cols] + ... in split order."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    offs = row * N + cols
    acc = tl.load(part_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + s * stride_s + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def skinny_linear_triton(x: torch.Tensor, w: torch.Tensor, out_fp32: bool, tiles: Tiles | None = None) -> torch.Tensor:
    """``deepinfer::skinny_linear``: x ``[M, K]`` times w ``[N, K]`` (both of one dtype, any
    strides) -> ``[M, N]`` in x's dtype or fp32. ``tiles`` overrides ``choose_tiles`` (tests
    and the tile sweep of ``bench/skinny_linear.py``). Any M works; the tiling serves M <= 64."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_linear: x [M, K] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.dtype != w.dtype:
        raise ValueError(f"skinny_linear: x and w must share a dtype, got {x.dtype} and {w.dtype}")
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty(m, n, dtype=torch.float32 if out_fp32 else x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    t = tiles or choose_tiles(n, k)
    k_split = triton.cdiv(triton.cdiv(k, t.split), t.bk) * t.bk
    splits = triton.cdiv(k, k_split)
    dst = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _skinny_kernel[(triton.cdiv(m, BM), triton.cdiv(n, t.bn), splits)](
        x, w, dst, m, n,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), m * n,
        K=k, K_SPLIT=k_split, BM=BM, BN=t.bn, BK=t.bk,
        EVEN=n % t.bn == 0 and k % k_split == 0, PREC="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=t.warps, num_stages=t.stages,
    )
    if splits > 1:
        block = min(_SUM_BLOCK, triton.next_power_of_2(n))
        _sum_splits_kernel[(m, triton.cdiv(n, block))](dst, out, n, m * n, SPLITS=splits, BLOCK=block, num_warps=4)
    return out


def _skinny_linear_cuda(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    return skinny_linear_triton(x, w, out_fp32)


torch.library.register_kernel("deepinfer::skinny_linear", "cuda", _skinny_linear_cuda)
