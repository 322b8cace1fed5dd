"""``deepinfer::bi_matmul`` on CUDA (``kernels/ops_bi.py``): ``y = x @ w.T`` whose rows do
not depend on M, for batch-invariant inference (``passes/batch_invariant.py``).

What a row's bits depend on is the order of its k-reduction, not the tile: a program walks its
k range in ascending ``BK`` steps into one fp32 accumulator, and a tensor-core MMA (or an IEEE
fp32 FMA chain) adds each k step into an output the same way at any tile size, warp count or
position in the tile. On an H100 every tiling tried gave the same bits (BM 16 to 128, BN 32 to
256, BK 32 to 128, 1 to 8 warps, mma and wgmma; docs/decisions.md), so the tile follows M: small
tiles where a decode batch has a few rows, large ones at prefill.

The k chunks are the one thing fixed by the weight alone: where N's column tiles are too few to
spread a decode step's weight read over the GPU, K is cut into ``splits(n, k)`` chunks, each
summed by its own program into fp32 partials, and a second launch adds the partials in chunk
order. M never enters that choice, so a row sees the same chunks alone and in any batch; the
partials cost ``splits x M x N x 4`` bytes, small for the narrow weights that split. fp32
operands multiply in IEEE fp32 (no TF32). No TMA, no PDL, no persistent schedule: what it
costs against cuBLAS and the skinny kernel is what ``bench/batch_invariant.py`` measures.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import ops_bi  # noqa: F401  (declares deepinfer::bi_matmul before we register for it)

_PROGRAMS = 128  # the column tiles x k chunks a decode step aims for (an H100 / H200 has 132 SMs)
_CHUNK_MIN = 256  # the narrowest k chunk: a multiple of every BK below
_DECODE_BN = 32  # column tile of a decode-sized call: N / 32 programs before any split


def splits(n: int, k: int) -> int:
    """The k chunks of a weight of ``n`` rows and ``k`` columns: a power of two that brings the
    decode-sized launch's programs up to ``_PROGRAMS`` while every chunk stays a multiple of
    ``_CHUNK_MIN`` wide. Reads the weight's shape only."""
    s = 1
    while triton.cdiv(n, _DECODE_BN) * s < _PROGRAMS and k % (2 * s * _CHUNK_MIN) == 0:
        s *= 2
    return s


def tiles(m: int, fp32: bool) -> dict[str, int]:
    """The launch tile for ``m`` rows (any tile gives a row the same bits, above)."""
    if fp32:  # FMA dots: 64-wide k steps spilled at sm_90
        return dict(BM=16 if m <= 16 else 64, BN=32, BK=32, num_warps=4, num_stages=3)
    if m <= 16:
        return dict(BM=16, BN=_DECODE_BN, BK=128, num_warps=4, num_stages=4)
    if m <= 256:
        return dict(BM=64, BN=64, BK=64, num_warps=4, num_stages=4)
    return dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=3)


@triton.jit(do_not_specialize=["M"])  # one binary for every M of a tile class
def _bi_matmul_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    sxm,
    sxk,
    swn,
    swk,
    sym,
    syn,
    sys,
    K: tl.constexpr,
    CHUNK: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, pid_n, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(chunk * CHUNK, chunk * CHUNK + CHUNK, BK):
        kk = k0 + rk
        a = tl.load(
            x_ptr + rm[:, None] * sxm + kk[None, :] * sxk, mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0
        )
        b = tl.load(
            w_ptr + rn[None, :] * swn + kk[:, None] * swk, mask=(rn[None, :] < N) & (kk[:, None] < K), other=0.0
        )
        b = b.to(x_ptr.dtype.element_ty)
        if IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    out = acc.to(y_ptr.dtype.element_ty)
    dst = y_ptr + chunk * sys + rm[:, None] * sym + rn[None, :] * syn
    tl.store(dst, out, mask=(rm[:, None] < M) & (rn[None, :] < N))


@triton.jit
def _sum_chunks_kernel(part_ptr, y_ptr, MN, S: tl.constexpr, BLOCK: tl.constexpr):
    """y = the fp32 partials [S, M*N] added in chunk order 0, 1, ..., S-1."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.load(part_ptr + offs, mask=ok, other=0.0)
    for s in tl.static_range(1, S):
        acc += tl.load(part_ptr + s * MN + offs, mask=ok, other=0.0)
    tl.store(y_ptr + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


def bi_matmul_triton(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    """x ``[M, K]``, w ``[N, K]`` -> ``[M, N]`` in x's dtype or fp32, rows independent of M."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=torch.float32 if out_fp32 else x.dtype)
    if m == 0:
        return y
    fp32 = x.dtype == torch.float32
    t = tiles(m, fp32)
    s = splits(n, k)
    part = y if s == 1 else torch.empty(s, m, n, device=x.device, dtype=torch.float32)
    _bi_matmul_kernel[(triton.cdiv(m, t["BM"]), triton.cdiv(n, t["BN"]), s)](
        x,
        w,
        part,
        m,
        n,
        *x.stride(),
        *w.stride(),
        part.stride(-2),
        part.stride(-1),
        part.stride(0) if s > 1 else 0,
        K=k,
        CHUNK=k // s if s > 1 else triton.cdiv(k, t["BK"]) * t["BK"],
        IEEE=fp32,
        **t,
    )
    if s > 1:
        block = 1024
        _sum_chunks_kernel[(triton.cdiv(m * n, block),)](part, y, m * n, S=s, BLOCK=block, num_warps=4)
    return y


torch.library.register_kernel("deepinfer::bi_matmul", "cuda", bi_matmul_triton)
