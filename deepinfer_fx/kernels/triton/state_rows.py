"""Device code that reads trained-format state rows (``io/state_rows.py``) where they lie.

A kernel that streams keys from the cache state gets their values with ``load_values``: for a
tile of row pointers (uint8, each at the start of a row of ``nbytes`` bytes) and a range of
channels it loads the codes and their blocks' scales and returns ``code * scale`` in fp32, the
values ``RowCodec.unpack`` gives (every value is exact in fp32), so a kernel reading packed
rows runs the same arithmetic on the same values as one reading the unpacked state.

Decoding is integer arithmetic into fp32 bit patterns (no fp8 casts), so the interpreter and
every GPU produce the same bits. Formats are constexpr ids: ``FMT_VALUES`` (plain rows in the
value dtype), ``FMT_FP8``, ``FMT_MXFP4``, ``FMT_NVFP4``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...io.state_rows import RowCodec

FMT_VALUES = 0
FMT_FP8 = 1
FMT_MXFP4 = 2
FMT_NVFP4 = 3
_IDS = {"fp8": FMT_FP8, "mxfp4": FMT_MXFP4, "nvfp4": FMT_NVFP4}


def format_args(codec: RowCodec | None) -> tuple[int, int, int]:
    """(format id, block, tail) for a kernel's constexprs; ``None``: plain value rows."""
    if codec is None:
        return FMT_VALUES, 1, 0
    return _IDS[codec.fmt], codec.block, codec.tail


@triton.jit
def _e4m3(b):
    """e4m3fn bytes (int32 0..255) -> fp32: 2^(e-7) (1 + m/8), or m 2^-9 for e = 0. The sign goes
    in as a bit: Triton negates as ``0 - x``, which turns -0 into +0."""
    e = (b >> 3) & 15
    m = b & 7
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)
    mag = tl.where(e == 0, sub, ((e + 120) << 23) | (m << 20))
    return (mag | ((b & 128) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def _e2m1(n):
    """e2m1 nibbles (int32 0..15) -> fp32: 2^(e-1) (1 + m/2), or m / 2 for e = 0."""
    e = (n >> 1) & 3
    m = n & 1
    mag = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (mag | ((n & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _ue8m0(b):
    """ue8m0 bytes -> fp32 2^(b-127) (byte 0: the subnormal 2^-127, as ``io.quant.ue8m0_to_float``)."""
    return tl.where(b == 0, 1 << 22, b << 23).to(tl.float32, bitcast=True)


@triton.jit
def load_values(
    rows,
    offs_d,
    mask,
    FMT: tl.constexpr,
    BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    D: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
):
    """Channels ``offs_d`` ``[1, BD]`` of the rows at ``rows`` ``[BN, 1]`` (uint8 pointers), where
    ``mask``: fp32 ``[BN, BD]`` (0 elsewhere). FMT_FP8 rows: the ``TAIL`` trailing channels in the
    value dtype (``VALUE_BYTES`` each: 2 bf16 / fp16, 4 fp32), then ``D - TAIL`` codes, then a ue8m0
    scale per ``BLOCK``; fp4 rows: ``D / 2`` bytes of nibbles (low = even channel), then a scale
    (ue8m0 for MXFP4, e4m3 for NVFP4) per ``BLOCK``."""
    if FMT == FMT_FP8:
        coded = D - TAIL
        lead = TAIL * VALUE_BYTES
        in_c = mask & (offs_d < coded)
        code = tl.load(rows + lead + offs_d, mask=in_c, other=0).to(tl.int32)
        scale = tl.load(rows + lead + coded + offs_d // BLOCK, mask=in_c, other=127).to(tl.int32)
        vals = _e4m3(code) * _ue8m0(scale)
        if TAIL > 0:
            in_t = mask & (offs_d >= coded)
            t_off = tl.maximum(offs_d - coded, 0)
            if VALUE_BYTES == 2:
                tail = tl.load(rows.to(tl.pointer_type(tl.bfloat16)) + t_off, mask=in_t, other=0.0)
            else:
                tail = tl.load(rows.to(tl.pointer_type(tl.float32)) + t_off, mask=in_t, other=0.0)
            vals = tl.where(offs_d < coded, vals, tail.to(tl.float32))
    else:
        byte = tl.load(rows + offs_d // 2, mask=mask, other=0).to(tl.int32)
        nib = (byte >> ((offs_d & 1) * 4)) & 15
        sb = tl.load(rows + D // 2 + offs_d // BLOCK, mask=mask, other=127).to(tl.int32)
        if FMT == FMT_MXFP4:
            vals = _e2m1(nib) * _ue8m0(sb)
        else:
            vals = _e2m1(nib) * _e4m3(sb)
    return tl.where(mask, vals, 0.0)
