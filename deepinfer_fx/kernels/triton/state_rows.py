"""Device code that reads trained-format state rows (``io/state_rows.py``) where they lie.

A kernel that streams keys from the cache state gets their values with ``load_values``: for a
tile of row pointers (uint8, each at the start of a row of ``nbytes`` bytes) and a range of
channels it loads the codes and their blocks' scales and returns ``code * scale`` in fp32, the
values ``RowCodec.unpack`` gives (every value is exact in fp32), so a kernel reading packed
rows runs the same arithmetic on the same values as one reading the unpacked state.

e4m3 bytes go through the hardware's exact conversion (the interpreter's too), e2m1 nibbles and
ue8m0 scales through integer arithmetic into fp32 bit patterns, so the interpreter and every GPU
produce the same bits. Formats are constexpr ids: ``FMT_VALUES`` (plain rows in the value dtype),
``FMT_FP8``, ``FMT_MXFP4``, ``FMT_NVFP4``.

Only the indexer reads packed rows in place so far (its tiles are [64 entries, 128 dims]). The
attention kernels' tiles ([64 keys, 512 dims] beside a 16-head fp32 accumulator) sit at 220-255
registers already, and decoding there spilled 0.2-4 KB on sm_90 in every variant tried
(``docs/decisions.md``, session 37).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...io.state_rows import RowCodec

FMT_VALUES = tl.constexpr(0)
FMT_FP8 = tl.constexpr(1)
FMT_MXFP4 = tl.constexpr(2)
FMT_NVFP4 = tl.constexpr(3)
_IDS = {"fp8": FMT_FP8.value, "mxfp4": FMT_MXFP4.value, "nvfp4": FMT_NVFP4.value}


def format_args(codec: RowCodec | None) -> tuple[int, int, int]:
    """(format id, block, tail) for a kernel's constexprs; ``None``: plain value rows."""
    if codec is None:
        return FMT_VALUES.value, 1, 0
    return _IDS[codec.fmt], codec.block, codec.tail


@triton.jit
def _ue8m0(b):
    """ue8m0 bytes (int32) -> fp32 2^(b-127) (byte 0: the subnormal 2^-127, as ``io.quant.ue8m0_to_float``)."""
    return tl.where(b == 0, 1 << 22, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3(b):
    """e4m3fn bytes (uint8) -> fp32, by the hardware's conversion (exact; the interpreter's too)."""
    return b.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1(n):
    """e2m1 nibbles (int32 0..15) -> fp32: 2^(e-1) (1 + m/2), or m / 2 for e = 0."""
    e = (n >> 1) & 3
    m = n & 1
    mag = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (mag | ((n & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def load_values(
    rows,
    live,
    FMT: tl.constexpr,
    BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    D: tl.constexpr,
    BD: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    WORDS: tl.constexpr = False,
):
    """The values ``[BN, BD]`` (fp32; 0 past ``D`` and in rows not ``live``) of the rows at
    ``rows`` ``[BN]`` (uint8 pointers, each at a row's first byte). FMT_FP8 rows: the ``TAIL``
    trailing channels in the value dtype (``VALUE_BYTES`` each: 2 bf16, 4 fp32), then ``D - TAIL``
    codes, then a ue8m0 scale per ``BLOCK``; fp4 rows: ``D / 2`` bytes of nibbles (low = even
    channel), then a scale (ue8m0 for MXFP4, e4m3 for NVFP4) per ``BLOCK``. ``WORDS`` (fp4 rows
    starting 4-byte aligned, ``words_fit``): the nibbles load as int32 words of eight, a load
    a word instead of one a value (the same values)."""
    offs_d = tl.arange(0, BD)[None, :]
    r2 = rows[:, None]
    live2 = live[:, None]
    if FMT == FMT_FP8:
        coded: tl.constexpr = D - TAIL
        lead: tl.constexpr = TAIL * VALUE_BYTES
        in_c = live2 & (offs_d < coded)
        code = tl.load(r2 + lead + offs_d, mask=in_c, other=0)
        scale = _ue8m0(tl.load(r2 + lead + coded + offs_d // BLOCK, mask=in_c, other=127).to(tl.int32))
        vals = _e4m3(code) * scale
        if TAIL > 0:
            in_t = live2 & (offs_d >= coded) & (offs_d < D)
            t_off = tl.maximum(offs_d - coded, 0)
            if VALUE_BYTES == 2:
                tail = tl.load(r2.to(tl.pointer_type(tl.bfloat16)) + t_off, mask=in_t, other=0.0)
            else:
                tail = tl.load(r2.to(tl.pointer_type(tl.float32)) + t_off, mask=in_t, other=0.0)
            vals = tl.where(offs_d < coded, vals, tail.to(tl.float32))
    elif WORDS:
        BN: tl.constexpr = rows.shape[0]
        NB: tl.constexpr = BD // BLOCK
        offs_w = tl.arange(0, BD // 8)[None, :]
        words = tl.load(r2.to(tl.pointer_type(tl.int32)) + offs_w, mask=live2 & (offs_w < D // 8), other=0)
        # nibble j of word w is channel 8 w + j (little-endian bytes, the low nibble first)
        nib = (words[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 15
        offs_b = tl.arange(0, NB)[None, :]
        scale = _fp4_scales(r2 + D // 2 + offs_b, live2 & (offs_b < D // BLOCK), FMT)
        vals = tl.reshape(tl.reshape(_e2m1(nib), [BN, NB, BLOCK]) * scale[:, :, None], [BN, BD])
    else:
        in_d = live2 & (offs_d < D)
        byte = tl.load(r2 + offs_d // 2, mask=in_d, other=0).to(tl.int32)
        nib = (byte >> ((offs_d & 1) * 4)) & 15
        vals = _e2m1(nib) * _fp4_scales(r2 + D // 2 + offs_d // BLOCK, in_d, FMT)
    return vals


@triton.jit
def _fp4_scales(ptrs, mask, FMT: tl.constexpr):
    """fp4 blocks' scales in fp32: ue8m0 (MXFP4) or e4m3 (NVFP4) bytes; masked ones are 1."""
    if FMT == FMT_MXFP4:
        return _ue8m0(tl.load(ptrs, mask=mask, other=127).to(tl.int32))
    return _e4m3(tl.load(ptrs, mask=mask, other=56))  # 0x38 is e4m3's 1 (its 0x7F is NaN)


def words_fit(codec: RowCodec | None, rows: torch.Tensor) -> bool:
    """Whether ``load_values`` may read ``rows`` (uint8, last dim a row) by words: fp4 rows, every
    row starting 4-byte aligned (the base and every stride but the last dim's), and blocks of a
    power of two of at least 8 channels that tile ``D`` (whole words of nibbles a block)."""
    if codec is None or codec.fmt not in ("mxfp4", "nvfp4"):
        return False
    aligned = rows.data_ptr() % 4 == 0 and all(s % 4 == 0 for s in rows.stride()[:-1])
    pow2 = codec.block & (codec.block - 1) == 0  # a power of two: it divides the tile's channels
    return aligned and pow2 and codec.block >= 8 and codec.dim % codec.block == 0
