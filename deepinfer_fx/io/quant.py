"""Block-scaled FP8 / MXFP4 codecs and fake-quant helpers.

DeepSeek-V4 checkpoints store dense weights as FP8 (e4m3) with one power-of-two
(ue8m0) scale per square block, and expert weights as MXFP4: packed e2m1 codes
with one ue8m0 scale per 32 consecutive elements of a row.  The ``quant_*``
functions are the exact inverses used to write synthetic test checkpoints, and
the ``fq*`` functions emulate the on-device activation quantizers so that a
float reference path rounds exactly like the fused kernels do.

All arithmetic runs in float32: every scale is either a power of two or an
e4m3 value, so multiplying/dividing by it is exact there, and results are only
rounded once, when cast back to the caller's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "ue8m0_to_float",
    "fp8_block_of",
    "dequant_fp8_block",
    "quant_fp8_block",
    "dequant_mxfp4",
    "quant_mxfp4",
    "fq8",
    "fq4_ue8m0",
    "fq4_e4m3",
    "hadamard",
]

E4M3_MAX = 448.0
E2M1_MAX = 6.0
MXFP4_BLOCK = 32
_FP8_AMAX_FLOOR = 1e-4
# Flooring amax here keeps the exponent at or above -126, i.e. a normal float32
# scale that ue8m0 can also represent.
_FP4_UE8M0_AMAX_FLOOR = E2M1_MAX * 2.0**-126
# 2^-9 is the smallest e4m3 subnormal, so the e4m3 scale can never round to 0.
_FP4_E4M3_AMAX_FLOOR = E2M1_MAX * 2.0**-9


def ue8m0_to_float(s: Tensor) -> Tensor:
    """Decode ue8m0 scales (float8_e8m0fnu or raw uint8 bytes) to float32."""
    if s.dtype.is_floating_point and s.dtype != torch.float8_e8m0fnu:
        # Some checkpoints already ship decoded float scales.
        return s.to(torch.float32)
    if s.dtype == torch.float8_e8m0fnu:
        s = s.view(torch.uint8)
    elif s.dtype != torch.uint8:
        raise TypeError(f"ue8m0 scales must be float8_e8m0fnu, uint8 or float, got {s.dtype}")
    # Build the float32 bit pattern directly instead of calling exp2: it is exact
    # for byte 0 (2^-127, a float32 subnormal) regardless of denormal flushing.
    b = s.to(torch.int32)
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
    bits = torch.where(b == 255, torch.full_like(b, 0x7FC00000), bits)
    return bits.view(torch.float32)


def _pow2_ceil_exponent(x: Tensor) -> Tensor:
    """ceil(log2(x)) for positive float32 x, computed exactly via frexp.

    torch.log2 can land a hair above an exact power of two and ceil would then
    double the scale; frexp reads the exponent straight from the bits.
    """
    mantissa, exponent = torch.frexp(x)
    # x = m * 2^e with m in [0.5, 1): exact powers of two have m == 0.5.
    return torch.where(mantissa == 0.5, exponent - 1, exponent)


def _exponent_to_ue8m0(e: Tensor) -> Tensor:
    return (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def _split_blocks(x: Tensor, block: int) -> Tensor:
    """View the last dim as [K // block, block]; the shared layout for all block scaling."""
    if block <= 0:
        raise ValueError(f"block must be positive, got {block}")
    k = x.shape[-1]
    if k % block != 0:
        raise ValueError(f"last dim {k} of shape {tuple(x.shape)} is not a multiple of block {block}")
    return x.reshape(*x.shape[:-1], k // block, block)


def _block_amax(blocks: Tensor, floor: float) -> Tensor:
    return blocks.abs().amax(dim=-1, keepdim=True).clamp_min(floor)


def _round_e2m1(v: Tensor) -> Tensor:
    """Round float32 to the nearest e2m1 value, ties to the even code, saturating at ±6.

    The e2m1 grid is uniform within each binade (step 0.5 below 2, 1 in [2, 4),
    2 in [4, 6]), and within a binade the integer v/step has the same parity as
    the code, so torch.round's half-to-even gives ties-to-even-code for free.
    """
    v = v.clamp(-E2M1_MAX, E2M1_MAX)
    a = v.abs()
    step = torch.where(a < 2.0, 0.5, torch.where(a < 4.0, 1.0, 2.0))
    return torch.round(v / step) * step


def _e2m1_codes(q: Tensor) -> Tensor:
    """4-bit codes (uint8) for values already on the e2m1 grid: magnitudes 0, .5, 1, 1.5 are
    codes 0-3 (2a), 2 and 3 are 4 and 5 (a + 2), 4 and 6 are 6 and 7 (a / 2 + 4); bit 3 is the
    sign. Arithmetic, not a table, so a compiled step builds no constant tensor per call."""
    a = q.abs()
    mag = torch.where(a < 2.0, 2.0 * a, torch.where(a < 4.0, a + 2.0, 0.5 * a + 4.0)).to(torch.uint8)
    # -0.0 deliberately encodes as +0 (code 0): the sign of zero carries nothing.
    return torch.where(q < 0, mag | 8, mag)


def fp8_block_of(shape: Sequence[int], scale_shape: Sequence[int]) -> int:
    """The square block that tiles a weight ``[..., N, K]`` onto its scale grid ``[..., nb, kb]``:
    the smallest power of two ``b`` with ``nb = ceil(N / b)`` and ``kb = ceil(K / b)``.

    Kernels and the eager path read the block from the shapes, so a held weight needs nothing
    beside its scales. DeepSeek's blocks are powers of two (128, 32); among those a grid of two or
    more blocks on a dim admits exactly one, and any that covers a dim in one block gives the
    same values, so the smallest that fits is the block the scales were made with."""
    *lead, n, k = shape
    *slead, nb, kb = scale_shape
    b = 1
    while lead == slead and b < 2 * max(n, k):  # past the first b >= N, K nothing new fits
        if -(-n // b) == nb and -(-k // b) == kb:
            return b
        b *= 2
    raise ValueError(f"scale shape {tuple(scale_shape)} is no power-of-two block grid of weight shape {tuple(shape)}")


def dequant_fp8_block(w: Tensor, scale: Tensor, block: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantize a block-scaled e4m3 weight ``[..., N, K]`` (one matrix, or experts stacked on
    the leading dims) with scales ``[..., ceil(N/b), ceil(K/b)]``."""
    if w.dim() < 2:
        raise ValueError(f"expected an fp8 weight of at least 2 dims, got shape {tuple(w.shape)}")
    if w.dtype in (torch.uint8, torch.int8):
        w = w.view(torch.float8_e4m3fn)
    *lead, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    if tuple(scale.shape) != (*lead, nb, kb):
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match expected {(*lead, nb, kb)} "
            f"for weight shape {tuple(w.shape)} with block {block}"
        )
    s = ue8m0_to_float(scale)
    wf = w.to(torch.float32)
    if n % block or k % block:
        # Pad to whole blocks so a broadcasted multiply works, then crop.
        wf = torch.nn.functional.pad(wf, (0, kb * block - k, 0, nb * block - n))
    out = wf.reshape(*lead, nb, block, kb, block) * s[..., :, None, :, None]
    return out.view(*lead, nb * block, kb * block)[..., :n, :k].to(dtype).contiguous()


def quant_fp8_block(w: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """Quantize ``[..., N, K]`` to (float8_e4m3fn weight, float8_e8m0fnu scales
    ``[..., ceil(N/b), ceil(K/b)]``); leading dims are independent matrices (stacked experts)."""
    if w.dim() < 2:
        raise ValueError(f"expected a weight of at least 2 dims, got shape {tuple(w.shape)}")
    *lead, n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    # Zero padding cannot raise a block's amax, so partial blocks scale correctly.
    wf = torch.nn.functional.pad(w.to(torch.float32), (0, kb * block - k, 0, nb * block - n))
    blocks = wf.view(*lead, nb, block, kb, block)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(_FP8_AMAX_FLOOR)
    e = _pow2_ceil_exponent(amax / E4M3_MAX)
    scale = torch.exp2(e.to(torch.float32))
    w8 = (blocks / scale[..., :, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    w8 = w8.view(*lead, nb * block, kb * block)[..., :n, :k].contiguous()
    return w8, _exponent_to_ue8m0(e)


def quant_fp8_rows(w: Tensor, block: int = 32) -> tuple[Tensor, Tensor]:
    """Quantize [..., K] to (float8_e4m3fn, float8_e8m0fnu scales [..., K/block]): one scale per
    ``block`` channels of each row, the layout of V4.1's Engram table rows."""
    w8, e = fp8_blocks(w, block)
    return w8.reshape(w.shape).contiguous(), _exponent_to_ue8m0(e.squeeze(-1))


def dequant_mxfp4(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """Dequantize MXFP4 [..., K/2] (low nibble = even k) with ue8m0 scales [..., K/32]."""
    if packed.dtype not in (torch.int8, torch.uint8):
        raise TypeError(f"packed mxfp4 must be int8 or uint8, got {packed.dtype}")
    k = 2 * packed.shape[-1]
    if k % MXFP4_BLOCK != 0:
        raise ValueError(f"packed shape {tuple(packed.shape)} gives K={k}, not a multiple of {MXFP4_BLOCK}")
    expected = (*packed.shape[:-1], k // MXFP4_BLOCK)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale shape {tuple(scale.shape)} does not match expected {expected} "
            f"for packed shape {tuple(packed.shape)}"
        )
    vals = _split_blocks(e2m1_unpack(packed.view(torch.uint8)), MXFP4_BLOCK)
    out = vals * ue8m0_to_float(scale).unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], k).to(dtype)


def _mxfp4_scale_exponent(blocks: Tensor) -> Tensor:
    return _pow2_ceil_exponent(_block_amax(blocks, _FP4_UE8M0_AMAX_FLOOR) / E2M1_MAX)


def quant_mxfp4(w: Tensor) -> tuple[Tensor, Tensor]:
    """Quantize [..., K] to (int8 packed e2m1 [..., K/2], float8_e8m0fnu scales [..., K/32])."""
    q, e = fp4_ue8m0_blocks(w)
    packed = e2m1_pack(q.reshape(w.shape)).view(torch.int8)
    return packed, _exponent_to_ue8m0(e.squeeze(-1))


def fp8_blocks(x: Tensor, block: int) -> tuple[Tensor, Tensor]:
    """``fq8``'s parts: e4m3 values ``[..., K / block, block]`` and each block's scale exponent
    ``[..., K / block, 1]`` (int; the scale is ``2 ** e``)."""
    blocks = _split_blocks(x.to(torch.float32), block)
    e = _pow2_ceil_exponent(_block_amax(blocks, _FP8_AMAX_FLOOR) / E4M3_MAX)
    # Clamp first: older torch turns out-of-range values into NaN on this cast.
    q = (blocks / torch.exp2(e.to(torch.float32))).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, e


def fq8(x: Tensor, block: int) -> Tensor:
    """Fake-quantize to e4m3 with a power-of-two scale per block of the last dim."""
    q, e = fp8_blocks(x, block)
    return (q.to(torch.float32) * torch.exp2(e.to(torch.float32))).reshape(x.shape).to(x.dtype)


def fp4_ue8m0_blocks(x: Tensor, block: int = MXFP4_BLOCK) -> tuple[Tensor, Tensor]:
    """``fq4_ue8m0``'s parts: e2m1 values (float32) ``[..., K / block, block]`` and each block's
    scale exponent ``[..., K / block, 1]``."""
    blocks = _split_blocks(x.to(torch.float32), block)
    e = _mxfp4_scale_exponent(blocks)
    return _round_e2m1(blocks / torch.exp2(e.to(torch.float32))), e


def fq4_ue8m0(x: Tensor, block: int = MXFP4_BLOCK) -> Tensor:
    """Fake-quantize to e2m1 with a power-of-two (ue8m0) scale per block (MXFP4 style)."""
    q, e = fp4_ue8m0_blocks(x, block)
    return (q * torch.exp2(e.to(torch.float32))).reshape(x.shape).to(x.dtype)


def fp4_e4m3_blocks(x: Tensor, block: int = 16) -> tuple[Tensor, Tensor]:
    """``fq4_e4m3``'s parts: e2m1 values (float32) ``[..., K / block, block]`` and each block's
    e4m3 scale ``[..., K / block, 1]`` (float8_e4m3fn)."""
    blocks = _split_blocks(x.to(torch.float32), block)
    raw = _block_amax(blocks, _FP4_E4M3_AMAX_FLOOR) / E2M1_MAX
    # The scale is rounded to e4m3, so x/scale can slightly exceed 6; _round_e2m1 clamps it.
    scale = raw.clamp_max(E4M3_MAX).to(torch.float8_e4m3fn)
    return _round_e2m1(blocks / scale.to(torch.float32)), scale


def fq4_e4m3(x: Tensor, block: int = 16) -> Tensor:
    """Fake-quantize to e2m1 with an e4m3 scale per block (NVFP4 style, no global scale).

    Without a global scale, blocks with amax/6 below 2^-6 get a subnormal e4m3
    scale; those are coarse enough that re-quantizing the output may pick a
    different scale, so idempotence only holds above that range.
    """
    q, scale = fp4_e4m3_blocks(x, block)
    return (q * scale.to(torch.float32)).reshape(x.shape).to(x.dtype)


def e2m1_pack(q: Tensor) -> Tensor:
    """Values on the e2m1 grid ``[..., K]`` (K even) -> uint8 ``[..., K / 2]``, low nibble = even k."""
    codes = _e2m1_codes(q)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e2m1_unpack(b: Tensor) -> Tensor:
    """``e2m1_pack``'s inverse: uint8 ``[..., K / 2]`` -> float32 values ``[..., K]``: exponent
    bits e and mantissa bit m give m / 2 (e = 0) or (1 + m / 2) * 2^(e - 1), exact in float32."""
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    e = ((codes >> 1) & 3).to(torch.float32)
    m = (codes & 1).to(torch.float32)
    mag = torch.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * torch.exp2(e - 1.0))
    return torch.where((codes & 8) != 0, -mag, mag)


def _sylvester_sign_matrix(n: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    """``H[i, j] = (-1) ** popcount(i & j)``, the unnormalised Sylvester matrix (exact in any
    dtype), built on ``device``: a compiled step must not copy a host-built matrix each replay."""
    idx = torch.arange(n, device=device)
    both = idx[:, None] & idx[None, :]
    parity = torch.zeros_like(both)
    for bit in range(max(n - 1, 1).bit_length()):
        parity = parity ^ ((both >> bit) & 1)
    return (1 - 2 * parity).to(dtype)


def hadamard(x: Tensor) -> Tensor:
    """Orthonormal Sylvester-order Hadamard transform along the last dim (power of two)."""
    n = x.shape[-1]
    if n <= 0 or n & (n - 1):
        raise ValueError(f"hadamard needs a power-of-two last dim, got shape {tuple(x.shape)}")
    h = _sylvester_sign_matrix(n, x.device, x.dtype)
    # The Sylvester matrix is symmetric, so x @ h applies H to each row vector.
    return (x @ h) * (1.0 / math.sqrt(n))
