"""The Triton RoPE tables against ``graphs/rope.py::cos_sin``: fresh random positions every run
(the seed is in the failure message), 1-D and [C, L] positions of several int dtypes, angles up to
a million radians (where a fast cos would be off by far more than the tolerance), pair counts that
are not powers of two, plain and YaRN frequencies, and no positions at all. Both tables must be
within 2e-6 of the reference, fp32 and contiguous. On CUDA, also the op's dispatch and a CUDA-graph
replay. Everywhere ptxas is, the kernel is compiled for sm_90 offline: no spills, and no
``.approx`` cos / sin in its PTX."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sm90_ptxas import PTXAS, compile_in_subprocess, compile_sm90, ptxas_report

from deepinfer_fx.config import Yarn
from deepinfer_fx.graphs.rope import _inv_freq, cos_sin
from deepinfer_fx.kernels.triton.rope_table import _rope_table_kernel, launch_config, rope_table_triton

CUDA = torch.cuda.is_available()
YARN = Yarn(factor=16.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0)
# cos / sin of the same fp32 angle: libdevice (GPU), numpy (interpreter) and ATen differ by an ulp or two
TOL = 2e-6

FREQS = {
    "plain-32": lambda: _inv_freq(64, 10000.0, None),
    "yarn-32": lambda: _inv_freq(64, 10000.0, YARN),
    "plain-20": lambda: _inv_freq(40, 10000.0, None),  # a masked pair block
    "yarn-8": lambda: _inv_freq(16, 160000.0, YARN),
}
# (positions shape, largest position, dtype)
CASES = [
    ((300,), 200_000, torch.int64),  # 1-D; the last program partly filled
    ((3, 77), 200_000, torch.int64),  # [C, L]
    ((1000,), 1_000_000, torch.int64),  # large angles: full range reduction
    ((5, 41), 1_000_000, torch.int32),
    ((129,), 30_000, torch.int16),
    ((1,), 10, torch.int64),
]


def _seed() -> int:
    return torch.seed() % 2**31


def _check(positions: torch.Tensor, freq: torch.Tensor, got: tuple[torch.Tensor, torch.Tensor], why: str) -> None:
    ref = cos_sin.reference(positions, freq)  # type: ignore[attr-defined]
    for name, out, want in zip(("cos", "sin"), got, ref):
        assert out.dtype == torch.float32 and out.shape == want.shape and out.is_contiguous(), f"{why}: {name} layout"
        diff = (out - want).abs().max().item() if out.numel() else 0.0
        assert diff <= TOL, f"{why}: {name} off by {diff:.3g}"


def _run(shape: tuple[int, ...], high: int, dtype: torch.dtype, freq_name: str, device: str) -> None:
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, high, shape, generator=g).to(device=device, dtype=dtype)
    freq = FREQS[freq_name]().to(device)
    why = f"seed={seed} shape={shape} high={high} dtype={dtype} freq={freq_name}"
    _check(positions, freq, rope_table_triton(positions, freq), why)


@pytest.mark.parametrize("freq_name", list(FREQS))
@pytest.mark.parametrize("shape,high,dtype", CASES)
def test_rope_table_matches_reference(
    shape: tuple[int, ...], high: int, dtype: torch.dtype, freq_name: str, device: str
) -> None:
    _run(shape, high, dtype, freq_name, device)


@pytest.mark.parametrize("shape", [(0,), (2, 0)])
def test_rope_table_no_positions(shape: tuple[int, ...], device: str) -> None:
    freq = _inv_freq(64, 10000.0, None).to(device)
    cos, sin = rope_table_triton(torch.empty(shape, dtype=torch.int64, device=device), freq)
    assert cos.shape == sin.shape == (*shape, 32) and cos.dtype == sin.dtype == torch.float32


@pytest.mark.parametrize("freq", [torch.ones(2, 16), torch.arange(16)], ids=["2-D", "int"])
def test_rope_table_refuses_bad_freq(freq: torch.Tensor, device: str) -> None:
    with pytest.raises(ValueError, match="rope_table"):
        rope_table_triton(torch.arange(8, device=device), freq.to(device))


@pytest.mark.skipif(not CUDA, reason="model-sized tables need a GPU")
@pytest.mark.parametrize("freq_name", list(FREQS))
@pytest.mark.parametrize("shape", [(4096,), (2, 2048), (65536,)])
def test_rope_table_model_sizes(shape: tuple[int, ...], freq_name: str) -> None:
    _run(shape, 1_000_000, torch.int64, freq_name, "cuda")


@pytest.mark.skipif(not CUDA, reason="the CUDA registration only dispatches for CUDA tensors")
def test_rope_table_op_dispatches_to_triton() -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key("deepinfer::rope_table", "CUDA")
    seed = _seed()
    positions = torch.randint(0, 1_000_000, (4096,), generator=torch.Generator().manual_seed(seed)).cuda()
    freq = _inv_freq(64, 10000.0, YARN, torch.device("cuda"))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        got = torch.ops.deepinfer.rope_table(positions, freq)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert any("_rope_table_kernel" in n for n in names), f"seed={seed}: the op did not launch the kernel"
    assert len(names) == 1, f"seed={seed}: one launch a call, got {names}"
    _check(positions, freq, got, f"seed={seed}")
    torch.library.opcheck(torch.ops.deepinfer.rope_table.default, (positions[:64], freq))


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
def test_rope_table_cuda_graph_replay() -> None:
    """Captured once, replayed on new positions written into the same buffer."""
    seed = _seed()
    g = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 1_000_000, (4096,), generator=g).cuda()
    freq = _inv_freq(64, 10000.0, YARN, torch.device("cuda"))
    torch.ops.deepinfer.rope_table(positions, freq)  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tables = torch.ops.deepinfer.rope_table(positions, freq)
    for step in range(2):
        positions.copy_(torch.randint(0, 1_000_000, (4096,), generator=g))
        graph.replay()
        torch.cuda.synchronize()
        _check(positions, freq, tables, f"seed={seed} replay {step}")


# --- offline compile for the H200 --------------------------------------------------------------

# Compiled in a fresh interpreter (``sm90_ptxas.compile_in_subprocess``): in this process Triton's
# JIT is the interpreter. (pairs, position dtype)
SM90_CASES = [(32, "i64"), (32, "i32"), (64, "i64"), (20, "i64")]


def _compile_for_sm90(out_dir: str) -> None:
    """PTX for each case, with the launcher's configuration and options for 4096 positions and
    the pointer and size alignment Triton specialises on at a real launch."""
    for f, dtype in SM90_CASES:
        cfg = launch_config(4096, f)
        num_warps = cfg.pop("num_warps")
        # PDL on, as an H200 launch has it (pdl_args)
        kernel = compile_sm90(
            _rope_table_kernel,
            {"pos_ptr": f"*{dtype}"},
            {"F": f, "PDL": True, **cfg},
            ["n"],
            num_warps=num_warps,
            enable_fp_fusion=False,
        )
        Path(out_dir, f"{f}-{dtype}.ptx").write_text(kernel.asm["ptx"])


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_triton_rope_table", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("f,dtype", SM90_CASES)
def test_rope_table_compiles_for_sm90_without_spills(f: int, dtype: str, sm90_ptx: Path) -> None:
    """Triton -> PTX for sm_90 needs no device; ptxas then reports registers and spills."""
    ptx = (sm90_ptx / f"{f}-{dtype}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 64, log
    # accurate libdevice cos / sin (ATen's CUDA cos is the same CUDA math library code)
    assert "cos.approx" not in ptx and "sin.approx" not in ptx
    if f % 4 == 0:
        assert "st.global.v4" in ptx, "tables are written in 16-byte vectors"
    assert "griddepcontrol.wait" in ptx, "PDL (kernels/triton/pdl.py)"
