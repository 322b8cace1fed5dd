"""One mHC site in two Triton launches: the CUDA implementation of ``deepinfer::mhc_site``
(``graphs/mhc.py::mhc_site``), and through the same two kernels of ``deepinfer::mhc_head``
(``graphs/mhc.py::hc_head``, the final learned collapse).

Compiled as written a site is ~6 launches (the fp32 mixing GEMV as a cuBLAS dot kernel plus
its split-K reduction, the RMS statistic, Sinkhorn, pointwise kernels, the collapse), 16 sites
a decode step; at prefill the fp32 GEMM ran on SIMT cores at ~140 us a call. Here:

Launch 1 (``_mhc_dots_kernel``, grid ``(cdiv(T, BT), KSPLIT)``): a program multiplies ``BT``
tokens' flattened rows ``X[t] (N*D)``, over one K-chunk, by every row of ``fn`` (``M = 2N +
N^2`` rows, padded to a power of two), and sums the squares of the same elements. It writes
fp32 partials ``[T, KSPLIT, M + 1]`` (M dots, then the sum of squares), token-major: launch 2
reads a token's partials as one contiguous block, once per block of channels. The RMS scale is
applied after the product: ``rms_norm(x) @ fn.T == (x @ fn.T) * r`` with ``r`` the row's
reciprocal RMS, so X is read once for both. The spec keeps mHC in fp32 (tf32 would drop 13
mantissa bits), which is met two ways:

- bf16 streams (the model): each fp32 tile of ``fn`` is split exactly into three bf16 tiles
  ``hi + mid + lo`` (8 significand bits each covers fp32's 24), and a bf16 x bf16 product is
  exact in fp32, so three bf16 tensor-core dots, each into its own fp32 accumulator (summed
  smallest first at the end), give the fp32 GEMV's result to within its accumulation rounding.
  Three accumulators rather than one chain let the pipelined loop overlap the parts' MMAs:
  158 -> 142 us a site at 4096 tokens, 601 -> 535 at 16384 (``mhc_kernel_dots_unroll_s16.json``).
  The first version ran one fp32 "ieee" dot (plain FMAs): 21 us a site at one token and ~1.2
  ms at 4096 on an H200, where the reference cuBLAS GEMM + Inductor took 47 us and 0.34 ms
  (``bench/results/mhc_kernel_p8.json``).
- fp32 streams (CPU tests, fp32 runs): one fp32 "ieee" dot.

Launch 2 (``_mhc_finish_kernel``, grid ``(T, cdiv(D, BLOCK_D))``): a program sums the token's
partials of ``pre`` over the splits, scales them by ``r`` and collapses one block of D channels,
``u[d] = sum_j c_j X[j, d]`` with ``c`` = ``pre_in`` or ``pre``; block 0 also forms and stores
``pre``, ``post`` and the Sinkhorn ``comb`` (an ``N x N`` tile in registers, ``sinkhorn.py``'s
math). Every block recomputing ``pre`` (a few hundred partials read) is cheaper than a third
launch, and spreads a decode token's collapse over several SMs instead of one.

The head (``mhc_head_triton``) is the same pair with ``M = N`` rows of ``fn``: launch 1 as it
is, launch 2 with ``HEAD`` set, where ``scale`` has one element, only ``pre`` is formed (nothing
stored but the collapse, which uses it) and the other coefficients' pointers are None. Compiled
as written the head was ~5 launches at decode, two of them cuBLAS's dot and reduction without
PDL.

Splits: ``KSPLIT`` aims at ``_SPLITS`` chunks of the ``N*D`` row, each a power of two of ``BK``
tiles (more chunks where the row's ``_SPLITS``-th part is none: 80 at hidden 5120, 112 at
7168). A decode token spreads the 1.5 MiB of ``fn`` over that many programs, while a 4096-token
prefill writes ~26 MB of partials (64 splits) against the 128 MiB of X it reads. ``BT`` tokens
share each ``fn`` tile a program loads; padding rows compute zeros, which costs tensor-core
issue but no memory. The bench ``python -m deepinfer_fx.bench.mhc_kernel --sweep`` times
other values through ``dots=``.

Batch invariance: ``BT``, the chunks and ``BLOCK_D`` depend on N, D and the dtype only, a row's dot
accumulates over k in the same order in whichever tile row it sits, and the split sums run in
a fixed tree; so a token's outputs are bit-identical alone or in any batch. The launch
configuration reads shapes only, so the launcher can run inside a CUDA graph.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from ..ops_mhc import (
    streams_unserved,
)  # (importing it declares deepinfer::mhc_site and mhc_head before we register for them)
from ...graphs.mhc import hc_head, mhc_site
from .buffers import out_buffer
from .sinkhorn import sinkhorn_tile
from .pdl import pdl_args, prefetch_l2, wait_previous

# The unswapped math, for stream counts the kernel does not tile (``streams_unserved``).
_reference = getattr(mhc_site, "reference", mhc_site)
_head_reference = getattr(hc_head, "reference", hc_head)

# Launch 1's tiling, from the H200 sweep at P8 widths (bf16 streams; us per site, 1 / 64 / 256 /
# 4096 / 16384 tokens): BT 64, 64 splits, 4 warps: 10.9 / 12.0 / 15.4 / 156 / 601; BT 16, 32
# splits (the first choice): 12.4 / 13.0 / 22.9 / 277 / 1073; BT 64, 32 splits: 13.5 / 14.4 /
# 16.3 / 138 / 518; 8 warps slower everywhere. One tiling for every T keeps rows batch-invariant.
_BT = 64  # tokens per launch-1 program: each fn tile loaded serves 64 rows
_BT_FP32 = 16  # fp32 streams' FMA dot spills registers at 64 rows (sm_90 ptxas)
_BK = 64  # row elements per launch-1 tile: keeps the chunks of the tiny configs' rows fine-grained
_SPLITS = 64  # the number of K-chunks launch 1 aims for
_BLOCK_D = 1024  # channels per launch-2 program
# Launch 2's warps, from the H200 sweep (``finish_sweep_us``, us per site at 1 / 64 / 4096 /
# 16384 tokens): one warp 10.1 / 10.9 / 137 / 518, four (the first choice) 10.8 / 11.7 / 152 /
# 581; the Sinkhorn tile's row and column sums then stay inside one warp, and at prefill more
# programs fit an SM. Narrower blocks were no faster at decode and slower at prefill.
_FINISH_WARPS = 1
# Launch 2 issues the streams' loads first up to this many tokens (``LOADS_FIRST``): its 1024
# one-warp programs of ~128 registers then all fit on an H200's 132 SMs at once.
_LOADS_FIRST_TOKENS = 256
# Launch 1 takes its chunk as one tile up to this many tokens (``UNROLL``; the same bits as the
# loop): an mHC site 9.14 -> 8.17 us at one token, 10.2 -> 9.8 at 64, 15.0 -> 14.7 at 256 on an H200
# (``bench/results/mhc_kernel_dots_unroll_s16.json`` against ``..._before_s16.json``); at 4096 tokens
# the unrolled schedule lost (~190 against ~140 us: ``mhc_kernel_dots_sweep_s16.json``, taken
# while the one-tile dots still chained their parts through one accumulator).
_UNROLL_TOKENS = 256
_LINE_BYTES = 128
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dots_tile(
    x,
    fn_ptr,
    k,
    acc_hi,
    acc_mid,
    acc_lo,
    K: tl.constexpr,
    M: tl.constexpr,
    MP: tl.constexpr,
    SPLIT_BF16: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """The tokens' elements ``x`` at columns ``k`` against ``fn[:, k]``: bf16 streams add their
    products with ``fn``'s hi, mid and lo parts to one accumulator each, fp32 streams theirs to
    ``acc_hi``."""
    m = tl.arange(0, MP)
    w = tl.load(fn_ptr + k[:, None] + m[None, :] * K, mask=(k < K)[:, None] & (m < M)[None, :], other=0.0).to(
        tl.float32
    )
    if SPLIT_BF16:  # x is bf16: w = hi + mid + lo exactly, each product exact
        hi = w.to(tl.bfloat16)
        rest = w - hi.to(tl.float32)
        mid = rest.to(tl.bfloat16)
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
        if DOT_FP32:  # the same exact products as fp32 FMAs (the interpreter's bf16 dot is wrong)
            xf = x.to(tl.float32)
            acc_lo = tl.dot(xf, lo.to(tl.float32), acc_lo, input_precision="ieee")
            acc_mid = tl.dot(xf, mid.to(tl.float32), acc_mid, input_precision="ieee")
            acc_hi = tl.dot(xf, hi.to(tl.float32), acc_hi, input_precision="ieee")
        else:
            acc_lo = tl.dot(x, lo, acc_lo)
            acc_mid = tl.dot(x, mid, acc_mid)
            acc_hi = tl.dot(x, hi, acc_hi)
    else:
        acc_hi = tl.dot(x.to(tl.float32), w, acc_hi, input_precision="ieee")
    return acc_hi, acc_mid, acc_lo


@triton.jit
def _load_tokens(x_ptr, tok, tok_ok, stride_xt, k, K: tl.constexpr):
    # Padding tokens and columns load zeros: they add nothing and are never stored.
    return tl.load(x_ptr + tok[:, None] * stride_xt + k[None, :], mask=tok_ok[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _mhc_dots_kernel(
    x_ptr,
    fn_ptr,
    part_ptr,
    n_tokens,
    stride_xt,
    K: tl.constexpr,
    M: tl.constexpr,
    MP: tl.constexpr,
    CHUNK: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    SPLIT_BF16: tl.constexpr,
    DOT_FP32: tl.constexpr,
    UNROLL: tl.constexpr,
    FN_LINES: tl.constexpr,
    LINE: tl.constexpr,
    PDL: tl.constexpr,
):
    """Tokens ``[BT]`` x one K-chunk -> partial dots ``[BT, M]`` and sums of squares ``[BT]``.
    With PDL, the program first asks L2 for its chunk of ``fn`` (``FN_LINES`` cache lines of
    ``LINE`` elements a row; a weight, which no earlier kernel writes), then waits.

    Two schedules of the same sums. The loop (many tokens) runs the chunk as ``BK`` tiles
    through the compiler's software pipeline. UNROLL (few tokens: a latency chain) takes the
    chunk's dots as one tile, so every load is in flight at once and the tensor cores wait
    three times instead of three times a tile. Both add each part's products over k in
    ascending order into its own accumulator (an MMA's k steps run in order), and both sum the
    squares tile by tile: the same bits. Only bf16 streams unroll: not fp32 ones (CPU tests and
    fp32 runs; a chunk's FMA dot would hold 256 columns of fp32 x), nor under the interpreter,
    whose dot of a chunk rounds unlike its tiles' chained dots."""
    split = tl.program_id(1)
    m = tl.arange(0, MP)
    if PDL:  # clamped into fn: every address valid
        lk = tl.minimum(split * CHUNK + tl.arange(0, FN_LINES) * LINE, K - 1)
        prefetch_l2(fn_ptr + tl.minimum(m, M - 1)[:, None] * K + lk[None, :])
    wait_previous(PDL)
    tok = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
    tok_ok = tok < n_tokens
    # The accumulators start from a zero the compiler cannot see as one: Triton rewrites
    # add(dot(a, b, 0), c) as dot(a, b, c), which in the one-tile schedule would chain the three
    # parts through one accumulator, other bits than the loop's three.
    zero = tl.zeros([BT, MP], tl.float32) + split.to(tl.float32) * 0.0
    acc_hi = zero
    acc_mid = zero
    acc_lo = zero
    ss = tl.zeros([BT], tl.float32)
    k0 = split * CHUNK
    if UNROLL and SPLIT_BF16 and not DOT_FP32:
        k = k0 + tl.arange(0, CHUNK)
        acc_hi, acc_mid, acc_lo = _dots_tile(
            _load_tokens(x_ptr, tok, tok_ok, stride_xt, k, K),
            fn_ptr,
            k,
            acc_hi,
            acc_mid,
            acc_lo,
            K,
            M,
            MP,
            SPLIT_BF16,
            DOT_FP32,
        )
        for i in tl.static_range(0, CHUNK, BK):
            xf = _load_tokens(x_ptr, tok, tok_ok, stride_xt, k0 + i + tl.arange(0, BK), K).to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
    else:
        for i in range(0, CHUNK, BK):
            k = k0 + i + tl.arange(0, BK)
            acc_hi, acc_mid, acc_lo = _dots_tile(
                _load_tokens(x_ptr, tok, tok_ok, stride_xt, k, K),
                fn_ptr,
                k,
                acc_hi,
                acc_mid,
                acc_lo,
                K,
                M,
                MP,
                SPLIT_BF16,
                DOT_FP32,
            )
            # Squared from a load of its own, as the unrolled schedule does: a reduction's order
            # follows its operand's register layout, and a tile feeding the dot may get another.
            xf = _load_tokens(x_ptr, tok, tok_ok, stride_xt, k, K).to(tl.float32)
            ss += tl.sum(xf * xf, axis=1)
    # Smallest parts first (all zero but acc_hi for fp32 streams: adding them moves no bit).
    acc = (acc_lo + acc_mid) + acc_hi
    row = part_ptr + (tok * tl.num_programs(1) + split) * (M + 1)
    tl.store(row[:, None] + m[None, :], acc, mask=tok_ok[:, None] & (m < M)[None, :])
    tl.store(row + M, ss, mask=tok_ok)


@triton.jit
def _mhc_finish_kernel(
    part_ptr,
    base_ptr,
    scale_ptr,
    x_ptr,
    pre_in_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    u_ptr,
    stride_xt,
    rms_eps,
    hc_eps,
    N: tl.constexpr,
    D: tl.constexpr,
    KSPLIT: tl.constexpr,
    KS_BLOCK: tl.constexpr,
    ITERS: tl.constexpr,
    HAS_PRE_IN: tl.constexpr,
    HEAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    LOADS_FIRST: tl.constexpr,
    PDL: tl.constexpr,
):
    """Token ``t``: coefficients from the partials, and channels ``d`` of its collapse. With
    ``HEAD`` (``hc_head``) the partials hold ``N`` mixes, ``pre`` alone is formed and collapses
    the streams, and nothing else is read or stored (pre_in, pre, post and comb unused).

    LOADS_FIRST (few tokens): every load is issued before any result is formed, so their
    latencies overlap and block 0's Sinkhorn runs while the streams it collapses are in flight:
    on an H200 9.55 -> 9.19 us a site at one token (``bench/results/mhc_kernel_finish_loads_first_s15.json``),
    a b1 P8 step 1.987 -> 1.973 ms (``mhc_finish_ab_s15.json``). It holds the streams' registers
    through the Sinkhorn (127 a thread against 80 on sm_90), which would halve the programs an
    SM holds at prefill, where thousands queue; there the streams are loaded last. The order of
    loads moves no bit. The Sinkhorn's N^2 values as scalars in every thread (no warp shuffles)
    gained nothing more (9.49 us): one warp then issues every thread's copy of the work."""
    wait_previous(PDL)
    M: tl.constexpr = N if HEAD else 2 * N + N * N
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    s = tl.arange(0, KS_BLOCK)
    s_ok = s < KSPLIT
    rows = part_ptr + (t * KSPLIT + s) * (M + 1)
    j = tl.arange(0, N)
    jj = j[:, None] * N + j[None, :]  # (unused by the head)
    # Each group of mixes is loaded in its own shape (splits first); a site's post and comb
    # mixes only by block 0, which stores the coefficients once (the others only need pre).
    ss_s = tl.load(rows + M, mask=s_ok, other=0.0)
    pre_s = tl.load(rows[:, None] + j[None, :], mask=s_ok[:, None], other=0.0)
    pre_scale, pre_base = tl.load(scale_ptr), tl.load(base_ptr + j)
    if not HEAD:
        first = blk == 0
        post_s = tl.load(rows[:, None] + N + j[None, :], mask=s_ok[:, None] & first, other=0.0)
        comb_s = tl.load(rows[:, None, None] + 2 * N + jj[None, :, :], mask=s_ok[:, None, None] & first, other=0.0)
        post_scale, post_base = tl.load(scale_ptr + 1), tl.load(base_ptr + N + j)
        comb_scale, comb_base = tl.load(scale_ptr + 2), tl.load(base_ptr + 2 * N + jj)
    d = blk * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < D
    streams = x_ptr + t * stride_xt + j[:, None] * D + d[None, :]
    if LOADS_FIRST:
        x = tl.load(streams, mask=d_ok[None, :], other=0.0)
    if HAS_PRE_IN:
        c = tl.load(pre_in_ptr + t * N + j)
    r = tl.math.rsqrt(tl.sum(ss_s, axis=0) / (N * D) + rms_eps)
    pre = tl.sigmoid(tl.sum(pre_s, axis=0) * r * pre_scale + pre_base) + hc_eps
    if not HEAD:  # a site's other coefficients
        if blk == 0:
            post = 2 * tl.sigmoid(tl.sum(post_s, axis=0) * r * post_scale + post_base)
            comb_logit = tl.sum(comb_s, axis=0) * r * comb_scale + comb_base
            tl.store(pre_ptr + t * N + j, pre)
            tl.store(post_ptr + t * N + j, post)
            tl.store(comb_ptr + t * (N * N) + jj, sinkhorn_tile(comb_logit, hc_eps, ITERS))
    if not HAS_PRE_IN:
        c = pre
    if not LOADS_FIRST:
        x = tl.load(streams, mask=d_ok[None, :], other=0.0)
    u = tl.sum(c[:, None] * x.to(tl.float32), axis=0)
    tl.store(u_ptr + t * D + d, u.to(u_ptr.dtype.element_ty), mask=d_ok)


def launch_config(
    n: int,
    d: int,
    bf16: bool = False,
    dots: Optional[dict[str, int]] = None,
    finish: Optional[dict[str, int]] = None,
    head: bool = False,
) -> dict[str, dict[str, int]]:
    """Both launches' block constants and warps for N streams of D channels and the streams'
    dtype (never T); ``head``: the head's ``N`` rows of ``fn`` instead of a site's ``2N + N^2``
    (launch 1's ``MP``). ``dots`` overrides launch 1's ``BT``, ``BK``, ``SPLITS``, ``num_warps`` or
    ``UNROLL`` (None: by the token count, ``_UNROLL_TOKENS``),
    ``finish`` launch 2's ``BLOCK_D`` or ``num_warps`` (the bench's sweeps)."""
    o = {"BT": _BT if bf16 else _BT_FP32, "BK": _BK, "SPLITS": _SPLITS, "num_warps": 4, **(dots or {})}
    k = n * d
    # A chunk is a power of two of BK tiles (UNROLL's one tile is a tl.arange over it), at most
    # the SPLITS-th part of the row: more splits where that part is no power of two (hidden
    # 5120 and 7168 x 4 streams: 80 and 112 chunks of 256, the tile P8's 64 chunks have).
    chunk = o["BK"] * _floor_power_of_2(triton.cdiv(triton.cdiv(k, o["SPLITS"]), o["BK"]))
    ksplit = triton.cdiv(k, chunk)
    block_d = min((finish or {}).get("BLOCK_D", _BLOCK_D), triton.next_power_of_2(d))
    warps = (finish or {}).get("num_warps", _FINISH_WARPS)
    return {
        "dots": {
            "CHUNK": chunk,
            "BT": o["BT"],
            "BK": o["BK"],
            "MP": max(16, triton.next_power_of_2(n if head else 2 * n + n * n)),
            "SPLIT_BF16": bool(bf16),
            "DOT_FP32": _INTERPRET,
            "UNROLL": o.get("UNROLL"),
            "num_warps": o["num_warps"],
        },
        "finish": {
            "KSPLIT": ksplit,
            "KS_BLOCK": triton.next_power_of_2(ksplit),
            "BLOCK_D": block_d,
            "num_warps": warps,
        },
    }


def _floor_power_of_2(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def _token_rows(X: torch.Tensor) -> torch.Tensor:
    """X ``[..., N, D]`` as ``[T, N, D]`` whose tokens are rows of N*D contiguous elements (launch 1
    reads them so), viewed where the strides allow."""
    n, d = X.shape[-2:]
    x = X.reshape(-1, n, d)
    return x if x.stride(2) == 1 and x.stride(1) == d else x.contiguous()


def _launch_dots(x: torch.Tensor, fn: torch.Tensor, m: int, cfg: dict[str, dict[str, int]]) -> torch.Tensor:
    """Launch 1 over the token rows ``x`` and the ``m`` rows of ``fn``: the partials ``[T, KSPLIT, m + 1]``."""
    t, n, d = x.shape
    launch1, ksplit = cfg["dots"], cfg["finish"]["KSPLIT"]
    part = torch.empty((t, ksplit, m + 1), dtype=torch.float32, device=x.device)
    line = _LINE_BYTES // fn.element_size()
    _mhc_dots_kernel[(triton.cdiv(t, launch1["BT"]), ksplit)](
        x,
        fn.contiguous(),
        part,
        t,
        x.stride(0),
        K=n * d,
        M=m,
        **{**launch1, "UNROLL": t <= _UNROLL_TOKENS if launch1["UNROLL"] is None else launch1["UNROLL"]},
        FN_LINES=triton.next_power_of_2(triton.cdiv(launch1["CHUNK"], line)),
        LINE=line,
        **pdl_args(x.device),
    )
    return part


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
    dots: Optional[dict[str, int]] = None,
    finish: Optional[dict[str, int]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mhc_site`` in two launches: fp32 pre ``[..., N]``, post ``[..., N]``, comb ``[..., N, N]``
    and ``u`` ``[..., D]`` in X's dtype. ``out`` (contiguous tensors of those shapes and dtypes)
    receives them when given; otherwise they are new contiguous tensors, as the op's fake says.
    ``dots`` and ``finish`` override the launches' tilings (``launch_config``)."""
    *lead, n, d = X.shape
    if streams_unserved(n):  # not tiled here: the reference (the swap declines such calls)
        ref = tuple(r.contiguous() for r in _reference(X, fn, base, scale, rms_eps, hc_eps, iters, pre_in))
        return ref if out is None else tuple(o.copy_(r) for o, r in zip(out, ref))  # type: ignore[return-value]
    m = 2 * n + n * n
    if tuple(fn.shape) != (m, n * d) or base.numel() != m or scale.numel() != 3:
        raise ValueError(
            f"mhc_site: fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)} do not fit X {tuple(X.shape)}"
        )
    x = _token_rows(X)
    t = x.shape[0]
    dev = X.device
    shapes = ((*lead, n), (*lead, n), (*lead, n, n), (*lead, d))
    dtypes = (torch.float32, torch.float32, torch.float32, X.dtype)
    names = ("pre", "post", "comb", "u")
    pre, post, comb, u = (
        out_buffer(o, s, dt, dev, f"mhc_site {name}")
        for o, s, dt, name in zip(out or (None,) * 4, shapes, dtypes, names)
    )
    if t == 0:
        return pre, post, comb, u
    cfg = launch_config(n, d, X.dtype == torch.bfloat16, dots, finish)
    launch2 = cfg["finish"]
    part = _launch_dots(x, fn, m, cfg)
    pre_in_rows = pre if pre_in is None else pre_in.reshape(t, n).float().contiguous()  # unread without pre_in
    _mhc_finish_kernel[(t, triton.cdiv(d, launch2["BLOCK_D"]))](
        part,
        base.float().contiguous(),
        scale.float().contiguous(),
        x,
        pre_in_rows,
        pre,
        post,
        comb,
        u,
        x.stride(0),
        float(rms_eps),
        float(hc_eps),
        N=n,
        D=d,
        ITERS=int(iters),
        HAS_PRE_IN=pre_in is not None,
        HEAD=False,
        LOADS_FIRST=t <= _LOADS_FIRST_TOKENS,
        **launch2,
        **pdl_args(dev),
    )
    return pre, post, comb, u


def mhc_head_triton(
    X: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    out: Optional[torch.Tensor] = None,
    dots: Optional[dict[str, int]] = None,
    finish: Optional[dict[str, int]] = None,
) -> torch.Tensor:
    """``hc_head`` in the site's two launches (``M = N`` rows of ``fn``, launch 2 with ``HEAD``):
    X ``[..., N, D]`` -> ``[..., D]`` in X's dtype, into ``out`` (contiguous, of that shape and
    dtype) when given, else a new contiguous tensor. ``dots`` and ``finish`` as for the site."""
    *lead, n, d = X.shape
    if tuple(fn.shape) != (n, n * d) or tuple(base.shape) != (n,) or scale.numel() != 1:
        raise ValueError(
            f"mhc_head: fn {tuple(fn.shape)}, base {tuple(base.shape)}, scale {tuple(scale.shape)} do not fit "
            f"X {tuple(X.shape)} (need fn {(n, n * d)}, base {(n,)}, scale (1,))"
        )
    if streams_unserved(n):  # not tiled here: the reference (the swap declines such calls)
        ref = _head_reference(X, fn, base, scale, rms_eps, hc_eps).contiguous()
        return ref if out is None else out.copy_(ref)
    x = _token_rows(X)
    t = x.shape[0]
    dev = X.device
    u = out_buffer(out, (*lead, d), X.dtype, dev, "mhc_head")
    if t == 0:
        return u
    cfg = launch_config(n, d, X.dtype == torch.bfloat16, dots, finish, head=True)
    launch2 = cfg["finish"]
    part = _launch_dots(x, fn, n, cfg)
    _mhc_finish_kernel[(t, triton.cdiv(d, launch2["BLOCK_D"]))](
        part,
        base.float().contiguous(),
        scale.float().contiguous(),
        x,
        None,
        None,
        None,
        None,
        u,
        x.stride(0),
        float(rms_eps),
        float(hc_eps),
        N=n,
        D=d,
        ITERS=1,
        HAS_PRE_IN=False,
        HEAD=True,
        LOADS_FIRST=t <= _LOADS_FIRST_TOKENS,
        **launch2,
        **pdl_args(dev),
    )
    return u


torch.library.register_kernel("deepinfer::mhc_site", "cuda", mhc_site_triton)
torch.library.register_kernel("deepinfer::mhc_head", "cuda", mhc_head_triton)
