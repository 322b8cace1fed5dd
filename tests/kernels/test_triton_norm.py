"""The Triton RMSNorm against ``graphs/norm.py::rms_norm``: fresh random inputs every run (the
seed is in the failure message), odd row counts, leading dims, strided inputs, every weight
kind, both the in-register and the chunked path, and an output poisoned with NaN so that an
element the kernel forgets to write fails. On CUDA, also bf16 and the op's dispatch."""

from __future__ import annotations

import pytest
import torch

from deepinfer_fx.graphs.norm import rms_norm
from deepinfer_fx.kernels.triton.norm import _MAX_FUSED, rms_norm_triton

CUDA = torch.cuda.is_available()
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])

# (shape, layout): "slice" views the first D columns of a wider tensor (row stride > D),
# "transpose" hands in a permuted tensor, "step" one with column stride 2.
CASES = [
    ((1, 64), "contiguous"),
    ((7, 96), "contiguous"),  # several rows per program, one of them padding
    ((300, 32), "contiguous"),  # several programs, the last partly filled
    ((2, 3, 512), "contiguous"),
    ((5, 4096), "slice"),
    ((3, 1000), "transpose"),
    ((4, 5, 200), "step"),
    ((3, 16384), "contiguous"),  # the widest row kept in registers (4 x 4096, the mHC input)
    ((2, _MAX_FUSED + 1000), "contiguous"),  # the chunked two-pass path
    ((0, 64), "contiguous"),
    ((4, 0), "contiguous"),
]
# Sizes of a real model; too slow for the interpreter.
CUDA_CASES = [((1000, 4096), "contiguous"), ((257, 7168), "slice"), ((64 * 64, 512), "contiguous"), ((33, 65536), "contiguous")]


def _inputs(shape: tuple[int, ...], layout: str, dtype: torch.dtype, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    *lead, d = shape
    # Rows of different scales, so the statistics matter.
    scale = torch.rand(*lead, 1, generator=g) * 4 + 0.1
    x = (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)
    if layout == "slice":
        buf = torch.zeros(*lead, d + 24, dtype=dtype, device=device)
        buf[..., :d] = x
        return buf[..., :d]
    if layout == "transpose":
        return x.movedim(-1, 0).contiguous().movedim(0, -1)
    if layout == "step":
        buf = torch.zeros(*lead, 2 * d, dtype=dtype, device=device)
        buf[..., ::2] = x
        return buf[..., ::2]
    return x


def _weight(kind: str, d: int, device: str, seed: int) -> torch.Tensor | None:
    if kind == "none":
        return None
    w = 1 + 0.1 * torch.randn(d, generator=torch.Generator().manual_seed(seed + 1))
    return w.to(device=device, dtype=torch.bfloat16 if kind == "bf16" else torch.float32)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, why: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, why
    if ref.dtype == torch.bfloat16:
        # One bf16 ulp of the reference: the fp32 values agree to ~1e-7, their roundings may not.
        _, exp = torch.frexp(ref.float())
        ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32), exp - 8)
        bad = ~((out.float() - ref.float()).abs() <= ulp)
        assert not bad.any(), f"{why}: {int(bad.sum())} elements off by more than one bf16 ulp"
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{why}\n{m}")


def _run(shape: tuple[int, ...], layout: str, dtype: torch.dtype, weight: str, device: str) -> None:
    seed = torch.seed() % 2**31
    x = _inputs(shape, layout, dtype, device, seed)
    w = _weight(weight, shape[-1], device, seed)
    eps = 1e-6
    out = torch.full_like(x, float("nan"))  # full_like keeps x's layout, as the op's fake does
    got = rms_norm_triton(x, w, eps, out=out)
    why = f"seed={seed} shape={shape} layout={layout} dtype={dtype} weight={weight}"
    assert got is out, why
    _assert_matches(out, rms_norm(x, w, eps), why)
    # Without out= the launcher allocates the op's layout itself.
    fresh = rms_norm_triton(x, w, eps)
    assert fresh.stride() == torch.empty_like(x).stride(), why
    assert torch.equal(fresh, out), why


@pytest.mark.parametrize("weight", ["none", "fp32", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout", CASES)
def test_rms_norm_matches_reference(shape: tuple[int, ...], layout: str, dtype: torch.dtype, weight: str, device: str) -> None:
    _run(shape, layout, dtype, weight, device)


@pytest.mark.skipif(not CUDA, reason="model-sized rows need a GPU")
@pytest.mark.parametrize("weight", ["none", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout", CUDA_CASES)
def test_rms_norm_model_sizes(shape: tuple[int, ...], layout: str, dtype: torch.dtype, weight: str, device: str) -> None:
    _run(shape, layout, dtype, weight, device)


def test_rms_norm_odd_weight_goes_to_reference(device: str) -> None:
    """A weight that is not ``[D]`` (here ``[rows, D]``) broadcasts: the launcher defers."""
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(3, 40, generator=g).to(device), torch.randn(3, 40, generator=g).to(device)
    out = torch.full_like(x, float("nan"))
    rms_norm_triton(x, w, 1e-6, out=out)
    torch.testing.assert_close(out, rms_norm(x, w, 1e-6), rtol=0, atol=0, msg=lambda m: f"seed={seed}\n{m}")


@pytest.mark.skipif(not CUDA, reason="the CUDA registration only dispatches for CUDA tensors")
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_op_dispatches_to_triton(dtype: torch.dtype) -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key("deepinfer::rms_norm", "CUDA")
    seed = torch.seed() % 2**31
    x = _inputs((9, 4096), "contiguous", dtype, "cuda", seed)
    w = _weight("bf16", 4096, "cuda", seed)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        got = torch.ops.deepinfer.rms_norm(x, w, 1e-6)
        torch.cuda.synchronize()
    assert any("_rms_norm_kernel" in e.name for e in prof.events()), f"seed={seed}: the op did not launch the kernel"
    assert torch.equal(got, rms_norm_triton(x, w, 1e-6)), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.rms_norm.default, (x, w, 1e-6))
