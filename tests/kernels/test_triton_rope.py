"""The Triton rotary embedding (in place) against ``graphs/rope.py::apply_rope``: fresh random
inputs every run (the seed is in the failure message), forward and inverse, the three layouts the
model rotates (positions x heads, chunks x rows x heads, no middle dims), widths that are not
powers of two, row counts that leave the last program partly filled, and strided inputs (rows
further apart than d, whose gaps must stay as they were, and rows that do not flatten, rotated
through a copy). The channels before the tail must come back bit for bit. On CUDA, also the
model's sizes, the op's dispatch and a CUDA-graph replay. Everywhere ptxas is, the kernel is
compiled for sm_90 offline and must not spill."""

from __future__ import annotations

from pathlib import Path


import pytest
import torch

from sm90_ptxas import PTXAS, compile_in_subprocess, compile_sm90, ptxas_report

from deepinfer_fx.graphs.rope import _inv_freq, apply_rope, cos_sin
from deepinfer_fx.kernels.triton.rope import _rope_kernel, launch_config, rope_triton_

CUDA = torch.cuda.is_available()

# (x shape, number of leading dims that index positions, rope dim)
CASES = [
    ((37, 5, 96), 1, 32),  # d not a power of two; 185 rows of 32 per program: the last one partial
    ((3, 7, 4, 128), 2, 64),  # [C, L, H, d] against [C, L] tables
    ((50, 512), 1, 64),  # no middle dims (the window latent)
    ((11, 2, 100), 1, 40),  # 20 pairs: a masked pair block
    ((9, 3, 64), 1, 64),  # the whole row rotates, nothing to copy
]
# Sizes of the model (query heads / attention output, window latent, indexer query, a prefill
# group); too slow for the interpreter.
CUDA_CASES = [((4096, 64, 512), 1, 64), ((4096, 512), 1, 64), ((4096, 64, 128), 1, 64), ((2, 2048, 64, 512), 2, 64)]


def _seed() -> int:
    return torch.seed() % 2**31


def _inputs(
    shape: tuple[int, ...], lead: int, rd: int, dtype: torch.dtype, device: str, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(device=device, dtype=dtype)
    positions = torch.randint(0, 200_000, shape[:lead], generator=g)
    cos, sin = cos_sin.reference(positions, _inv_freq(rd, 10000.0, None))  # type: ignore[attr-defined]
    return x, cos.to(device), sin.to(device)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, why: str) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape, why
    if ref.dtype == torch.bfloat16:
        # One bf16 ulp of the reference: the fp32 values agree to ~1e-7 (an FMA on the GPU), but
        # a rounding may not, and the interpreter rounds fp32 -> bf16 towards zero. Where
        # x1*cos - x2*sin cancels to near zero, that fp32 difference is relative to the inputs,
        # not to the tiny result: allow 2^-20 of the row's largest input on top (the H200 found
        # 15 such elements in 134M).
        _, exp = torch.frexp(ref.float())
        ulp = torch.ldexp(torch.ones_like(ref, dtype=torch.float32), exp - 8)
        cancel = x.float().abs().amax(-1, keepdim=True) * 2.0**-20
        bad = ~((out.float() - ref.float()).abs() <= ulp + cancel)
        assert not bad.any(), f"{why}: {int(bad.sum())} elements off by more than one bf16 ulp"
    else:
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, msg=lambda m: f"{why}\n{m}")


def _run(
    shape: tuple[int, ...],
    lead: int,
    rd: int,
    dtype: torch.dtype,
    inverse: bool,
    device: str,
    layout: str = "contiguous",
) -> None:
    seed = _seed()
    x, cos, sin = _inputs(shape, lead, rd, dtype, device, seed)
    base = x
    if layout == "slice":  # rows further apart than d: rotated in place with their stride
        base = torch.cat([x, torch.full_like(x[..., :24], float("nan"))], -1)
        x = base[..., : shape[-1]]
    elif layout == "transpose":  # rows that do not flatten to one stride: rotated through a copy
        x = x.transpose(0, 1).contiguous().transpose(0, 1)
    before = x.clone()
    assert rope_triton_(x, cos, sin, inverse) is None
    why = f"seed={seed} shape={shape} rd={rd} dtype={dtype} inverse={inverse} layout={layout}"
    _assert_matches(x, apply_rope.reference(before, cos, sin, inverse), before, why)  # type: ignore[attr-defined]
    assert torch.equal(x[..., :-rd], before[..., :-rd]), f"{why}: a channel before the tail moved"
    assert base[..., shape[-1] :].isnan().all(), f"{why}: wrote between rows"


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("shape,lead,rd", CASES)
def test_rope_matches_reference(shape: tuple[int, ...], lead: int, rd: int, inverse: bool, device: str) -> None:
    _run(shape, lead, rd, torch.float32, inverse, device)


@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
def test_rope_bf16(inverse: bool, device: str) -> None:
    _run((21, 3, 96), 1, 32, torch.bfloat16, inverse, device)


@pytest.mark.parametrize("layout", ["slice", "transpose"])
def test_rope_strided_input(layout: str, device: str) -> None:
    _run((13, 4, 96), 1, 32, torch.float32, True, device, layout)


def test_rope_refuses_tables_of_other_positions(device: str) -> None:
    x = torch.randn(6, 2, 64, device=device)
    cos = torch.randn(1, 16, device=device)  # broadcasts in apply_rope, but not the op's layout
    with pytest.raises(ValueError, match="rope"):
        rope_triton_(x, cos, cos, False)


@pytest.mark.skipif(not CUDA, reason="model-sized tensors need a GPU")
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,lead,rd", CUDA_CASES)
def test_rope_model_sizes(shape: tuple[int, ...], lead: int, rd: int, dtype: torch.dtype, inverse: bool) -> None:
    _run(shape, lead, rd, dtype, inverse, "cuda")


@pytest.mark.skipif(not CUDA, reason="the CUDA registration only dispatches for CUDA tensors")
def test_rope_op_dispatches_to_triton() -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key("deepinfer::rope_", "CUDA")
    seed = _seed()
    x, cos, sin = _inputs((1024, 64, 512), 1, 64, torch.bfloat16, "cuda", seed)
    got = x.clone()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        torch.ops.deepinfer.rope_(got, cos, sin, True)
        torch.cuda.synchronize()
    assert any("_rope_kernel" in e.name for e in prof.events()), f"seed={seed}: the op did not launch the kernel"
    rope_triton_(x, cos, sin, True)
    assert torch.equal(got, x), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.rope_.default, (x[:64].clone(), cos[:64], sin[:64], False))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_rope_cuda_graph_replay() -> None:
    """Captured once, replayed on new values written into the same buffers."""
    seed = _seed()
    x, cos, sin = _inputs((4096, 64, 512), 1, 64, torch.bfloat16, "cuda", seed)
    torch.ops.deepinfer.rope_(x, cos, sin, False)  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.deepinfer.rope_(x, cos, sin, False)
    for step in range(2):
        new = _inputs((4096, 64, 512), 1, 64, torch.bfloat16, "cuda", seed + 1 + step)
        for buf, value in zip((x, cos, sin), new):
            buf.copy_(value)
        graph.replay()
        torch.cuda.synchronize()
        _assert_matches(x, apply_rope.reference(new[0], cos, sin, False), new[0], f"seed={seed} replay {step}")  # type: ignore[attr-defined]


# --- offline compile for the H200 --------------------------------------------------------------

# Compiled in a fresh interpreter (``sm90_ptxas.compile_in_subprocess``): in this process
# Triton's JIT is the interpreter, and compiling next to interpreted kernels of other test
# modules failed depending on which worker ran what.
SM90_CASES = [(d, dtype, inverse) for d in (512, 128) for dtype in ("bf16", "fp32") for inverse in (False, True)]


def _compile_for_sm90(out_dir: str) -> None:
    """PTX for each case, with the launcher's configuration for 4096 tokens and the pointer and
    stride alignment Triton specialises on at a real launch; shared memory in a side file."""
    for d, dtype, inverse in SM90_CASES:
        cfg = launch_config(4096 * 64, 32)
        num_warps = cfg.pop("num_warps")
        constants = {"D": d, "HALF": 32, "INVERSE": inverse, "PDL": True, **cfg}
        kernel = compile_sm90(_rope_kernel, {"x_ptr": f"*{dtype}"}, constants, ["stride_x"], num_warps=num_warps)
        Path(out_dir, f"{d}-{dtype}-{inverse}.ptx").write_text(kernel.asm["ptx"])
        Path(out_dir, f"{d}-{dtype}-{inverse}.shared").write_text(str(kernel.metadata.shared))


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_triton_rope", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("d,dtype,inverse", SM90_CASES)
def test_rope_compiles_for_sm90_without_spills(d: int, dtype: str, inverse: bool, sm90_ptx: Path) -> None:
    """Triton -> PTX for sm_90 needs no device; ptxas then reports registers and spills."""
    ptx = (sm90_ptx / f"{d}-{dtype}-{inverse}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 64, log
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, "tails move in 16-byte vectors"
    assert "griddepcontrol.wait" in ptx and "griddepcontrol.launch_dependents" in ptx, "PDL (kernels/triton/pdl.py)"
    if dtype == "bf16":  # the served dtype: pairs and tables meet in registers, with no shuffle
        # (fp32 at d=128 loads its tables 4 wide and regroups them through 4 KiB of shared memory)
        assert (sm90_ptx / f"{d}-{dtype}-{inverse}.shared").read_text() == "0" and "bar.sync" not in ptx
