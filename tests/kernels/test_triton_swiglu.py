"""The Triton SwiGLU-with-clamp against ``graphs/moe.py::swiglu_act``: fresh random inputs every
run (the seed is in the failure message), with and without clamps, odd row counts, leading dims,
gate and up as the two halves of one fused projection, transposed inputs, broadcasting (left to
the reference), and an output poisoned with NaN so that an unwritten element fails. On CUDA,
also bf16 inputs and the op's dispatch."""

from __future__ import annotations

import pytest
import torch

from deepinfer_fx.graphs.moe import swiglu_act
from deepinfer_fx.kernels.triton.swiglu import swiglu_clamp_triton

CUDA = torch.cuda.is_available()
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])

# (shape, layout): "fused" takes gate and up as the halves of one [..., 2I] tensor,
# "transpose" hands in permuted tensors.
CASES = [
    ((1, 8), "contiguous"),
    ((7, 96), "contiguous"),  # several rows per program, one of them padding
    ((300, 16), "contiguous"),  # several row blocks, the last partly filled
    ((3, 5, 2500), "contiguous"),  # two column blocks, the second partly filled
    ((9, 256), "fused"),
    ((40, 24), "transpose"),
    ((0, 32), "contiguous"),
    ((5, 0), "contiguous"),
]
CUDA_CASES = [((64 * 6, 2048), "contiguous"), ((8192, 3072), "fused"), ((1, 18432), "contiguous")]


def _inputs(
    shape: tuple[int, ...], layout: str, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Scaled up so that the clamps bite and silu sees its saturated tails.
    pair = (torch.randn(2, *shape, generator=g) * 4).to(device=device, dtype=dtype)
    if layout == "fused":
        return pair.movedim(0, -2).flatten(-2).chunk(2, dim=-1)
    if layout == "transpose":
        return tuple(t.movedim(-1, 0).contiguous().movedim(0, -1) for t in pair)
    return pair[0], pair[1]


def _check(gate: torch.Tensor, up: torch.Tensor, limit: float, why: str) -> None:
    shape = torch.broadcast_shapes(gate.shape, up.shape)
    out = torch.full(shape, float("nan"), device=gate.device)
    got = swiglu_clamp_triton(gate, up, limit, out=out)
    assert got is out and out.dtype == torch.float32, why
    # The math is fp32 whatever the input dtype, so fp32 tolerances hold for bf16 inputs too.
    ref = swiglu_act(gate, up, limit)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{why}\n{m}")
    assert torch.equal(swiglu_clamp_triton(gate, up, limit), out), why


def _run(shape: tuple[int, ...], layout: str, dtype: torch.dtype, limit: float, device: str) -> None:
    seed = torch.seed() % 2**31
    gate, up = _inputs(shape, layout, dtype, device, seed)
    _check(gate, up, limit, f"seed={seed} shape={shape} layout={layout} dtype={dtype} limit={limit}")


@pytest.mark.parametrize("limit", [0.0, 2.5, 7.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout", CASES)
def test_swiglu_clamp_matches_reference(
    shape: tuple[int, ...], layout: str, dtype: torch.dtype, limit: float, device: str
) -> None:
    _run(shape, layout, dtype, limit, device)


@pytest.mark.skipif(not CUDA, reason="model-sized inputs need a GPU")
@pytest.mark.parametrize("limit", [0.0, 10.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout", CUDA_CASES)
def test_swiglu_clamp_model_sizes(
    shape: tuple[int, ...], layout: str, dtype: torch.dtype, limit: float, device: str
) -> None:
    _run(shape, layout, dtype, limit, device)


# The interpreter computes with numpy, which warns about the inf - inf it is asked for.
@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_swiglu_clamp_nan_and_inf_pass_through(device: str) -> None:
    """torch.clamp keeps NaN; a min/max based kernel could turn it into the limit."""
    special = torch.tensor([float("nan"), float("inf"), float("-inf"), 0.0, -30.0, 30.0], device=device)
    gate, up = special.repeat(6)[None], special.repeat_interleave(6)[None]
    for limit in (0.0, 2.5):
        out = swiglu_clamp_triton(gate, up, limit)
        torch.testing.assert_close(
            out, swiglu_act(gate, up, limit), rtol=1e-5, atol=1e-6, equal_nan=True, msg=lambda m: f"limit={limit}\n{m}"
        )


def test_swiglu_clamp_broadcast_goes_to_reference(device: str) -> None:
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    gate, up = torch.randn(5, 12, generator=g).to(device), torch.randn(1, 12, generator=g).to(device)
    _check(gate, up, 1.5, f"seed={seed} broadcast")


@pytest.mark.skipif(not CUDA, reason="the CUDA registration only dispatches for CUDA tensors")
@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_clamp_op_dispatches_to_triton(dtype: torch.dtype) -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key("deepinfer::swiglu_clamp", "CUDA")
    seed = torch.seed() % 2**31
    gate, up = _inputs((17, 2048), "contiguous", dtype, "cuda", seed)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        got = torch.ops.deepinfer.swiglu_clamp(gate, up, 10.0)
        torch.cuda.synchronize()
    assert any("_swiglu_clamp_kernel" in e.name for e in prof.events()), (
        f"seed={seed}: the op did not launch the kernel"
    )
    assert torch.equal(got, swiglu_clamp_triton(gate, up, 10.0)), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.swiglu_clamp.default, (gate, up, 10.0))
