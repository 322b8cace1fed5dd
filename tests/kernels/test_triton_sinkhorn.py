"""The one-launch Triton Sinkhorn against ``graphs/mhc.py::sinkhorn``: fresh random logits every
run (the seed is in the failure message), n = 1..16, odd token counts, leading dims, strided
logits, several iteration counts, sizes the kernel leaves to the reference, and an output
poisoned with NaN so that an unwritten element fails. On CUDA, also bf16 logits, model sizes
and the op's dispatch."""

from __future__ import annotations

import pytest
import torch

from deepinfer_fx.graphs.mhc import sinkhorn
from deepinfer_fx.kernels.triton.sinkhorn import mhc_sinkhorn_triton

CUDA = torch.cuda.is_available()
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])
EPS = 1e-6

# (leading shape, n, layout): "transpose" swaps the matrix dims, "slice" takes every other
# matrix of a larger tensor (token stride 2 n^2).
CASES = [
    ((1,), 4, "contiguous"),
    ((7,), 4, "contiguous"),
    ((3, 5), 4, "contiguous"),
    ((200,), 4, "contiguous"),  # several programs, the last partly filled
    ((9,), 4, "transpose"),
    ((11,), 4, "slice"),
    ((5,), 1, "contiguous"),
    ((6,), 2, "contiguous"),
    ((3,), 8, "transpose"),
    ((5,), 16, "contiguous"),
    ((0,), 4, "contiguous"),
    ((3,), 3, "contiguous"),  # not a power of two: the reference
    ((2,), 32, "contiguous"),  # too large: the reference
]
CUDA_CASES = [((1,), 4, "contiguous"), ((64,), 4, "contiguous"), ((8192,), 4, "slice"), ((1000,), 16, "transpose")]


def _logits(
    lead: tuple[int, ...], n: int, layout: str, dtype: torch.dtype, device: str, seed: int, scale: float
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, n, n, generator=g) * scale).to(device=device, dtype=dtype)
    if layout == "transpose":
        return x.transpose(-1, -2)
    if layout == "slice":
        return torch.stack([x, torch.zeros_like(x)], len(lead)).flatten(len(lead) - 1, len(lead))[..., ::2, :, :]
    return x


def _run(lead: tuple[int, ...], n: int, layout: str, dtype: torch.dtype, iters: int, scale: float, device: str) -> None:
    seed = torch.seed() % 2**31
    logits = _logits(lead, n, layout, dtype, device, seed, scale)
    why = f"seed={seed} lead={lead} n={n} layout={layout} dtype={dtype} iters={iters} scale={scale}"
    out = torch.full(logits.shape, float("nan"), device=device)
    got = mhc_sinkhorn_triton(logits, EPS, iters, out=out)
    assert got is out, why
    # Entries range over [eps-ish, 1]; the absolute floor covers the tiny ones.
    torch.testing.assert_close(out, sinkhorn(logits, EPS, iters), rtol=1e-5, atol=1e-6, msg=lambda m: f"{why}\n{m}")
    assert torch.equal(mhc_sinkhorn_triton(logits, EPS, iters), out), why


@pytest.mark.parametrize("iters", [1, 20])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,n,layout", CASES)
def test_sinkhorn_matches_reference(
    lead: tuple[int, ...], n: int, layout: str, dtype: torch.dtype, iters: int, device: str
) -> None:
    _run(lead, n, layout, dtype, iters, 2.0, device)


@pytest.mark.parametrize("scale", [0.1, 8.0])
@pytest.mark.parametrize("iters", [3, 20])
def test_sinkhorn_flat_and_sharp_logits(scale: float, iters: int, device: str) -> None:
    """Near-uniform and near-one-hot softmaxes (the latter leave entries at the eps floor)."""
    _run((37,), 4, "contiguous", torch.float32, iters, scale, device)


@pytest.mark.skipif(not CUDA, reason="model-sized inputs need a GPU")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,n,layout", CUDA_CASES)
def test_sinkhorn_model_sizes(lead: tuple[int, ...], n: int, layout: str, dtype: torch.dtype, device: str) -> None:
    _run(lead, n, layout, dtype, 20, 2.0, device)


@pytest.mark.skipif(not CUDA, reason="the CUDA registration only dispatches for CUDA tensors")
def test_sinkhorn_op_dispatches_to_one_launch() -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key("deepinfer::mhc_sinkhorn", "CUDA")
    seed = torch.seed() % 2**31
    logits = _logits((64,), 4, "contiguous", torch.float32, "cuda", seed, 2.0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        got = torch.ops.deepinfer.mhc_sinkhorn(logits, EPS, 20)
        torch.cuda.synchronize()
    launches = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert launches and all("_sinkhorn_kernel" in name for name in launches), f"seed={seed}: {launches}"
    assert torch.equal(got, mhc_sinkhorn_triton(logits, EPS, 20)), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.mhc_sinkhorn.default, (logits, EPS, 20))
