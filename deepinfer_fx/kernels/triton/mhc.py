"""One mHC site in two Triton launches: the CUDA implementation of ``deepinfer::mhc_site``
(``graphs/mhc.py::mhc_site``).

Compiled as written a site is ~6 launches (the fp32 mixing GEMV as a cuBLAS dot kernel plus
its split-K reduction, the RMS statistic, Sinkhorn, pointwise kernels, the collapse), 16 sites
a decode step; at prefill the fp32 GEMM ran on SIMT cores at ~140 us a call. Here:

Launch 1 (``_mhc_dots_kernel``, grid ``(cdiv(T, BT), KSPLIT)``): a program multiplies ``BT``
tokens' flattened rows ``X[t] (N*D)``, over one K-chunk, by every row of ``fn`` (``M = 2N +
N^2`` rows, padded to a power of two) with ``tl.dot`` in true fp32 (``input_precision="ieee"``:
the spec keeps mHC in fp32, tf32 would drop 13 mantissa bits), and sums the squares of the
same elements. It writes fp32 partials ``[KSPLIT, T, M + 1]`` (M dots, then the sum of squares).
The RMS scale is applied after the product: ``rms_norm(x) @ fn.T == (x @ fn.T) * r`` with ``r``
the row's reciprocal RMS, so X is read once for both.

Launch 2 (``_mhc_finish_kernel``, grid ``(T, cdiv(D, BLOCK_D))``): a program sums the token's
partials of ``pre`` over the splits, scales them by ``r`` and collapses one block of D channels,
``u[d] = sum_j c_j X[j, d]`` with ``c`` = ``pre_in`` or ``pre``; block 0 also forms and stores
``pre``, ``post`` and the Sinkhorn ``comb`` (an ``N x N`` tile in registers, ``sinkhorn.py``'s
math). Every block recomputing ``pre`` (a few hundred partials read) is cheaper than a third
launch, and spreads a decode token's collapse over several SMs instead of one.

Splits (not measured, reasoned): ``KSPLIT`` aims at 32 chunks of the ``N*D`` row, whole
multiples of the ``BK`` tile (16384 = 32 x 512 at the model's N = 4, D = 4096). A decode token
then spreads the 1.5 MiB of ``fn`` over 32 programs (a batch of 64: 128 programs, about one per
SM of an H200), while a 4096-token prefill writes ~13 MB of partials against the 128 MiB of X
it reads. ``BT = 16`` is ``tl.dot``'s smallest M; at T = 1 fifteen rows compute zeros, which
costs FMA issue (~1 us a program) but no memory.

Batch invariance: ``BT``, the chunks and ``BLOCK_D`` depend on N and D only, a row's dot
accumulates over k in the same order in whichever tile row it sits, and the split sums run in
a fixed tree; so a token's outputs are bit-identical alone or in any batch. The launch
configuration reads shapes only, so the launcher can run inside a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import ops_mhc  # noqa: F401  (declares deepinfer::mhc_site before we register for it)
from ...graphs.mhc import mhc_site
from .buffers import out_buffer
from .sinkhorn import sinkhorn_tile

# The unswapped math, for stream counts the kernel does not tile (not a power of two).
_reference = getattr(mhc_site, "reference", mhc_site)

_BT = 16  # tokens per launch-1 program: tl.dot's smallest M
# Row elements per launch-1 tile. An fp32 "ieee" dot is plain FMAs that stream their operands
# from shared memory, so registers do not grow with BK (64 registers, no spill, at 32 to 128);
# 64 keeps the chunks of small rows fine-grained, at 24 KiB of shared memory a program.
_BK = 64
_SPLITS = 32  # the number of K-chunks launch 1 aims for
_BLOCK_D = 1024  # channels per launch-2 program
_MAX_N = 16


@triton.jit
def _mhc_dots_kernel(x_ptr, fn_ptr, part_ptr, n_tokens, stride_xt,
                     K: tl.constexpr, M: tl.constexpr, MP: tl.constexpr, CHUNK: tl.constexpr,
                     BT: tl.constexpr, BK: tl.constexpr):
    """Tokens ``[BT]`` x one K-chunk -> partial dots ``[BT, M]`` and sums of squares ``[BT]``."""
    tok = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    split = tl.program_id(1)
    tok_ok = tok < n_tokens
    m = tl.arange(0, MP)
    m_ok = m < M
    acc = tl.zeros([BT, MP], tl.float32)
    ss = tl.zeros([BT], tl.float32)
    for i in range(0, CHUNK, BK):
        k = split * CHUNK + i + tl.arange(0, BK)
        k_ok = k < K
        # Padding tokens and columns load zeros: they add nothing and are never stored.
        x = tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=tok_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(fn_ptr + k[:, None] + m[None, :] * K, mask=k_ok[:, None] & m_ok[None, :], other=0.0).to(tl.float32)
        acc = tl.dot(x, w, acc, input_precision="ieee")
        ss += tl.sum(x * x, axis=1)
    row = part_ptr + (split * n_tokens + tok) * (M + 1)
    tl.store(row[:, None] + m[None, :], acc, mask=tok_ok[:, None] & m_ok[None, :])
    tl.store(row + M, ss, mask=tok_ok)


@triton.jit
def _mhc_finish_kernel(part_ptr, base_ptr, scale_ptr, x_ptr, pre_in_ptr, pre_ptr, post_ptr, comb_ptr, u_ptr,
                       n_tokens, stride_xt, rms_eps, hc_eps,
                       N: tl.constexpr, D: tl.constexpr, KSPLIT: tl.constexpr, KS_BLOCK: tl.constexpr,
                       ITERS: tl.constexpr, HAS_PRE_IN: tl.constexpr, BLOCK_D: tl.constexpr):
    """Token ``t``: coefficients from the partials, and channels ``d`` of its collapse."""
    M: tl.constexpr = 2 * N + N * N
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    s = tl.arange(0, KS_BLOCK)
    s_ok = s < KSPLIT
    rows = part_ptr + (s.to(tl.int64) * n_tokens + t) * (M + 1)
    ss = tl.sum(tl.load(rows + M, mask=s_ok, other=0.0), axis=0)
    r = tl.math.rsqrt(ss / (N * D) + rms_eps)
    j = tl.arange(0, N)
    jj = j[:, None] * N + j[None, :]
    # Each group of mixes is loaded in its own shape (splits first) and summed over the splits.
    m_pre = tl.sum(tl.load(rows[:, None] + j[None, :], mask=s_ok[:, None], other=0.0), axis=0)
    pre = tl.sigmoid(m_pre * r * tl.load(scale_ptr) + tl.load(base_ptr + j)) + hc_eps
    if blk == 0:  # the coefficients are stored once; the other blocks only need pre
        m_post = tl.sum(tl.load(rows[:, None] + N + j[None, :], mask=s_ok[:, None], other=0.0), axis=0)
        m_comb = tl.sum(tl.load(rows[:, None, None] + 2 * N + jj[None, :, :], mask=s_ok[:, None, None], other=0.0), axis=0)
        post = 2 * tl.sigmoid(m_post * r * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + j))
        comb_logit = m_comb * r * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + jj)
        tl.store(pre_ptr + t * N + j, pre)
        tl.store(post_ptr + t * N + j, post)
        tl.store(comb_ptr + t * (N * N) + jj, sinkhorn_tile(comb_logit, hc_eps, ITERS))
    if HAS_PRE_IN:
        c = tl.load(pre_in_ptr + t * N + j)
    else:
        c = pre
    d = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    x = tl.load(x_ptr + t * stride_xt + j[:, None] * D + d[None, :], mask=d_ok[None, :], other=0.0).to(tl.float32)
    u = tl.sum(c[:, None] * x, axis=0)
    tl.store(u_ptr + t * D + d, u.to(u_ptr.dtype.element_ty), mask=d_ok)


def launch_config(n: int, d: int) -> dict[str, dict[str, int]]:
    """Both launches' block constants and warps for N streams of D channels (never T)."""
    k = n * d
    chunk = _BK * triton.cdiv(triton.cdiv(k, _SPLITS), _BK)
    ksplit = triton.cdiv(k, chunk)
    block_d = min(_BLOCK_D, triton.next_power_of_2(d))
    return {
        "dots": {"CHUNK": chunk, "BT": _BT, "BK": _BK, "MP": max(16, triton.next_power_of_2(2 * n + n * n)), "num_warps": 4},
        "finish": {"KSPLIT": ksplit, "KS_BLOCK": triton.next_power_of_2(ksplit), "BLOCK_D": block_d,
                   "num_warps": max(1, min(4, n * block_d // 1024))},
    }


def mhc_site_triton(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    iters: int,
    pre_in: Optional[torch.Tensor],
    out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_site`` in two launches: fp32 pre ``[..., N]``, post ``[..., N]``, comb ``[..., N, N]``
    and ``u`` ``[..., D]`` in X's dtype. ``out`` (contiguous tensors of those shapes and dtypes)
    receives them when given; otherwise they are new contiguous tensors, as the op's fake says."""
    *lead, n, d = X.shape
    if n > _MAX_N or n & (n - 1):  # not tiled here: the reference
        ref = tuple(r.contiguous() for r in _reference(X, fn, base, scale, rms_eps, hc_eps, iters, pre_in))
        return ref if out is None else tuple(o.copy_(r) for o, r in zip(out, ref))  # type: ignore[return-value]
    m = 2 * n + n * n
    if tuple(fn.shape) != (m, n * d) or base.numel() != m or scale.numel() != 3:
        raise ValueError(f"mhc_site: fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)} do not fit X {tuple(X.shape)}")
    x = X.reshape(-1, n, d)
    if x.stride(2) != 1 or x.stride(1) != d:  # launch 1 reads a token's N*D elements as one row
        x = x.contiguous()
    t = x.shape[0]
    dev = X.device
    shapes = ((*lead, n), (*lead, n), (*lead, n, n), (*lead, d))
    dtypes = (torch.float32, torch.float32, torch.float32, X.dtype)
    names = ("pre", "post", "comb", "u")
    pre, post, comb, u = (out_buffer(o, s, dt, dev, f"mhc_site {name}")
                          for o, s, dt, name in zip(out or (None,) * 4, shapes, dtypes, names))
    if t == 0:
        return pre, post, comb, u
    cfg = launch_config(n, d)
    dots, finish = cfg["dots"], cfg["finish"]
    part = torch.empty((finish["KSPLIT"], t, m + 1), dtype=torch.float32, device=dev)
    _mhc_dots_kernel[(triton.cdiv(t, dots["BT"]), finish["KSPLIT"])](
        x, fn.contiguous(), part, t, x.stride(0), K=n * d, M=m, **dots,
    )
    pre_in_rows = pre if pre_in is None else pre_in.reshape(t, n).float().contiguous()  # unread without pre_in
    _mhc_finish_kernel[(t, triton.cdiv(d, finish["BLOCK_D"]))](
        part, base.float().contiguous(), scale.float().contiguous(), x, pre_in_rows, pre, post, comb, u,
        t, x.stride(0), float(rms_eps), float(hc_eps),
        N=n, D=d, ITERS=int(iters), HAS_PRE_IN=pre_in is not None, **finish,
    )
    return pre, post, comb, u


torch.library.register_kernel("deepinfer::mhc_site", "cuda", mhc_site_triton)
