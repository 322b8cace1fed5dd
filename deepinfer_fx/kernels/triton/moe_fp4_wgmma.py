"""MXFP4 routed experts on Hopper: Gluon GEMMs whose weights are wgmma's register operand.

``moe.run_experts``'s gate/up and down launches for MXFP4 weights on an
sm_90 GPU, at every row count (the op's default there: about 2x Triton's fp4 tiles at decode,
``docs/decisions.md``); the pair sort and the combine stay Triton's. Each program computes 64
output columns (weight rows) of one row block of ``TP`` sorted rows (8 to 64: the MMA's N,
``wgmma_rows``) over the whole k range, so a row's sum never meets another program's (no
split-K, no atomics) and the grids are static as in ``moe_kernels.py``.

Operand roles are swapped against ``x @ W^T``: the 64 weight rows are the A operand of
``wgmma`` in registers (M = 64, one warpgroup), the block's rows the B operand from shared
memory, so the accumulator is ``out^T [64, TP]``. The packed codes are loaded as 16-byte vectors
straight into the registers of the A fragment (``_CODE_LAYOUT``) and decoded there by placing
bits (``_DECODE``): a code's magnitude bits e1 e0 m land on bf16 bits 8:6 and its sign on bit
15, which reads as the code's value times 2^-126 exactly; one ``mul.rn.bf16x2`` by 2^(e - 1)
(e the block's ue8m0 byte) gives the dequantised weight exactly, and a CTA whose scales hold a
byte above 128 (2^(e - 1) past bf16's range) multiplies twice. Both halves of a bf16x2 need the
same shifts when they pair the codes k and k + 4 of a 32-bit word, so a word of 8 codes costs 7
funnel shifts, 8 logic ops and 4 multiplies, and the checkpoint's layout is read as stored.

The reduction order inside a 128-k tile is permuted (kappa = 8 (4 w + n) + 2 g + h for memory
k = 32 g + 8 w + 4 h + n: g the lane's quarter of the tile, w the word, n the nibble, h the
half), so that one lane's 16 bytes of a row are contiguous and in one 32-k scale group; the
rows staged in shared memory are permuted the same way, which leaves the product unchanged.

The design and its measurements: ``docs/decisions.md`` (a Gluon MXFP4 decode GEMM).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma

MAG = 0x01C001C0  # bf16x2 bits 8:6 and 24:22: e1 e0 m of both codes
SIGN = 0x80008000  # bf16x2 bits 15 and 31
# Rotate-left amounts (mod 32) that move nibble n's magnitude (bits 4n .. 4n + 2) to bits 6..8,
# and its sign (bit 4n + 3) to 15; the same shifts move nibble n + 4 to the upper half.
MAG_ROTL = (6, 2, 30, 26)
SIGN_ROTL = (12, 8, 4, 0)
_CHUNK = 256  # k a program streams a loop step: two 128-k tiles
CHUNK = gl.constexpr(_CHUNK)
ROWS = gl.constexpr(64)  # weight rows a program computes: wgmma's M for one warpgroup
# the block's rows as loaded (16-byte vectors along k), and the results as stored (lanes along n)
ROW_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))
OUT_LAYOUT = gl.constexpr(gl.BlockedLayout([1, 1], [32, 1], [2, 2], [0, 1]))


def _decode_asm(big: bool) -> str:
    """PTX: one 32-bit code word ($4) and the multiplier(s) ($5, $6) -> 4 bf16x2 ($0..$3),
    output n holding the codes of nibbles n (low half) and n + 4 (high half)."""
    lines = [".reg .b32 a<4>, b<4>;"]
    for n in range(4):
        lines.append(f"shf.l.wrap.b32 a{n}, $4, $4, {MAG_ROTL[n]};")
        src = "$4"
        if SIGN_ROTL[n]:
            lines.append(f"shf.l.wrap.b32 b{n}, $4, $4, {SIGN_ROTL[n]};")
            src = f"b{n}"
        lines.append(f"and.b32 b{n}, {src}, {SIGN:#x};")
        lines.append(f"lop3.b32 a{n}, a{n}, {MAG:#x}, b{n}, 0xEA;")  # (a & MAG) | b
    for n in range(4):
        if big:
            lines.append(f"mul.rn.bf16x2 a{n}, a{n}, $5;")
            lines.append(f"mul.rn.bf16x2 ${n}, a{n}, $6;")
        else:
            lines.append(f"mul.rn.bf16x2 ${n}, a{n}, $5;")
    return "{\n" + "\n".join(lines) + "\n}"


_DECODE = gl.constexpr(_decode_asm(False))
_DECODE_BIG = gl.constexpr(_decode_asm(True))


@gluon.constexpr_function
def _code_layout(rows: int = 64) -> gl.DistributedLinearLayout:
    """int32 ``[rows, 4 (g), 4 (w)]`` code words of a rows x 128 tile: a lane holds 4 contiguous
    words (16 bytes) of rows r and r + 8, lane % 4 = g, lane // 4 = r % 8, warp = r // 16: wgmma's
    A fragment (one warpgroup a 64 rows). Words, not bytes: uint8 tensors carried through the loop
    were unpacked and packed again with PRMTs."""
    return gl.DistributedLinearLayout(
        reg_bases=[[0, 0, 1], [0, 0, 2], [8, 0, 0]],
        lane_bases=[[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]],
        warp_bases=[[16 << j, 0, 0] for j in range((rows // 16).bit_length() - 1)],
        block_bases=[],
        shape=[rows, 4, 4],
    )


@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _block_rows(ends_ptr, block, E, E_P: gl.constexpr, TP: gl.constexpr):
    """-> (expert, first row, end row) of row block ``block`` of ``TP`` rows; expert >= E: none
    (as ``moe_kernels._block_rows``)."""
    el: gl.constexpr = gl.BlockedLayout([1], [32], [gl.num_warps()], [0])
    offs = gl.arange(0, E_P, layout=el)
    ends = gl.load(ends_ptr + offs, mask=offs < E, other=0)
    starts = gl.load(ends_ptr + offs - 1, mask=(offs > 0) & (offs < E), other=0)
    n_blk = (ends - starts + TP - 1) // TP
    blk_end = gl.associative_scan(n_blk, 0, _add)
    e = gl.sum((blk_end <= block).to(gl.int32), 0)
    sel = offs == e
    first_blk = gl.sum(gl.where(sel, blk_end - n_blk, 0), 0)
    row0 = gl.sum(gl.where(sel, starts, 0), 0) + (block - first_blk) * TP
    return e, row0, gl.sum(gl.where(sel, ends, 0), 0)


@gluon.constexpr_function
def _pow2_at_least(n: int) -> int:
    return 1 << (n - 1).bit_length()


@gluon.jit
def _big_scales(s_ptr, stride_s, K: gl.constexpr):
    """Per loaded word of the 64 rows' scale bytes at ``s_ptr`` (K / 32 a row, read as int32
    words in one load, so that a check waits for memory once): 1 where a byte exceeds 128."""
    W: gl.constexpr = K // 128  # words a row
    WP: gl.constexpr = _pow2_at_least(W)
    sl: gl.constexpr = gl.BlockedLayout([1, 4], [16, 2], [gl.num_warps(), 1], [1, 0])
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, sl))
    c = gl.arange(0, WP, layout=gl.SliceLayout(0, sl))
    offs = gl.expand_dims(r, 1) * (stride_s // 4) + gl.expand_dims(c, 0)
    words = gl.load(s_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + offs, mask=gl.expand_dims(c < W, 0), other=0)
    big = gl.zeros([ROWS, WP], gl.int32, layout=sl)
    for j in gl.static_range(4):
        big = big | (((words >> (8 * j)) & 0xFF) > 128).to(gl.int32)
    return big


@gluon.jit
def _weight_offsets(stride_c, stride_s):
    """Offsets of a 64 x 128 tile's code words (int32 units) and scale bytes, in ``_code_layout``."""
    cl: gl.constexpr = _code_layout()
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, cl)))
    g = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, cl)))
    w = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, cl)))
    r3 = gl.expand_dims(gl.expand_dims(r, 1), 2)
    c_offs = (
        r3 * (stride_c // 4) + gl.expand_dims(gl.expand_dims(g, 0), 2) * 4 + gl.expand_dims(gl.expand_dims(w, 0), 1)
    )
    s_offs = gl.expand_dims(r, 1) * stride_s + gl.expand_dims(g, 0)
    return c_offs, s_offs


@gluon.jit
def _load_tile(c_ptr, c_offs, s_ptr, s_offs, k0):
    """Code words and scale bytes (int32) of the 64 x 128 tile at k ``k0``."""
    codes = gl.load(c_ptr + (k0 // 8 + c_offs))
    s = gl.load(s_ptr + (k0 // 32 + s_offs)).to(gl.int32)
    return codes, s


@gluon.jit
def _decode_tile(codes, s, BIG: gl.constexpr, a_layout: gl.constexpr):
    """A loaded tile (code words ``[64, 4, 4]``, scale bytes ``[64, 4]``) -> wgmma's A operand
    (bf16 ``[64, 128]`` in kappa order), in the registers it was loaded into."""
    return gl.convert_layout(_decode_values(codes, s, BIG), a_layout, assert_trivial=True)


@gluon.jit
def _decode_values(codes, s, BIG: gl.constexpr):
    """Code words ``[R, 4, 4]`` and scale bytes ``[R, 4]`` -> bf16 ``[R, 128]`` in kappa order, in
    the layout the decode leaves them (``_code_layout``'s lanes and warps)."""
    R: gl.constexpr = codes.shape[0]
    if BIG:
        # 2^(min(e, 128) - 1) * 2^(max(e, 128) - 128); e = 255 is NaN, as ue8m0 decodes it
        m1 = gl.expand_dims((gl.minimum(s, 128) + 126) * 0x00800080, 2)
        m2 = gl.where(s == 255, 0x7FC07FC0, (gl.maximum(s, 128) - 1) * 0x00800080)
        m2 = gl.expand_dims(m2, 2)
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _DECODE_BIG, "=r,=r,=r,=r,r,r,r", [codes, m1, m2], dtype=(gl.int32,) * 4, is_pure=True, pack=1
        )
    else:
        m = gl.expand_dims((s + 126) * 0x00800080, 2)  # bf16x2 2^(e - 1): exponent field e + 126
        o0, o1, o2, o3 = gl.inline_asm_elementwise(
            _DECODE, "=r,=r,=r,=r,r,r", [codes, m], dtype=(gl.int32,) * 4, is_pure=True, pack=1
        )
    w = gl.join(gl.join(o0, o2), gl.join(o1, o3))  # [R, 4 g, 4 w, 2, 2]: output n = 2 j1 + j0
    w = gl.reshape(w, (R, 4, 16))  # i = 4 w + n
    lo = w.to(gl.int16).to(gl.bfloat16, bitcast=True)  # k = 32 g + 8 w + n
    hi = (w >> 16).to(gl.int16).to(gl.bfloat16, bitcast=True)  # k + 4
    a = gl.permute(gl.join(lo, hi), (0, 2, 1, 3))  # [R, 16 i, 4 g, 2 h]: kappa = 8 i + 2 g + h
    return gl.reshape(a, (R, 128))


@gluon.jit
def _x_rows(x_ptr, row_offs, rmask, k0, xl: gl.constexpr):
    """The block's ``[TP, 128]`` activations at k ``k0``, masked rows zero."""
    xk = gl.arange(0, 128, layout=gl.SliceLayout(0, xl))
    offs = gl.expand_dims(row_offs, 1) + gl.expand_dims(xk, 0) + k0
    return gl.load(x_ptr + offs, mask=gl.expand_dims(rmask, 1) & gl.expand_dims(xk < 128, 0), other=0.0)


@gluon.jit
def _stage(x_smem, slot, xv, TP: gl.constexpr):
    """Store a ``[TP, 128]`` activation tile in kappa order (memory k = 32 g + 8 w + 4 h + n)."""
    xv = gl.permute(gl.reshape(xv, (TP, 4, 4, 2, 4)), (0, 2, 4, 1, 3))
    x_smem.index(slot).store(gl.reshape(xv, (TP, 128)))


@gluon.jit
def _load_step(c1_ptr, s1_ptr, c3_ptr, s3_ptr, c_offs, s_offs, k0, GATED: gl.constexpr):
    """Code words and scale bytes of a loop step's two 128-k tiles of both weights at k ``k0``
    (without ``GATED`` the second weight's are the first's)."""
    p1a, t1a = _load_tile(c1_ptr, c_offs, s1_ptr, s_offs, k0)
    p1b, t1b = _load_tile(c1_ptr, c_offs, s1_ptr, s_offs, k0 + 128)
    p3a, t3a, p3b, t3b = p1a, t1a, p1b, t1b
    if GATED:
        p3a, t3a = _load_tile(c3_ptr, c_offs, s3_ptr, s_offs, k0)
        p3b, t3b = _load_tile(c3_ptr, c_offs, s3_ptr, s_offs, k0 + 128)
    return p1a, t1a, p1b, t1b, p3a, t3a, p3b, t3b


@gluon.jit
def _first_loads(args, K: gl.constexpr, GATED: gl.constexpr, xl: gl.constexpr, AHEAD: gl.constexpr):
    """The loop's first rows and its first ``AHEAD`` steps of weights, before the scale check in
    program order (ptxas may still issue them after its compares)."""
    x_ptr, row_offs, rmask, c1_ptr, s1_ptr, c3_ptr, s3_ptr, c_offs, s_offs, x_smem = args
    ptrs = (c1_ptr, s1_ptr, c3_ptr, s3_ptr, c_offs, s_offs)
    xa = _x_rows(x_ptr, row_offs, rmask, 0, xl)
    xb = _x_rows(x_ptr, row_offs, rmask, 128, xl)
    cur = _load_step(*ptrs, 0, GATED)
    nxt = cur
    if AHEAD == 2:
        nxt = _load_step(*ptrs, gl.minimum(CHUNK, K - CHUNK), GATED)
    return xa, xb, cur, nxt


@gluon.jit
def _k_loop(
    acc1,
    acc3,
    args,
    first,
    K: gl.constexpr,
    TP: gl.constexpr,
    GATED: gl.constexpr,
    BIG: gl.constexpr,
    a_layout: gl.constexpr,
    xl: gl.constexpr,
    AHEAD: gl.constexpr,
):
    """acc1 (+ acc3 with ``GATED``) += the 64 weight rows times the block's rows over all of K.
    Each step stages its two 128-k tiles of rows in one of two shared buffers (one barrier a
    step), then loads the next step's rows and the weights ``AHEAD`` (1 or 2) steps on while it
    decodes and multiplies its own: two steps keep twice the bytes in flight, for the few
    programs of a decode launch. ``args``: the rows' pointer and offsets, both weights' codes and
    scales, and the ring; ``first``: ``_first_loads``."""
    x_ptr, row_offs, rmask, c1_ptr, s1_ptr, c3_ptr, s3_ptr, c_offs, s_offs, x_smem = args
    ptrs = (c1_ptr, s1_ptr, c3_ptr, s3_ptr, c_offs, s_offs)
    xa, xb, cur, nxt = first
    for k0 in range(0, K, CHUNK):
        slot = (k0 // CHUNK) % 2 * 2
        _stage(x_smem, slot, xa, TP)
        _stage(x_smem, slot + 1, xb, TP)
        fence_async_shared()  # generic-proxy stores -> visible to wgmma's async proxy
        gl.thread_barrier()  # ... from every warp; the other buffer's last reader finished before
        kn = gl.minimum(k0 + CHUNK, K - CHUNK)  # the last steps reload themselves rather than branch
        xa = _x_rows(x_ptr, row_offs, rmask, kn, xl)
        xb = _x_rows(x_ptr, row_offs, rmask, kn + 128, xl)
        new = _load_step(*ptrs, gl.minimum(k0 + AHEAD * CHUNK, K - CHUNK), GATED)
        p1a, t1a, p1b, t1b, p3a, t3a, p3b, t3b = cur
        lo = x_smem.index(slot).permute((1, 0))
        hi = x_smem.index(slot + 1).permute((1, 0))
        acc1 = warpgroup_mma(_decode_tile(p1a, t1a, BIG, a_layout), lo, acc1)
        if GATED:
            acc3 = warpgroup_mma(_decode_tile(p3a, t3a, BIG, a_layout), lo, acc3)
        acc1 = warpgroup_mma(_decode_tile(p1b, t1b, BIG, a_layout), hi, acc1)
        if GATED:
            acc3 = warpgroup_mma(_decode_tile(p3b, t3b, BIG, a_layout), hi, acc3)
        if AHEAD == 2:
            cur = nxt
        else:
            cur = new
        nxt = new
    return acc1, acc3


@gluon.jit
def _gemm(
    x_ptr,
    row_offs,
    rmask,
    c1_ptr,
    s1_ptr,
    c3_ptr,
    s3_ptr,
    stride_c,
    stride_s,
    K: gl.constexpr,
    TP: gl.constexpr,
    GATED: gl.constexpr,
    AHEAD: gl.constexpr,
):
    """``[64, TP]`` fp32 products of the 64 weight rows at ``c1_ptr`` (and ``c3_ptr`` with
    ``GATED``) with the block's rows, the loop in its one- or two-multiply form by the rows'
    scale bytes, loading weights ``AHEAD`` steps on."""
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, TP, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    xl: gl.constexpr = ROW_LAYOUT
    x_sl: gl.constexpr = gl.NVMMASharedLayout.get_default_for([TP, 128], gl.bfloat16)
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [4, TP, 128], x_sl)
    c_offs, s_offs = _weight_offsets(stride_c, stride_s)
    c1 = c1_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    c3 = c3_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    args = (x_ptr, row_offs, rmask, c1, s1_ptr, c3, s3_ptr, c_offs, s_offs, x_smem)
    first = _first_loads(args, K, GATED, xl, AHEAD)
    flags = _big_scales(s1_ptr, stride_s, K)
    if GATED:
        flags = flags | _big_scales(s3_ptr, stride_s, K)
    big = gl.max(gl.max(flags, axis=1), axis=0) > 0  # CTA-uniform
    acc1 = gl.zeros([ROWS, TP], gl.float32, layout=mma)
    acc3 = gl.zeros([ROWS, TP], gl.float32, layout=mma)
    if big:  # the loop in its two-multiply form: one branch a program, not one a tile
        acc1, acc3 = _k_loop(acc1, acc3, args, first, K, TP, GATED, True, a_layout, xl, AHEAD)
    else:
        acc1, acc3 = _k_loop(acc1, acc3, args, first, K, TP, GATED, False, a_layout, xl, AHEAD)
    return acc1, acc3


@gluon.jit
def _program(ends_ptr, E, N, stride_we, stride_wn, stride_se, stride_sn, E_P: gl.constexpr, TP: gl.constexpr):
    """Program id -> its expert (>= E: no block), row block (first, end, the rows in
    ``ROW_LAYOUT`` and their mask), first of its 64 columns, and the offsets of its weight and
    scale rows."""
    pid = gl.program_id(0)
    n_tiles = N // ROWS
    e, row0, row_end = _block_rows(ends_ptr, pid // n_tiles, E, E_P, TP)
    n0 = (pid % n_tiles) * ROWS
    rows = row0 + gl.arange(0, TP, layout=gl.SliceLayout(1, ROW_LAYOUT))
    w_off = e.to(gl.int64) * stride_we + n0 * stride_wn
    s_off = e.to(gl.int64) * stride_se + n0 * stride_sn
    return e, row0, row_end, n0, rows, rows < row_end, w_off, s_off


@gluon.jit
def _out_offsets(row_ids, row0, row_end, n0, N, TP: gl.constexpr):
    """Offsets and mask of a ``[64, TP]`` result in ``OUT_LAYOUT``: column n0 + r of output row
    ``row_ids[t]`` (``row_ids``: a pointer to the block's row ids, or None for the sorted rows)."""
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, OUT_LAYOUT))
    t = row0 + gl.arange(0, TP, layout=gl.SliceLayout(0, OUT_LAYOUT))
    tmask = t < row_end
    if row_ids is not None:
        t = gl.load(row_ids + t, mask=tmask, other=0)
    offs = gl.expand_dims(t.to(gl.int64), 0) * N + n0 + gl.expand_dims(r, 1)
    return offs, gl.expand_dims(tmask, 0) & gl.expand_dims(r < ROWS, 1)


@gluon.jit
def _swiglu(g, u, rw_ptr, pairs_ptr, t, tmask, limit, CLAMP: gl.constexpr):
    """silu(min(g, limit)) * clamp(u, +-limit) * the routing weight of sorted row ``t`` (one a
    column of ``[columns, rows]``), in fp32: the gate/up epilogue of both Gluon GEMM forms."""
    if CLAMP:
        # comparisons rather than min/max so that NaN passes through, as torch.clamp does
        g = gl.where(g > limit, limit, g)
        u = gl.where(u > limit, limit, gl.where(u < -limit, -limit, u))
    rw = gl.load(rw_ptr + gl.load(pairs_ptr + t, mask=tmask, other=0), mask=tmask, other=0.0).to(gl.float32)
    return g / (1.0 + gl.exp(-g)) * u * gl.expand_dims(rw, 0)


@gluon.jit
def fp4_gate_up_kernel(
    x_ptr,
    w1_ptr,
    w3_ptr,
    s1_ptr,
    s3_ptr,
    h_ptr,
    pairs_ptr,
    rw_ptr,
    ends_ptr,
    E,
    N,
    limit,
    stride_x,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    K: gl.constexpr,
    TOPK: gl.constexpr,
    E_P: gl.constexpr,
    TP: gl.constexpr,
    CLAMP: gl.constexpr,
    AHEAD: gl.constexpr,
):
    """h[row] = silu(min(x w1^T, limit)) * clamp(x w3^T, +-limit) * routing weight for 64 columns
    of I and one block of ``TP`` sorted rows (program = block * column tiles + column tile); the
    GEMM results are rounded to bf16 before the fp32 epilogue, as ``gate_up_kernel`` does."""
    e, row0, row_end, n0, rows, rmask, w_off, s_off = _program(
        ends_ptr, E, N, stride_we, stride_wn, stride_se, stride_sn, E_P, TP
    )
    if e < E:
        tok = gl.load(pairs_ptr + rows, mask=rmask, other=0) // TOPK
        acc1, acc3 = _gemm(
            x_ptr, tok.to(gl.int64) * stride_x, rmask, w1_ptr + w_off, s1_ptr + s_off, w3_ptr + w_off,
            s3_ptr + s_off, stride_wn, stride_sn, K, TP, True, AHEAD,
        )  # fmt: skip
        g = gl.convert_layout(acc1, OUT_LAYOUT).to(gl.bfloat16).to(gl.float32)
        u = gl.convert_layout(acc3, OUT_LAYOUT).to(gl.bfloat16).to(gl.float32)
        t = row0 + gl.arange(0, TP, layout=gl.SliceLayout(0, OUT_LAYOUT))
        h = _swiglu(g, u, rw_ptr, pairs_ptr, t, t < row_end, limit, CLAMP)
        offs, mask = _out_offsets(None, row0, row_end, n0, N, TP)
        gl.store(h_ptr + offs, h.to(gl.bfloat16), mask=mask)


@gluon.jit
def fp4_down_kernel(
    h_ptr,
    w2_ptr,
    s2_ptr,
    y_ptr,
    pairs_ptr,
    ends_ptr,
    E,
    N,
    stride_we,
    stride_wn,
    stride_se,
    stride_sn,
    K: gl.constexpr,
    E_P: gl.constexpr,
    TP: gl.constexpr,
    AHEAD: gl.constexpr,
):
    """y[pair] = h[row] w2^T, rounded to bf16, for 64 columns of D and one block of ``TP``
    sorted rows, written at the pair's own row (as ``down_kernel``)."""
    e, row0, row_end, n0, rows, rmask, w_off, s_off = _program(
        ends_ptr, E, N, stride_we, stride_wn, stride_se, stride_sn, E_P, TP
    )
    if e < E:
        acc, _ = _gemm(
            h_ptr, rows.to(gl.int64) * K, rmask, w2_ptr + w_off, s2_ptr + s_off, w2_ptr + w_off, s2_ptr + s_off,
            stride_wn, stride_sn, K, TP, False, AHEAD,
        )  # fmt: skip
        offs, mask = _out_offsets(pairs_ptr, row0, row_end, n0, N, TP)
        gl.store(y_ptr + offs, gl.convert_layout(acc, OUT_LAYOUT).to(gl.bfloat16), mask=mask)


TALL_FROM: int | None = None  # rows an expert above which moe_fp4_tall runs; None: never (not yet timed)


def wgmma_rows(pairs: int, experts: int) -> int:
    """The block height (the MMA's N) for ``pairs`` rows over ``experts`` experts, by the rows an
    active expert takes on average: 8 up to 4, 16 up to 16, 32 up to 32, else 64 (64 beat 32 at
    48 rows on an H100, docs/decisions.md), and 128 (``moe_fp4_tall``'s prefill form) above
    ``TALL_FROM``. No row's sum depends on N, so the height moves no bit (``test_triton_moe_fp4.py``
    compares a token alone with its batches on the GPU)."""
    rows = pairs / min(experts, pairs)
    if TALL_FROM is not None and rows > TALL_FROM:
        return 128
    return 8 if rows <= 4 else 16 if rows <= 16 else 32 if rows <= 32 else 64


FEW_AHEAD = 2  # small launches load two steps on: up to 6 % faster at b1, never slower (docs/decisions.md, session 52)


def steps_ahead(programs: int, device: torch.device, per_sm: int) -> int:
    """How many loop steps on a program loads its weights: ``FEW_AHEAD`` for a launch of at most
    ``per_sm`` programs an SM, as many as stay resident with a second step's registers (up to
    187 for gate/up: 2, 117 for down: 4; b1: each program waits on memory with one step's bytes
    in flight), else 1."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return FEW_AHEAD if programs <= per_sm * _sms(index) else 1


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index) == (9, 0)


@functools.cache
def _sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fits(x: torch.Tensor, inter: int, dim: int, held: tuple[torch.Tensor, ...] = ()) -> bool:
    """Whether these kernels take the GEMMs: bf16 rows on an sm_90 GPU, both widths multiples of
    ``_CHUNK`` (every released config's are), and the ``held`` codes and scales 16-byte aligned
    (they are read as 16-byte and 4-byte words)."""
    return (
        x.is_cuda
        and x.dtype == torch.bfloat16
        and _hopper(x.device.index if x.device.index is not None else torch.cuda.current_device())
        and inter % _CHUNK == 0
        and dim % _CHUNK == 0
        and all(t.data_ptr() % 16 == 0 for t in held)
    )


def gate_up_down(
    x: torch.Tensor,
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    scales: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    pairs: torch.Tensor,
    ends: torch.Tensor,
    rw: torch.Tensor,
    limit: float,
    h: torch.Tensor,
    y: torch.Tensor,
    top: int,
    e_p: int,
    tp: int,
    n_blocks: int,
) -> None:
    """``moe.run_experts``'s gate/up and down launches for MXFP4 weights (``fits`` holds) in
    ``n_blocks`` row blocks of ``tp`` rows (``wgmma_rows``): ``h`` and ``y`` written as
    ``gate_up_kernel`` and ``down_kernel`` write them."""
    (w1, w3, w2), (s1, s3, s2) = weights, scales
    n_exp, inter, half_dim = w1.shape
    dim = 2 * half_dim
    gate_up_programs, down_programs = n_blocks * (inter // 64), n_blocks * (dim // 64)
    fp4_gate_up_kernel[(gate_up_programs,)](
        x, w1, w3, s1, s3, h, pairs, rw, ends, n_exp, inter, float(limit), x.stride(0),
        w1.stride(0), w1.stride(1), s1.stride(0), s1.stride(1),
        K=dim, TOPK=top, E_P=e_p, TP=tp, CLAMP=bool(limit), AHEAD=steps_ahead(gate_up_programs, x.device, 2),
        num_warps=4,
    )  # fmt: skip
    fp4_down_kernel[(down_programs,)](
        h, w2, s2, y, pairs, ends, n_exp, dim, w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        K=inter, E_P=e_p, TP=tp, AHEAD=steps_ahead(down_programs, x.device, 4), num_warps=4,
    )  # fmt: skip
