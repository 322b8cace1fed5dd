"""Triton kernels of the routed experts (launchers: ``moe.py``).

The T*k (token, k) pairs are sorted by expert on the device (one small launch for up to 256
pairs, two beyond); every GEMM
program then finds its row block from the per-expert row ends alone, so the grid can be static
(sized for the worst case) and programs past the last block exit at once. A row block holds
rows of one expert only; each row's result depends on nothing but its own inputs (no split-K,
no atomics on results), so a token's output does not depend on the other tokens in the batch.

``SHARED``: the shared expert runs as expert ``E`` (one past the routed ones) that every token
takes with routing weight 1: a token then has ``TOPK + 1`` pairs, pair ``t * (TOPK + 1) + j``
reading ``idx[t, j]`` / ``weight[t, j]`` for ``j < TOPK`` and being (E, 1.0) for ``j = TOPK``.
The kernels derive that last pair from its index, so no widened copy of the routing is ever
written, and rows of expert E read the shared weights (one ``[out, in]`` matrix laid out as a
routed expert's slice) instead of ``w + E * stride``.

Weights are ``[E, out, in]`` (the checkpoint's linear layout). ``FP8`` means float8_e4m3fn
weights with fp32 scales per ``QBLOCK x QBLOCK`` block ``[E, cdiv(out, QBLOCK), cdiv(in,
QBLOCK)]``; each tile is dequantised to the activation dtype as it is loaded (``BK`` divides
``QBLOCK``, so a tile's k range has one scale per output column). ``FP4`` (non-zero, the decode
of ``_fp4_dot``) means MXFP4 weights: uint8 ``[E, out, in / 2]`` (two e2m1 codes a byte, the even
k in the low nibble) with ue8m0 byte scales ``[E, out, in / 32]``, each tile decoded as it is
loaded (``BK`` a multiple of 32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .pdl import release_next, wait_only, wait_previous


@triton.jit
def _pair_routing(ptr, pair, mask, shared_value, TOPK: tl.constexpr, SHARED: tl.constexpr):
    """Each pair's entry of the routing tensor ``ptr`` ``[T, TOPK]`` (expert ids or weights);
    with ``SHARED`` every token's last pair is the shared expert's and gets ``shared_value``."""
    if SHARED:
        j = pair % (TOPK + 1)
        routed = tl.load(ptr + pair // (TOPK + 1) * TOPK + j, mask=mask & (j < TOPK), other=0)
        return tl.where(j == TOPK, shared_value, routed)
    return tl.load(ptr + pair, mask=mask, other=0)


@triton.jit
def _count_span(idx_ptr, c0, stop, E, TOPK: tl.constexpr, SHARED: tl.constexpr, E_P: tl.constexpr, CHUNK: tl.constexpr):
    """How many of the pairs ``[c0, stop)`` each expert takes ``[E_P]``."""
    counts = tl.zeros([E_P], dtype=tl.int32)
    # while, not range: the bounds are runtime values (they follow the token count) and
    # Triton's interpreter cannot take one as a range bound under NumPy 2.
    while c0 < stop:
        offs = c0 + tl.arange(0, CHUNK)
        ids = _pair_routing(idx_ptr, offs, offs < stop, E, TOPK, SHARED).to(tl.int32)
        counts += tl.histogram(ids, E_P, mask=offs < stop)
        c0 += CHUNK
    return counts


@triton.jit
def _place_span(idx_ptr, pairs_ptr, cursor, c0, stop, E, TOPK: tl.constexpr, SHARED: tl.constexpr, CHUNK: tl.constexpr):
    """Write the ids of the pairs ``[c0, stop)`` at their expert's ``cursor`` ``[E_P]`` (in
    memory, advanced atomically). Order inside a group is arbitrary: rows are independent, so
    results do not depend on it."""
    while c0 < stop:
        offs = c0 + tl.arange(0, CHUNK)
        ids = _pair_routing(idx_ptr, offs, offs < stop, E, TOPK, SHARED).to(tl.int32)
        # Relaxed: the caller's barrier orders the cursors; the atomics need no fences of their own.
        pos = tl.atomic_add(cursor + ids, 1, mask=offs < stop, sem="relaxed")
        tl.store(pairs_ptr + pos, offs, mask=offs < stop)
        c0 += CHUNK


@triton.jit
def count_pairs_kernel(
    idx_ptr,
    hist_ptr,
    P,
    E,
    SPAN,
    TOPK: tl.constexpr,
    SHARED: tl.constexpr,
    E_P: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program g counts the experts of pairs ``[g * SPAN, (g + 1) * SPAN)`` into ``hist[g]``
    (``E`` routed experts, plus the shared one with ``SHARED``)."""
    wait_previous(PDL)
    g = tl.program_id(0)
    counts = _count_span(idx_ptr, g * SPAN, tl.minimum(P, g * SPAN + SPAN), E, TOPK, SHARED, E_P, CHUNK)
    tl.store(hist_ptr + g * E_P + tl.arange(0, E_P), counts)


@triton.jit
def sort_pairs_one_kernel(
    idx_ptr,
    pairs_ptr,
    ends_ptr,
    cursor_ptr,
    P,
    E,
    TOPK: tl.constexpr,
    SHARED: tl.constexpr,
    E_P: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Few pairs (decode): one program counts, writes the expert ends and places every pair,
    one launch where ``count_pairs_kernel`` + ``place_pairs_kernel`` are two."""
    wait_previous(PDL)
    offs_e = tl.arange(0, E_P)
    start = P * 0  # a runtime value, as the loops' other bounds are (a literal would be a constexpr)
    counts = _count_span(idx_ptr, start, P, E, TOPK, SHARED, E_P, CHUNK)
    ends = tl.cumsum(counts, 0)
    tl.store(ends_ptr + offs_e, ends, mask=offs_e < E + SHARED)
    tl.store(cursor_ptr + offs_e, ends - counts)
    # The cursors must be in memory for every thread before the atomics below read them.
    tl.debug_barrier()
    _place_span(idx_ptr, pairs_ptr, cursor_ptr, start, P, E, TOPK, SHARED, CHUNK)


@triton.jit
def place_pairs_kernel(
    idx_ptr,
    hist_ptr,
    pairs_ptr,
    ends_ptr,
    cursor_ptr,
    P,
    E,
    G,
    SPAN,
    TOPK: tl.constexpr,
    SHARED: tl.constexpr,
    E_P: tl.constexpr,
    G_P: tl.constexpr,
    G_ROWS: tl.constexpr,
    CHUNK: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program g writes the ids of its pairs grouped by expert into ``pairs``, each expert's
    group starting where the groups of lower experts and of earlier programs end; program 0
    also writes each expert's end row (``E`` routed experts, then the shared one with
    ``SHARED``). The histograms are summed ``G_ROWS`` programs' rows at a time: all ``G_P`` at
    once held 256 int32 a thread at 384 experts (E_P 512) and spilled on sm_90; the sums are
    integers, exact in any order."""
    wait_previous(PDL)
    g = tl.program_id(0)
    offs_e = tl.arange(0, E_P)
    totals = tl.zeros([E_P], tl.int32)
    before = tl.zeros([E_P], tl.int32)
    for g0 in range(0, G_P, G_ROWS):  # a loop, not unrolled: unrolled, every block's loads were hoisted
        offs_g = g0 + tl.arange(0, G_ROWS)
        hist = tl.load(hist_ptr + offs_g[:, None] * E_P + offs_e[None, :], mask=(offs_g < G)[:, None], other=0)
        totals += tl.sum(hist, 0)
        before += tl.sum(tl.where(offs_g[:, None] < g, hist, 0), 0)
    ends = tl.cumsum(totals, 0)
    tl.store(ends_ptr + offs_e, ends, mask=(offs_e < E + SHARED) & (g == 0))
    tl.store(cursor_ptr + g * E_P + offs_e, ends - totals + before)
    # The cursors must be in memory for every thread before the atomics below read them.
    tl.debug_barrier()
    _place_span(
        idx_ptr, pairs_ptr, cursor_ptr + g * E_P, g * SPAN, tl.minimum(P, g * SPAN + SPAN), E, TOPK, SHARED, CHUNK
    )


@triton.jit
def _tile(n_blocks, N, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id -> (row block, column tile), GROUP_M row blocks sweeping the columns together
    so that an expert's weight tiles are reused from L2 by its neighbouring row blocks."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    width = GROUP_M * n_tiles
    first = (pid // width) * GROUP_M
    size = tl.minimum(n_blocks - first, GROUP_M)
    return first + (pid % width) % size, (pid % width) // size


@triton.jit
def _block_rows(ends_ptr, block, E, E_P: tl.constexpr, BM: tl.constexpr):
    """-> (expert, first row, end row) of row block ``block``; expert >= E: no such block."""
    offs = tl.arange(0, E_P)
    ends = tl.load(ends_ptr + offs, mask=offs < E, other=0)
    starts = tl.load(ends_ptr + offs - 1, mask=(offs > 0) & (offs < E), other=0)
    n_blk = (ends - starts + BM - 1) // BM
    blk_end = tl.cumsum(n_blk, 0)
    e = tl.sum((blk_end <= block).to(tl.int32), 0)
    sel = offs == e
    first_blk = tl.sum(tl.where(sel, blk_end - n_blk, 0), 0)
    row0 = tl.sum(tl.where(sel, starts, 0), 0) + (block - first_blk) * BM
    return e, row0, tl.sum(tl.where(sel, ends, 0), 0)


@triton.jit
def _expert_weight(w_ptr, sw_ptr, e, E, stride_we, SHARED: tl.constexpr):
    """Base of expert ``e``'s ``[out, in]`` matrix: its slice of the stack ``w``, or with
    ``SHARED`` the shared expert's own matrix ``sw`` for ``e == E``."""
    base = w_ptr + e.to(tl.int64) * stride_we
    if SHARED:
        base = tl.where(e == E, sw_ptr, base)
    return base


@triton.jit
def _weight_tile(w_ptrs, s_ptrs, nmask, kmask, dtype, FP8: tl.constexpr, EVEN: tl.constexpr):
    """A ``[BK, BN]`` weight tile in ``dtype``; fp8 tiles are scaled per output column (their
    k range lies in one scale block) and rounded to ``dtype``, as the reference dequantises."""
    if EVEN:
        w = tl.load(w_ptrs)
    else:
        w = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
    if FP8:
        s = tl.load(s_ptrs, mask=nmask, other=0.0)
        w = w.to(tl.float32) * s[None, :]
    return w.to(dtype)


# Four e2m1 bytes (eight codes) to fp16 in packed 32-bit operations, for
# ``tl.inline_asm_elementwise(pack=4)``: each code's bits placed as fp16's (exponent bits 11-10,
# mantissa bit 9, sign bit 15), which reads as 2^-14 times its value, the subnormal 0.5 included.
# ``prmt`` spreads bytes 0-1 (then 2-3) into the two 16-bit halves; shifts and masks then place
# the low nibbles ($0, $1: the even k) and the high nibbles ($2, $3: the odd k) of both at once.
_E2M1_TO_F16 = tl.constexpr(
    """
{
.reg .b32 t<2>, a, b;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 a, t0, 9; and.b32 a, a, 0x0E000E00; shl.b32 b, t0, 12; and.b32 b, b, 0x80008000; or.b32 $0, a, b;
shl.b32 a, t1, 9; and.b32 a, a, 0x0E000E00; shl.b32 b, t1, 12; and.b32 b, b, 0x80008000; or.b32 $1, a, b;
shl.b32 a, t0, 5; and.b32 a, a, 0x0E000E00; shl.b32 b, t0, 8; and.b32 b, b, 0x80008000; or.b32 $2, a, b;
shl.b32 a, t1, 5; and.b32 a, a, 0x0E000E00; shl.b32 b, t1, 8; and.b32 b, b, 0x80008000; or.b32 $3, a, b;
}
"""
)


@triton.jit
def _fp4_dot(
    acc,
    a,
    w_ptr,
    s_ptr,
    offs_n,
    nmask,
    k0,
    K,
    stride_wn,
    stride_sn,
    PREC,
    BK: tl.constexpr,
    BN: tl.constexpr,
    DECODE: tl.constexpr,
):
    """``acc + a @ W[k0 : k0 + BK, offs_n]`` for an MXFP4 weight (bytes ``[N, K / 2]``, the even
    k in the low nibble; ue8m0 scales ``[N, K / 32]``), the weight the values of
    ``io.quant.dequant_mxfp4`` in ``a``'s dtype. ``DECODE`` 1: bf16 rows take Triton's
    microscaled dot (on sm_90 it decodes to bf16 itself), other dtypes (fp32 keeps fp32
    products) decode here in Triton; 2 (``Tiles.fp4_bits``, not in the interpreter): every dtype
    decodes here, in packed PTX (``_E2M1_TO_F16``)."""
    kb = k0 // 2 + tl.arange(0, BK // 2)
    rows = offs_n[None, :].to(tl.int64)
    mask = (kb < K // 2)[:, None] & nmask[None, :]
    b = tl.load(w_ptr + rows * stride_wn + kb[:, None], mask=mask, other=0)
    if a.dtype == tl.bfloat16 and DECODE == 1:
        ks = k0 // 32 + tl.arange(0, BK // 32)
        e = tl.load(s_ptr + rows.T * stride_sn + ks[None, :], mask=nmask[:, None] & (ks < K // 32)[None, :], other=127)
        return tl.dot_scaled(a, None, "bf16", b, e, "e2m1", acc=acc)
    # Even and odd k apart (low and high nibbles): two half-K dots, no weight interleave.
    e = tl.load(s_ptr + rows * stride_sn + (kb // 16)[:, None], mask=mask, other=127)
    scale = (e.to(tl.int32) << 23).to(tl.float32, bitcast=True) * 16384.0  # 2^(e - 127), times 2^14
    if DECODE == 2:
        lo, hi = tl.inline_asm_elementwise(
            _E2M1_TO_F16, "=r,=r,=r,=r,r", [b], dtype=(tl.float16, tl.float16), is_pure=True, pack=4
        )
    else:
        b = b.to(tl.int32)
        lo = (((b & 7) << 9) | ((b & 8) << 12)).to(tl.int16).to(tl.float16, bitcast=True)
        hi = ((((b >> 4) & 7) << 9) | ((b & 128) << 8)).to(tl.int16).to(tl.float16, bitcast=True)
    a_lo, a_hi = tl.split(tl.reshape(a, (a.shape[0], BK // 2, 2)))
    acc = tl.dot(a_lo, (lo.to(tl.float32) * scale).to(a.dtype), acc, input_precision=PREC)
    return tl.dot(a_hi, (hi.to(tl.float32) * scale).to(a.dtype), acc, input_precision=PREC)


@triton.jit
def _row_tile(a_ptrs, rmask, kmask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(a_ptrs, mask=rmask[:, None], other=0.0)
    return tl.load(a_ptrs, mask=rmask[:, None] & kmask[None, :], other=0.0)


@triton.jit
def _gate_up_rows(
    x_ptr,
    w1_ptr,
    w3_ptr,
    s1_ptr,
    s3_ptr,
    h_ptr,
    pairs_ptr,
    rw_ptr,
    row0,
    row_end,
    tile_n,
    N,
    limit,
    stride_x,
    stride_wn,
    stride_sn,
    K: tl.constexpr,
    TOPK: tl.constexpr,
    SHARED: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    FP8: tl.constexpr,
    FP4: tl.constexpr,
    QBLOCK: tl.constexpr,
    CLAMP: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    """``gate_up_kernel``'s work for the ``BM`` rows from ``row0`` (those before ``row_end``);
    the weight and scale pointers are the block's expert's."""
    rows = row0 + tl.arange(0, BM)
    rmask = rows < row_end
    pair = tl.load(pairs_ptr + rows, mask=rmask, other=0)
    offs_n = tile_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    nmask = offs_n < N
    dtype = h_ptr.dtype.element_ty
    a_ptrs = x_ptr + (pair // (TOPK + SHARED)).to(tl.int64)[:, None] * stride_x + offs_k[None, :]
    w_off = offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_off = (offs_n // QBLOCK) * stride_sn
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc3 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kmask = offs_k < K - k0
        a = _row_tile(a_ptrs, rmask, kmask, EVEN)
        if FP4:
            acc1 = _fp4_dot(acc1, a, w1_ptr, s1_ptr, offs_n, nmask, k0, K, stride_wn, stride_sn, PREC, BK, BN, FP4)
            acc3 = _fp4_dot(acc3, a, w3_ptr, s3_ptr, offs_n, nmask, k0, K, stride_wn, stride_sn, PREC, BK, BN, FP4)
        else:
            b1 = _weight_tile(w1_ptr + w_off, s1_ptr + s_off + k0 // QBLOCK, nmask, kmask, dtype, FP8, EVEN)
            b3 = _weight_tile(w3_ptr + w_off, s3_ptr + s_off + k0 // QBLOCK, nmask, kmask, dtype, FP8, EVEN)
            acc1 = tl.dot(a, b1, acc1, input_precision=PREC)
            acc3 = tl.dot(a, b3, acc3, input_precision=PREC)
        a_ptrs += BK
        w_off += BK
    release_next(PDL)
    g = acc1.to(dtype).to(tl.float32)
    u = acc3.to(dtype).to(tl.float32)
    if CLAMP:
        # Comparisons rather than min/max so that NaN passes through, as torch.clamp does.
        g = tl.where(g > limit, limit, g)
        u = tl.where(u > limit, limit, tl.where(u < -limit, -limit, u))
    rw = _pair_routing(rw_ptr, pair, rmask, 1.0, TOPK, SHARED).to(tl.float32)
    h = g / (1.0 + tl.exp(-g)) * u * rw[:, None]
    h_ptrs = h_ptr + rows.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(h_ptrs, h.to(dtype), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def gate_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    sw1_ptr,
    sw3_ptr,
    s1_ptr,
    s3_ptr,
    h_ptr,
    pairs_ptr,
    rw_ptr,
    ends_ptr,
    n_blocks,
    E,
    N,
    limit,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    K: tl.constexpr,
    TOPK: tl.constexpr,
    SHARED: tl.constexpr,
    E_P: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8: tl.constexpr,
    FP4: tl.constexpr,
    QBLOCK: tl.constexpr,
    CLAMP: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """h[row] = silu(min(x w1^T, limit)) * clamp(x w3^T, +-limit) * routing weight, for the
    sorted rows of one block and BN columns of I; GEMM results are rounded to the activation
    dtype before the fp32 epilogue, as the reference's grouped GEMMs return them. ``HALF``: an
    expert's last block with at most ``BM / 2`` rows runs as a half-height tile. ``E`` counts
    the routed experts; with ``SHARED`` blocks of expert E read ``sw1`` / ``sw3``."""
    wait_only(PDL)  # the next kernel is released after the main loop, or when a program without a block exits
    block, tile_n = _tile(n_blocks, N, BN, GROUP_M)
    e, row0, row_end = _block_rows(ends_ptr, block, E + SHARED, E_P, BM)
    if e >= E + SHARED:
        return
    w1 = _expert_weight(w1_ptr, sw1_ptr, e, E, stride_we, SHARED)
    w3 = _expert_weight(w3_ptr, sw3_ptr, e, E, stride_we, SHARED)
    s1, s3 = s1_ptr + e.to(tl.int64) * stride_se, s3_ptr + e.to(tl.int64) * stride_se  # fp8 / fp4 only, never shared
    if HALF and row_end - row0 <= BM // 2:
        _gate_up_rows(
            x_ptr,
            w1,
            w3,
            s1,
            s3,
            h_ptr,
            pairs_ptr,
            rw_ptr,
            row0,
            row_end,
            tile_n,
            N,
            limit,
            stride_x,
            stride_wn,
            stride_sn,
            K,
            TOPK,
            SHARED,
            BM // 2,
            BN,
            BK,
            FP8,
            FP4,
            QBLOCK,
            CLAMP,
            EVEN,
            PREC,
            PDL,
        )
    else:
        _gate_up_rows(
            x_ptr,
            w1,
            w3,
            s1,
            s3,
            h_ptr,
            pairs_ptr,
            rw_ptr,
            row0,
            row_end,
            tile_n,
            N,
            limit,
            stride_x,
            stride_wn,
            stride_sn,
            K,
            TOPK,
            SHARED,
            BM,
            BN,
            BK,
            FP8,
            FP4,
            QBLOCK,
            CLAMP,
            EVEN,
            PREC,
            PDL,
        )


@triton.jit
def _down_rows(
    h_ptr,
    w2_ptr,
    s2_ptr,
    y_ptr,
    pairs_ptr,
    row0,
    row_end,
    tile_n,
    N,
    stride_wn,
    stride_sn,
    K: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    FP8: tl.constexpr,
    FP4: tl.constexpr,
    QBLOCK: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    PDL: tl.constexpr,
):
    """``down_kernel``'s work for the ``BM`` rows from ``row0`` (those before ``row_end``); the
    weight and scale pointers are the block's expert's."""
    rows = row0 + tl.arange(0, BM)
    rmask = rows < row_end
    offs_n = tile_n * BN + tl.arange(0, BN)
    offs_k = tl.arange(0, BK)
    nmask = offs_n < N
    dtype = h_ptr.dtype.element_ty
    a_ptrs = h_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    w_off = offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_off = (offs_n // QBLOCK) * stride_sn
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kmask = offs_k < K - k0
        a = _row_tile(a_ptrs, rmask, kmask, EVEN)
        if FP4:
            acc = _fp4_dot(acc, a, w2_ptr, s2_ptr, offs_n, nmask, k0, K, stride_wn, stride_sn, PREC, BK, BN, FP4)
        else:
            b = _weight_tile(w2_ptr + w_off, s2_ptr + s_off + k0 // QBLOCK, nmask, kmask, dtype, FP8, EVEN)
            acc = tl.dot(a, b, acc, input_precision=PREC)
        a_ptrs += BK
        w_off += BK
    release_next(PDL)
    pair = tl.load(pairs_ptr + rows, mask=rmask, other=0)
    y_ptrs = y_ptr + pair.to(tl.int64)[:, None] * N + offs_n[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & nmask[None, :])


@triton.jit
def down_kernel(
    h_ptr,
    w2_ptr,
    sw2_ptr,
    s2_ptr,
    y_ptr,
    pairs_ptr,
    ends_ptr,
    n_blocks,
    E,
    N,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    K: tl.constexpr,
    SHARED: tl.constexpr,
    E_P: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8: tl.constexpr,
    FP4: tl.constexpr,
    QBLOCK: tl.constexpr,
    EVEN: tl.constexpr,
    PREC: tl.constexpr,
    HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    """y[pair] = h[row] w2^T for one row block and BN columns of D, rounded to the activation
    dtype (the reference's grouped GEMM returns it so) and written at the pair's own (unsorted)
    row so that the combine reads each token's k rows in k order. ``E``, ``SHARED`` and ``HALF``
    as in ``gate_up_kernel``."""
    wait_only(PDL)
    block, tile_n = _tile(n_blocks, N, BN, GROUP_M)
    e, row0, row_end = _block_rows(ends_ptr, block, E + SHARED, E_P, BM)
    if e >= E + SHARED:
        return
    w2 = _expert_weight(w2_ptr, sw2_ptr, e, E, stride_we, SHARED)
    s2 = s2_ptr + e.to(tl.int64) * stride_se  # fp8 / fp4 only, never shared
    if HALF and row_end - row0 <= BM // 2:
        _down_rows(
            h_ptr,
            w2,
            s2,
            y_ptr,
            pairs_ptr,
            row0,
            row_end,
            tile_n,
            N,
            stride_wn,
            stride_sn,
            K,
            BM // 2,
            BN,
            BK,
            FP8,
            FP4,
            QBLOCK,
            EVEN,
            PREC,
            PDL,
        )
    else:
        _down_rows(
            h_ptr,
            w2,
            s2,
            y_ptr,
            pairs_ptr,
            row0,
            row_end,
            tile_n,
            N,
            stride_wn,
            stride_sn,
            K,
            BM,
            BN,
            BK,
            FP8,
            FP4,
            QBLOCK,
            EVEN,
            PREC,
            PDL,
        )


@triton.jit
def combine_kernel(y_ptr, out_ptr, D, TOPK: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
    """out[t] = y[t, 0] + y[t, 1] + ... in fp32 in k order: a fixed order whatever the batch.
    The shared expert's row is each token's last, so it is added after the routed sum, as the
    reference adds the shared output (``TOPK`` then counts it)."""
    wait_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    mask = offs < D
    acc = tl.load(y_ptr + t * TOPK * D + offs, mask=mask, other=0.0).to(tl.float32)
    for j in tl.static_range(1, TOPK):
        acc += tl.load(y_ptr + (t * TOPK + j) * D + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * D + offs, acc, mask=mask)
