"""``deepinfer::bi_sum`` / ``bi_mean`` / ``bi_cumsum`` on CUDA (``kernels/triton/bi_reduce.py``): torch's
values within rounding, and a row's bits the same whatever the other rows (alone, in any batch,
at any place). Under Triton's interpreter on the CPU (fp32), on the GPU in fp32 and bf16."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_fx.kernels.triton.bi_reduce import bi_cumsum_triton, bi_mean_triton, bi_sum_triton

# (shape, dim): the model's reductions (rms over D, Sinkhorn over 4, pools over a group, a
# sampler's row over the vocabulary), odd lengths, a dim that is not last, empty rows and tensors
CASES = [((6, 300), -1), ((5, 4, 4), -2), ((5, 4, 4), -1), ((3, 9, 7), 1), ((2, 2500), -1), ((4, 0), -1), ((0, 5), -1)]


def _dtypes(device: str) -> list[torch.dtype]:
    return [torch.float32, torch.bfloat16] if device == "cuda" else [torch.float32]


@pytest.mark.parametrize("shape,dim", CASES)
def test_matches_torch(device: str, shape: tuple[int, ...], dim: int) -> None:
    seed = random.SystemRandom().randrange(2**31)
    for dtype in _dtypes(device):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
        exact = x.double()  # fp32 accumulation, one rounding to the dtype: within its rounding of the exact
        tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
        for keepdim in (False, True):
            got, want = bi_sum_triton(x, dim, keepdim), x.sum(dim, keepdim=keepdim)
            assert got.shape == want.shape and got.dtype == want.dtype
            torch.testing.assert_close(got.double(), exact.sum(dim, keepdim=keepdim), **tol, msg=f"{seed=} sum {dtype}")
            got, want = bi_mean_triton(x, dim, keepdim), exact.mean(dim, keepdim=keepdim)
            torch.testing.assert_close(got.double(), want, **tol, equal_nan=True, msg=f"{seed=} mean {dtype}")
        got, want = bi_cumsum_triton(x, dim), torch.cumsum(x, dim)
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got.double(), exact.cumsum(dim), **tol, msg=f"{seed=} cumsum {dtype}")


@pytest.mark.parametrize("length", [4, 300, 2500])
def test_rows_do_not_depend_on_the_others(device: str, length: int) -> None:
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    for dtype in _dtypes(device):
        x = (torch.randn(33, length, generator=g) * 10).to(device, dtype)
        full = [f(x, -1) for f in (bi_sum_triton, bi_mean_triton, bi_cumsum_triton)]
        for rows in ([0], [5, 17], list(range(32, 0, -3))):
            for f, whole in zip((bi_sum_triton, bi_mean_triton, bi_cumsum_triton), full):
                got = f(x[rows], -1)
                assert torch.equal(got, whole[rows]), f"seed={seed} {f.__name__} rows {rows} {dtype}"


def test_integers_reduce_exactly(device: str) -> None:
    x = torch.randint(0, 5, (7, 9), device=device)
    assert torch.equal(bi_sum_triton(x, -1), x.sum(-1)) and torch.equal(bi_cumsum_triton(x, 0), x.cumsum(0))
