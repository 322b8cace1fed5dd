"""``kernels/triton/state_rows.load_values`` against ``RowCodec.unpack``, bit for bit, for every
trained-format row kind of the released models (fp32 and bf16 tails), values from 1e-12 to 1e3,
zero rows and blocks, on fresh seeds; on CPU under Triton's interpreter."""

from __future__ import annotations

import random

import pytest
import torch
import triton
import triton.language as tl

from deepinfer_fx.io.state_rows import RowCodec
from deepinfer_fx.kernels.triton.state_rows import format_args, load_values, words_fit


@triton.jit
def _unpack_kernel(
    src,
    dst,
    nbytes,
    n_rows,
    FMT: tl.constexpr,
    BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    D: tl.constexpr,
    VALUE_BYTES: tl.constexpr,
    BN: tl.constexpr,
    BD: tl.constexpr,
    WORDS: tl.constexpr,
):
    offs_n = tl.program_id(0) * BN + tl.arange(0, BN)
    offs_d = tl.arange(0, BD)[None, :]
    live = offs_n < n_rows
    vals = load_values(src + offs_n.to(tl.int64) * nbytes, live, FMT, BLOCK, TAIL, D, BD, VALUE_BYTES, WORDS)
    tl.store(dst + offs_n[:, None] * D + offs_d, vals, mask=live[:, None] & (offs_d < D))


def _unpack(t: torch.Tensor, codec: RowCodec, dtype: torch.dtype, words: bool) -> torch.Tensor:
    n = t.shape[0]
    out = torch.empty(n, codec.dim, dtype=torch.float32, device=t.device)
    fmt, block, tail = format_args(codec)
    bn = 8
    bd = triton.next_power_of_2(codec.dim)
    _unpack_kernel[(triton.cdiv(n, bn),)](
        t, out, t.shape[1], n, fmt, block, tail, codec.dim, dtype.itemsize, bn, bd, words
    )
    return out


CODECS = [
    RowCodec("fp8", 512, 64, 64),  # V4 window / entries
    RowCodec("fp8", 512, 32),  # V4.1 window
    RowCodec("nvfp4", 512, 16),  # V4.1 entries
    RowCodec("mxfp4", 128, 32),  # index keys
    RowCodec("fp8", 96, 32, 32),  # a tail that is not a power of two from the codes' end
]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: f"{c.fmt}-{c.dim}-{c.block}-{c.tail}")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_load_values_equals_unpack(codec: RowCodec, dtype: torch.dtype, device: str) -> None:
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    n = 13
    mag = torch.exp(torch.empty(n, 1).uniform_(-27.6, 6.9, generator=g))  # 1e-12 .. 1e3 a row
    x = torch.randn(n, codec.dim, generator=g) * mag
    x[3] = 0.0  # a zero row
    x[5, : codec.block] = 0.0  # a zero block
    x[7, ::3] *= 1e-6  # blocks with a wide spread
    t = codec.pack(x.to(dtype))
    want = codec.unpack(t, dtype).float()
    rows = t.to(device)
    # fp4 rows by words where they fit (every released fp4 row: 68 and 288 bytes), and by bytes
    for words in sorted({False, words_fit(codec, rows)}):
        got = _unpack(rows, codec, dtype, words).cpu()
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"seed {seed} words={words}"


def test_words_fit_only_aligned_fp4_rows() -> None:
    index, entries = RowCodec("mxfp4", 128, 32), RowCodec("nvfp4", 512, 16)
    nb, ne = index.nbytes(torch.bfloat16), entries.nbytes(torch.bfloat16)
    assert (nb, ne) == (68, 288)
    rows = torch.zeros(4, nb, dtype=torch.uint8)
    assert words_fit(index, rows) and words_fit(entries, torch.zeros(2, ne, dtype=torch.uint8))
    assert not words_fit(index, torch.zeros(4 * nb + 1, dtype=torch.uint8)[1:].view(4, -1))  # base
    assert not words_fit(index, torch.zeros(4, nb + 2, dtype=torch.uint8)[:, :nb])  # row stride 70
    assert not words_fit(RowCodec("fp8", 512, 64, 64), rows) and not words_fit(None, rows)
