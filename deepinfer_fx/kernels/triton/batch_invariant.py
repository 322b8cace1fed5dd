"""``deepinfer::bi_matmul`` on CUDA (``kernels/ops_bi.py``): ``y = x @ w.T`` whose rows do
not depend on M, for batch-invariant inference (``passes/batch_invariant.py``).

One tiling for every M: ``BM`` x ``BN`` output tiles, the whole K walked in ``BK`` steps in
ascending order by one program, accumulated in fp32 (no split-K, no atomics, M never chosen
on). A row's dot products are then the same MMA sequence alone or in any batch and at any
position in its tile, since a tensor-core MMA reduces each output the same way; the column
tile may follow N (``tiles``), which a row's bits may depend on. fp32 operands multiply in IEEE
fp32 (no TF32). Simple by design: no TMA, no PDL, no persistent schedule; what it costs
against cuBLAS and the skinny kernel is what ``bench/batch_invariant.py`` measures.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import ops_bi  # noqa: F401  (declares deepinfer::bi_matmul before we register for it)

BM = 64  # rows per tile: fixed, never chosen from M
BK = 64
BK_FP32 = 32  # fp32 operands (IEEE dots): 64-wide k steps spilled ~400 bytes at sm_90
WARPS, STAGES = 4, 3


def tiles(n: int) -> int:
    """The column tile for a weight of ``n`` rows: narrower tiles where N alone gives few programs
    (decode is weight streaming; without split-K the column tiles are all the parallelism)."""
    return 64 if n >= 8192 else 32


@triton.jit(do_not_specialize=["M"])  # one binary for every M
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
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
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
    tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, out, mask=(rm[:, None] < M) & (rn[None, :] < N))


def bi_matmul_triton(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    """x ``[M, K]``, w ``[N, K]`` -> ``[M, N]`` in x's dtype or fp32, rows independent of M."""
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=torch.float32 if out_fp32 else x.dtype)
    if m == 0:
        return y
    bn = tiles(n)
    _bi_matmul_kernel[(triton.cdiv(m, BM), triton.cdiv(n, bn))](
        x,
        w,
        y,
        m,
        n,
        *x.stride(),
        *w.stride(),
        *y.stride(),
        K=k,
        BM=BM,
        BN=bn,
        BK=BK_FP32 if x.dtype == torch.float32 else BK,
        IEEE=x.dtype == torch.float32,
        num_warps=WARPS,
        num_stages=STAGES,
    )
    return y


torch.library.register_kernel("deepinfer::bi_matmul", "cuda", bi_matmul_triton)
