"""The MXFP4 decode both Gluon expert GEMM forms share (``moe_fp4_wgmma.py``: the weights as
wgmma's register operand; ``moe_fp4_tall.py``: decoded once into shared memory), and the
pieces of their programs that do not depend on the form.

The packed codes are decoded by placing bits (``_DECODE``): a code's magnitude bits e1 e0 m land
on bf16 bits 8:6 and its sign on bit 15, which reads as the code's value times 2^-126 exactly;
one ``mul.rn.bf16x2`` by 2^(e - 1) (e the block's ue8m0 byte) gives the dequantised weight
exactly, and a CTA whose scales hold a byte above 128 (2^(e - 1) past bf16's range) multiplies
twice. Both halves of a bf16x2 need the same shifts when they pair the codes k and k + 4 of a
32-bit word, so a word of 8 codes costs 7 funnel shifts, 8 logic ops and 4 multiplies, and the
checkpoint's layout is read as stored.

The reduction order inside a 128-k tile is permuted (kappa = 8 (4 w + n) + 2 g + h for memory
k = 32 g + 8 w + 4 h + n: g the lane's quarter of the tile, w the word, n the nibble, h the
half), so that one lane's 16 bytes of a row are contiguous and in one 32-k scale group; the
rows the GEMMs multiply are permuted the same way, which leaves the product unchanged.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

MAG = 0x01C001C0  # bf16x2 bits 8:6 and 24:22: e1 e0 m of both codes
SIGN = 0x80008000  # bf16x2 bits 15 and 31
# Rotate-left amounts (mod 32) that move nibble n's magnitude (bits 4n .. 4n + 2) to bits 6..8,
# and its sign (bit 4n + 3) to 15; the same shifts move nibble n + 4 to the upper half.
MAG_ROTL = (6, 2, 30, 26)
SIGN_ROTL = (12, 8, 4, 0)
ROWS = gl.constexpr(64)  # weight rows a warpgroup computes: wgmma's M


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
def _swiglu(g, u, rw_ptr, pairs_ptr, t, tmask, limit, CLAMP: gl.constexpr):
    """silu(min(g, limit)) * clamp(u, +-limit) * the routing weight of sorted row ``t`` (one a
    column of ``[columns, rows]``), in fp32: the gate/up epilogue of both Gluon GEMM forms."""
    if CLAMP:
        # comparisons rather than min/max so that NaN passes through, as torch.clamp does
        g = gl.where(g > limit, limit, g)
        u = gl.where(u > limit, limit, gl.where(u < -limit, -limit, u))
    rw = gl.load(rw_ptr + gl.load(pairs_ptr + t, mask=tmask, other=0), mask=tmask, other=0.0).to(gl.float32)
    return g / (1.0 + gl.exp(-g)) * u * gl.expand_dims(rw, 0)
