"""Tests for the FP8 / MXFP4 codecs and fake-quant helpers (deepinfer_fx.io.quant)."""

from __future__ import annotations

import math
import random
import re

import pytest
import torch

from deepinfer_fx.io.quant import (
    dequant_fp8_block,
    dequant_mxfp4,
    fq4_e4m3,
    fq4_ue8m0,
    fq8,
    hadamard,
    quant_fp8_block,
    quant_mxfp4,
    ue8m0_to_float,
)

# Written out by hand so the reference decoder shares nothing with the module.
E2M1_REF = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
E2M1_GRID = torch.tensor(sorted(set(E2M1_REF)))


@pytest.fixture
def gen() -> torch.Generator:
    # A fresh seed each run widens coverage; printing it makes a failure reproducible
    # (pytest shows captured stdout for failing tests).
    seed = random.randrange(2**31)
    print(f"seed={seed}")
    return torch.Generator().manual_seed(seed)


def randn(gen: torch.Generator, *shape: int, min_exp: int = -8) -> torch.Tensor:
    # Per-row magnitudes spread over several binades so scales differ between blocks.
    mag = torch.exp2(torch.randint(min_exp, 9, (*shape[:-1], 1), generator=gen).float())
    return torch.randn(*shape, generator=gen) * mag


def random_e4m3(gen: torch.Generator, *shape: int) -> torch.Tensor:
    b = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x3C  # drop the two NaN encodings
    return b.view(torch.float8_e4m3fn)


def random_ue8m0(gen: torch.Generator, *shape: int, lo: int = 100, hi: int = 150) -> torch.Tensor:
    return torch.randint(lo, hi, shape, generator=gen, dtype=torch.uint8).view(torch.float8_e8m0fnu)


def block_view(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


# ---------------------------------------------------------------- ue8m0


def test_ue8m0_to_float_matches_definition():
    b = torch.arange(256, dtype=torch.uint8)
    got = ue8m0_to_float(b.view(torch.float8_e8m0fnu))
    assert got.dtype == torch.float32
    expected = [math.ldexp(1.0, i - 127) for i in range(255)]
    assert got[:255].tolist() == expected
    assert torch.isnan(got[255])
    assert torch.equal(ue8m0_to_float(b)[:255], got[:255])
    f = torch.tensor([0.25, 3.0], dtype=torch.float64)
    assert ue8m0_to_float(f).dtype == torch.float32
    assert ue8m0_to_float(f).tolist() == [0.25, 3.0]


# ---------------------------------------------------------------- fp8 block


def ref_dequant_fp8(w: torch.Tensor, scale_f: list[list[float]], block: int) -> torch.Tensor:
    n, k = w.shape
    out = torch.empty(n, k)
    for i in range(len(scale_f)):
        for j in range(len(scale_f[0])):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            out[rows, cols] = w[rows, cols].float() * scale_f[i][j]
    return out


@pytest.mark.parametrize("block,shape", [(128, (300, 200)), (32, (70, 45)), (32, (64, 96))])
def test_dequant_fp8_block_matches_loop_reference(gen, block, shape):
    n, k = shape
    w = random_e4m3(gen, n, k)
    scale = random_ue8m0(gen, -(-n // block), -(-k // block))
    scale_f = [[2.0 ** (b - 127) for b in row] for row in scale.view(torch.uint8).tolist()]
    expected = ref_dequant_fp8(w, scale_f, block)
    assert torch.equal(dequant_fp8_block(w, scale, block), expected)
    # Checkpoints that ship float32 scales must decode identically.
    assert torch.equal(dequant_fp8_block(w, torch.tensor(scale_f), block), expected)
    assert dequant_fp8_block(w, scale, block, dtype=torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("block,shape", [(128, (300, 200)), (32, (70, 45))])
def test_fp8_block_round_trip_error(gen, block, shape):
    x = randn(gen, *shape)
    w8, s = quant_fp8_block(x, block)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == x.shape
    assert s.dtype == torch.float8_e8m0fnu and s.shape == (-(-shape[0] // block), -(-shape[1] // block))
    y = dequant_fp8_block(w8, s, block)
    err = (y - x).abs()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = (slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block))
            assert err[blk].max() <= 2.0**-3 * x[blk].abs().max()
    # Already representable values survive a second round trip bit-for-bit.
    assert torch.equal(dequant_fp8_block(*quant_fp8_block(y, block), block), y)


def test_fp8_block_exact_for_representable_values(gen):
    block, n, k = 32, 70, 45
    v = random_e4m3(gen, n, k).float()
    v[::block, ::block] = 448.0  # pins every block's amax so the scale is exactly 2^e
    e = torch.randint(-20, 20, (-(-n // block), -(-k // block)), generator=gen).float()
    x = v * torch.exp2(e).repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    w8, s = quant_fp8_block(x, block)
    assert torch.equal(ue8m0_to_float(s), torch.exp2(e))
    assert torch.equal(w8.float(), v)
    assert torch.equal(dequant_fp8_block(w8, s, block), x)


def test_dequant_fp8_block_bad_scale_shape_names_shapes():
    w = torch.zeros(300, 200).to(torch.float8_e4m3fn)
    scale = torch.ones(2, 2)
    with pytest.raises(ValueError, match=re.escape("(2, 2)")) as info:
        dequant_fp8_block(w, scale, 128)
    assert "(3, 2)" in str(info.value) and "(300, 200)" in str(info.value)


# ---------------------------------------------------------------- mxfp4


def ref_dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows = packed.view(torch.uint8).tolist()
    srows = scale.view(torch.uint8).tolist()
    out = torch.empty(len(rows), 2 * len(rows[0]))
    for n, row in enumerate(rows):
        for j, byte in enumerate(row):
            for k, code in ((2 * j, byte & 0xF), (2 * j + 1, byte >> 4)):
                out[n, k] = E2M1_REF[code] * 2.0 ** (srows[n][k // 32] - 127)
    return out


@pytest.mark.parametrize("packed_dtype", [torch.int8, torch.uint8])
def test_dequant_mxfp4_matches_nibble_reference(gen, packed_dtype):
    n, k = 6, 96
    raw = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    raw[0, :16] = torch.arange(0, 256, 16, dtype=torch.uint8) + torch.arange(16, dtype=torch.uint8)
    packed = raw.view(packed_dtype)
    scale = random_ue8m0(gen, n, k // 32, lo=110, hi=140)
    got = dequant_mxfp4(packed, scale)
    assert torch.equal(got, ref_dequant_mxfp4(packed, scale))


def test_dequant_mxfp4_nibble_order_and_sign():
    # 0x9A: low nibble 0xA (-1.0) is element 0, high nibble 0x9 (-0.5) is element 1.
    packed = torch.full((1, 16), 0x9A, dtype=torch.uint8).view(torch.int8)
    scale = torch.tensor([[128]], dtype=torch.uint8).view(torch.float8_e8m0fnu)  # 2^1
    got = dequant_mxfp4(packed, scale)
    assert got[0, :4].tolist() == [-2.0, -1.0, -2.0, -1.0]


def test_mxfp4_round_trip_equals_fake_quant(gen):
    x = randn(gen, 2, 8, 128)
    x[0, 0, :32] = 0.0  # all-zero block exercises the amax floor
    packed, scale = quant_mxfp4(x)
    assert packed.dtype == torch.int8 and packed.shape == (2, 8, 64)
    assert scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 8, 4)
    assert torch.equal(dequant_mxfp4(packed, scale), fq4_ue8m0(x, 32))


def test_mxfp4_bad_shapes_raise():
    with pytest.raises(ValueError, match="not a multiple of block 32"):
        quant_mxfp4(torch.zeros(4, 48))
    packed = torch.zeros(4, 32, dtype=torch.int8)
    scale = torch.zeros(4, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match=re.escape("(4, 3)")) as info:
        dequant_mxfp4(packed, scale)
    assert "(4, 2)" in str(info.value) and "(4, 32)" in str(info.value)


# ---------------------------------------------------------------- fake quant


def fp8_scale(blocks: torch.Tensor) -> torch.Tensor:
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(1e-4)
    return torch.exp2(torch.ceil(torch.log2(amax / 448)))


def ue8m0_scale(blocks: torch.Tensor) -> torch.Tensor:
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-126)
    return torch.exp2(torch.ceil(torch.log2(amax / 6)))


def e4m3_scale(blocks: torch.Tensor) -> torch.Tensor:
    amax = blocks.abs().amax(-1, keepdim=True).clamp_min(6 * 2.0**-9)
    return (amax / 6).clamp_max(448).to(torch.float8_e4m3fn).float()


def on_e4m3_grid(q: torch.Tensor) -> bool:
    return torch.equal(q.clamp(-448, 448).to(torch.float8_e4m3fn).float(), q)


def on_e2m1_grid(q: torch.Tensor) -> bool:
    return bool(torch.isin(q, E2M1_GRID).all())


# (fn, block, scale reference, grid check, error bound as a fraction of block amax,
#  smallest row-magnitude exponent). fq4_e4m3 is only idempotent while amax/6 is an
# e4m3 normal (>= 2^-6): a subnormal scale is too coarse to be reproduced from the
# rounded block, so its inputs stay above that range.
FAKE_QUANTS = [
    pytest.param(fq8, 128, fp8_scale, on_e4m3_grid, 2.0**-4, -8, id="fq8-128"),
    pytest.param(fq8, 32, fp8_scale, on_e4m3_grid, 2.0**-4, -8, id="fq8-32"),
    pytest.param(fq4_ue8m0, 32, ue8m0_scale, on_e2m1_grid, 1 / 3, -8, id="fq4_ue8m0"),
    pytest.param(fq4_e4m3, 16, e4m3_scale, on_e2m1_grid, 1 / 5, -2, id="fq4_e4m3"),
]


@pytest.mark.parametrize("fn,block,scale_fn,on_grid,bound,min_exp", FAKE_QUANTS)
def test_fake_quant_grid_idempotent_and_bounded(gen, fn, block, scale_fn, on_grid, bound, min_exp):
    x = randn(gen, 3, 16, 256, min_exp=min_exp)
    y = fn(x, block)
    assert y.shape == x.shape and y.dtype == x.dtype
    xb, yb = block_view(x, block), block_view(y, block)
    assert on_grid(yb / scale_fn(xb))
    assert torch.equal(fn(y, block), y)
    amax = xb.abs().amax(-1, keepdim=True)
    assert bool(((yb - xb).abs() <= bound * amax).all())


@pytest.mark.parametrize("fn,block", [(fq8, 32), (fq4_ue8m0, 32), (fq4_e4m3, 16)])
def test_fake_quant_keeps_dtype_and_rejects_ragged_last_dim(gen, fn, block):
    x = randn(gen, 4, 64).to(torch.bfloat16)
    y = fn(x, block)
    assert y.dtype == torch.bfloat16
    # Grid values times the scale are exactly representable in bf16.
    assert torch.equal(y.float(), fn(x.float(), block))
    with pytest.raises(ValueError, match="multiple of block"):
        fn(torch.zeros(4, block + 1), block)


def test_fq8_ties_to_even():
    x = torch.zeros(32)
    x[0] = 448.0  # scale = 1
    x[1:5] = torch.tensor([1.0625, 1.1875, -1.0625, -1.1875])
    assert fq8(x, 32)[1:5].tolist() == [1.0, 1.25, -1.0, -1.25]


def test_e2m1_rounding_ties_to_even_code():
    x = torch.zeros(32)
    x[0] = 6.0  # scale = 1
    ties = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    x[1:8] = torch.tensor(ties)
    x[8:15] = -torch.tensor(ties)
    y = fq4_ue8m0(x, 32)
    assert y[1:8].tolist() == expected
    assert y[8:15].tolist() == [-v for v in expected]
    packed, scale = quant_mxfp4(x[None])
    assert torch.equal(dequant_mxfp4(packed, scale)[0], y)


def test_fq4_e4m3_scale_saturates():
    x = torch.zeros(16)
    x[0], x[1] = 1e5, -3000.0  # amax/6 far above 448, so the scale sticks at 448
    y = fq4_e4m3(x, 16)
    assert y[0].item() == 6 * 448.0 and y[1].item() == -6 * 448.0
    assert not torch.isnan(y).any()


# ---------------------------------------------------------------- hadamard


def test_hadamard_orthonormal(gen):
    x = randn(gen, 5, 3, 64).double()
    y = hadamard(x)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(hadamard(y), x)


def test_hadamard_matches_sylvester_kron(gen):
    h = torch.ones(1, 1, dtype=torch.float64)
    for _ in range(7):
        h = torch.kron(torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64), h)
    x = randn(gen, 10, 128).double()
    torch.testing.assert_close(hadamard(x), x @ h.T / math.sqrt(128))
    # float32 sums of 128 terms cancel, so bound the error by the row norm instead.
    err = (hadamard(x.float()).double() - x @ h.T / math.sqrt(128)).abs().amax(-1)
    assert bool((err <= 1e-6 * x.norm(dim=-1)).all())
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(torch.zeros(2, 96))
