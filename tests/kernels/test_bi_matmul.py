"""``deepinfer::bi_matmul``'s two ways over a weight cut into k chunks
(``kernels/triton/batch_invariant.py``): partials summed by a second launch (decode-sized calls)
and every chunk in turn inside one program (prefill-sized ones) give the same bits, so a row
moving between them as the batch grows keeps its result. Under Triton's interpreter on the CPU
(fp32, one tile for both ways: the interpreter's dot depends on the block), bf16 and fp32 on a GPU."""

from __future__ import annotations

import random

import pytest
import torch
import triton
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer_fx.kernels.triton.batch_invariant import (
    _bi_matmul_kernel,
    _sum_chunks_kernel,
    bi_matmul_blocks_triton,
    bi_matmul_triton,
    inline_chunks,
    splits,
    tiles,
    use_tma,
)


def _launch(x: torch.Tensor, w: torch.Tensor, s: int, inline: bool, tma: bool = False) -> torch.Tensor:
    m, k = x.shape
    n = w.shape[0]
    t = tiles(m, x.dtype == torch.float32)
    y = torch.empty(m, n, device=x.device, dtype=torch.float32)
    part = y if inline else torch.empty(s, m, n, device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(m, t["BM"]), triton.cdiv(n, t["BN"]), 1 if inline else s)
    stride_s = 0 if inline else part.stride(0)
    args = (x, w, part, m, n, *x.stride(), *w.stride(), part.stride(-2), part.stride(-1), stride_s)
    descs = {}
    if tma:
        descs = dict(
            x_desc=TensorDescriptor.from_tensor(x, [t["BM"], t["BK"]]),
            w_desc=TensorDescriptor.from_tensor(w, [t["BN"], t["BK"]]),
        )
    kw = dict(K=k, CHUNK=k // s, S=s if inline else 1, IEEE=x.dtype == torch.float32, **t, **descs)
    _bi_matmul_kernel[grid](*args, **kw)
    if not inline:
        _sum_chunks_kernel[(triton.cdiv(m * n, 256),)](part, y, m * n, S=s, BLOCK=256)
    return y


@pytest.mark.parametrize("s", [2, 4])
def test_chunks_in_one_program_equal_the_partials_summed(device: str, s: int) -> None:
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    for dtype in [torch.float32] + ([torch.bfloat16] if device == "cuda" else []):
        x = torch.randn(20, 256 * s, generator=g).to(device, dtype)
        w = torch.randn(40, 256 * s, generator=g).to(device, dtype)
        x[3] = 0.0
        w[5] = -0.0  # an all -0.0 row: its sign survives either way
        inline, summed = _launch(x, w, s, True), _launch(x, w, s, False)
        assert torch.equal(inline, summed) and torch.equal(inline.signbit(), summed.signbit()), f"{seed=} {dtype}"
        torch.testing.assert_close(inline, x.float() @ w.float().T, atol=1e-3, rtol=1e-3, msg=f"{seed=}")


@pytest.mark.parametrize("inline", [True, False])
def test_tma_tiles_equal_loaded_tiles(device: str, inline: bool) -> None:
    """Tiles read through tensor descriptors (prefill-sized calls, ``use_tma``) give the bits of
    the masked loads, rows and columns past the ends included."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    for dtype in [torch.float32] + ([torch.bfloat16] if device == "cuda" else []):
        x = torch.randn(300, 512, generator=g).to(device, dtype)
        w = torch.randn(40, 512, generator=g).to(device, dtype)
        assert use_tma(x, w, 256, tiles(300, dtype == torch.float32)["BK"])
        assert torch.equal(_launch(x, w, 2, inline, tma=True), _launch(x, w, 2, inline)), f"{seed=} {dtype}"


def test_prefill_sized_calls_take_the_chunks_inline(device: str) -> None:
    """A weight narrow enough to split (``splits`` > 1) runs inline once M fills the GPU with
    tiles, and still matches torch; a decode-sized call does not."""
    n, k = 512, 1024
    m = 449  # fp32: 8 x 16 tiles of 64 x 32
    assert splits(n, k) == 4 and inline_chunks(m, n, True) and not inline_chunks(16, n, True)
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(device)
    w = (torch.randn(n, k, generator=g) * k**-0.5).to(device)
    full = bi_matmul_triton(x, w, True)
    torch.testing.assert_close(full, x @ w.T, atol=1e-4, rtol=1e-4, msg=f"{seed=}")
    if device == "cuda":  # the interpreter's dot follows the block: rows alike on a GPU only
        assert torch.equal(bi_matmul_triton(x[:16], w, True), full[:16]), f"{seed=}"


@pytest.mark.parametrize("m", [5, 300])
def test_blocks_equal_a_matmul_a_block(device: str, m: int) -> None:
    """``bi_matmul_blocks`` off the skinny path (fp32 here; prefill-sized bf16 on a GPU): block
    g of the output is ``bi_matmul`` of x's block g and w's, written in place into the output's
    columns (the chunk partials summed there too)."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    blocks, r, k = 3, 40, 512
    assert splits(r, k) == 2  # the partials' path at 5 rows
    x = torch.randn(m, blocks * k, generator=g).to(device)
    w = (torch.randn(blocks * r, k, generator=g) * k**-0.5).to(device)
    got = bi_matmul_blocks_triton(x, w, blocks)
    for b in range(blocks):
        want = bi_matmul_triton(x[:, b * k : (b + 1) * k].contiguous(), w[b * r : (b + 1) * r], False)
        assert torch.equal(got[:, b * r : (b + 1) * r], want), f"{seed=} block {b}"
