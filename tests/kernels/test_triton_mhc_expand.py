"""``deepinfer::mhc_expand``'s Triton kernel (``kernels/triton/mhc_expand.py``) against
``graphs/mhc.py::mhc_expand``: within a few ulp of the result's scale in fp32 and bf16 (the
kernel keeps the reference's roundings, but on an H100 its bits differed from eager ATen's, and
Triton's interpreter truncates where it casts to bf16), 0 to 70 tokens, widths whose channel blocks end part-filled, a
token alone == in a batch bit for bit, and a stream count the kernel leaves to the reference.
Under Triton's interpreter on the CPU; on CUDA also P8's width. Fresh seeds, named in failures."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_fx.graphs.mhc import mhc_expand
from deepinfer_fx.kernels.triton.mhc_expand import mhc_expand_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
reference = mhc_expand.reference  # type: ignore[attr-defined]


def _inputs(seed: int, t: int, n: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(t, n, d, generator=g).to(DEVICE, dtype)
    y = torch.randn(t, d, generator=g).to(DEVICE, dtype)
    post = (torch.rand(t, n, generator=g) * 2).to(DEVICE)
    comb = torch.rand(t, n, n, generator=g).to(DEVICE)
    return X, y, post, comb / comb.sum(-2, keepdim=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "t,d", [(0, 64), (1, 64), (5, 96), (70, 40)] + ([(3, 4096), (64, 5120)] if DEVICE == "cuda" else [])
)
def test_matches_the_reference(dtype: torch.dtype, t: int, d: int) -> None:
    seed = random.SystemRandom().randrange(2**31)
    args = _inputs(seed, t, 4, d, dtype)
    got, want = mhc_expand_triton(*args), reference(*args)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    tol = 4 * torch.finfo(dtype).eps * float(want.abs().float().max()) if want.numel() else 0.0
    assert ((got.float() - want.float()).abs() <= tol).all(), f"seed={seed}"


def test_a_token_alone_equals_the_token_in_a_batch() -> None:
    seed = random.SystemRandom().randrange(2**31)
    args = _inputs(seed, 9, 4, 160, torch.bfloat16)
    batch = mhc_expand_triton(*args)
    for t in (0, 4, 8):
        alone = mhc_expand_triton(*(a[t : t + 1].clone() for a in args))
        assert torch.equal(alone[0], batch[t]), f"seed={seed} token {t}"


def test_unserved_streams_run_the_reference() -> None:
    seed = random.SystemRandom().randrange(2**31)
    args = _inputs(seed, 3, 3, 32, torch.float32)  # 3 streams: no power of two
    assert torch.equal(mhc_expand_triton(*args), reference(*args)), f"seed={seed}"
