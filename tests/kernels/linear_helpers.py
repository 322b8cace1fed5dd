"""Shared pieces of the skinny-GEMM kernel tests (``test_triton_linear*.py``): fresh seeds,
operands, the accuracy bound against the exact product, the P8 weight shapes."""

from __future__ import annotations

import pytest
import torch
import triton

from deepinfer_fx.graphs.norm import project
from deepinfer_fx.kernels.triton import linear
from deepinfer_fx.kernels.triton.linear import Tiles

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a GPU")
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])
reference = project.reference

# The P8 projections at decode: wq_b, wo_b, wq_a, wkv, and a router-sized one.
MODEL_WEIGHTS = [(32768, 1024), (4096, 8192), (1024, 4096), (512, 4096), (256, 4096)]
# Groups of projections of one input (passes/grouping.py): wq_a + wkv; a CSA layer's fp32
# projections of x (compressor wkv / wgate, the indexer's compressor wkv / wgate, weights_proj);
# wq_b + the indexer's wq_b.
GROUP_WEIGHTS = [((1024, 512), 4096), ((1024, 1024, 256, 256, 64), 4096), ((32768, 8192), 1024)]


def fresh_seed() -> int:
    return torch.seed() % 2**31


def operands(seed: int, m: int, n: int, k: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * k**-0.5
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def live_counters(device: torch.device) -> torch.Tensor:
    return linear._COUNTERS[device][-1]


def assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, out_fp32: bool, why: str) -> None:
    """Within fp32 accumulation error of the exact product (bounded by ``|x| @ |w|.T``), plus
    one rounding to bf16 where the result is bf16."""
    want = x.double() @ w.double().T
    assert got.shape == want.shape and got.dtype == (torch.float32 if out_fp32 else x.dtype), why
    bound = 2e-5 * (x.double().abs() @ w.double().abs().T)
    if got.dtype == torch.bfloat16:
        _, exp = torch.frexp(want)
        bound = bound + torch.ldexp(torch.ones_like(want), exp - 8)  # one bf16 ulp
    bad = ~((got.double() - want).abs() <= bound)
    assert not bad.any(), f"{why}: {int(bad.sum())} of {bad.numel()} elements off"


def split_bounds(k: int, t: Tiles) -> list[int]:
    """Where the launcher cuts [0, K): equal runs of whole k tiles, the last one short."""
    k_split = triton.cdiv(triton.cdiv(k, t.split), t.bk) * t.bk
    return [*range(0, k, k_split), k]
