"""The Triton RMSNorm against ``graphs/norm.py::rms_norm``: fresh random inputs every run (the
seed is in the failure message), odd row counts, leading dims, strided inputs, every weight
kind, both the in-register and the chunked path, and an output poisoned with NaN so that an
element the kernel forgets to write fails. On CUDA, also bf16 and the op's dispatch.
The same kernel with rope tables against ``graphs/rope.py::norm_rope``; and, offline, the kernel
compiled for the H200 (sm_90) at the model's widths."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from sm90_ptxas import PTXAS, compile_in_subprocess, compile_sm90, ptxas_report

from deepinfer_fx.graphs.norm import rms_norm
from deepinfer_fx.graphs.rope import norm_rope
from deepinfer_fx.kernels.triton.norm import _MAX_FUSED, _launch_config, _rms_norm_kernel, rms_norm_triton

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
CUDA_CASES = [
    ((1000, 4096), "contiguous"),
    ((257, 7168), "slice"),
    ((64 * 64, 512), "contiguous"),
    ((33, 65536), "contiguous"),
]


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


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    _, exp = torch.frexp(v.float())
    return torch.ldexp(torch.ones_like(v, dtype=torch.float32), exp - 8)


def _assert_matches(out: torch.Tensor, ref: torch.Tensor, why: str, rotated: torch.Tensor | None = None) -> None:
    """bf16: within one ulp of the reference (the fp32 values agree to ~1e-7, their roundings may
    not). ``rotated``: the magnitude of each element's rotated pair (0 where nothing rotates);
    the normed values entering the rotation may already differ by their one ulp, which the
    rotation carries into the result at up to sqrt(2) ulps of the pair's magnitude, whatever
    the result's own size (a * cos - b * sin can cancel)."""
    assert out.dtype == ref.dtype and out.shape == ref.shape, why
    if ref.dtype == torch.bfloat16:
        tol = _bf16_ulp(ref) + (0 if rotated is None else 1.5 * _bf16_ulp(rotated) * (rotated > 0))
        bad = ~((out.float() - ref.float()).abs() <= tol)
        assert not bad.any(), (
            f"{why}: {int(bad.sum())} elements off by more than one bf16 ulp (of the rotated pairs too)"
        )
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
def test_rms_norm_matches_reference(
    shape: tuple[int, ...], layout: str, dtype: torch.dtype, weight: str, device: str
) -> None:
    _run(shape, layout, dtype, weight, device)


@pytest.mark.skipif(not CUDA, reason="model-sized rows need a GPU")
@pytest.mark.parametrize("weight", ["none", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,layout", CUDA_CASES)
def test_rms_norm_model_sizes(
    shape: tuple[int, ...], layout: str, dtype: torch.dtype, weight: str, device: str
) -> None:
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


# (x shape, rotated pairs, layout): cos / sin have x's first dim (a position per row of the
# query heads [T, H, d] or the latent [T, d]); d not a power of two pads the row's block.
ROPE_CASES = [
    ((1, 4, 64), 8, "contiguous"),
    ((5, 3, 96), 16, "contiguous"),  # 48 pairs, a 64-pair block: padding pairs past the row
    ((3, 512), 32, "contiguous"),  # the latent: one row a position
    ((7, 2, 40), 20, "contiguous"),  # the whole row rotates
    ((9, 5, 64), 4, "slice"),  # rows a wider stride apart, several positions a program
    ((4, 6, 32), 8, "transpose"),
    ((0, 4, 64), 8, "contiguous"),
]
ROPE_CUDA_CASES = [((1, 64, 512), 32, "contiguous"), ((64, 64, 512), 32, "contiguous"), ((4096, 512), 32, "contiguous")]


def _run_rope(shape: tuple[int, ...], half: int, layout: str, dtype: torch.dtype, weight: str, device: str) -> None:
    seed = torch.seed() % 2**31
    x = _inputs(shape, layout, dtype, device, seed)
    w = _weight(weight, shape[-1], device, seed)
    g = torch.Generator().manual_seed(seed + 2)
    angles = torch.rand(shape[0], half, generator=g) * 100
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    why = f"seed={seed} shape={shape} half={half} layout={layout} dtype={dtype} weight={weight}"
    out = torch.full_like(x, float("nan"))
    got = rms_norm_triton(x, w, 1e-6, out, cos, sin)
    assert got is out, why
    ref = norm_rope(x, w, 1e-6, cos, sin)
    # each rotated pair's magnitude (a rotation keeps it), on both of its elements
    pairs = ref[..., -2 * half :].float().unflatten(-1, (half, 2))
    rotated = torch.zeros_like(ref, dtype=torch.float32)
    rotated[..., -2 * half :] = pairs.norm(dim=-1, keepdim=True).expand_as(pairs).flatten(-2)
    _assert_matches(out, ref, why, rotated)
    fresh = (
        torch.ops.deepinfer.rms_norm_rope(x, w, 1e-6, cos, sin)
        if device == "cuda"
        else rms_norm_triton(x, w, 1e-6, None, cos, sin)
    )
    assert fresh.stride() == torch.empty_like(x).stride(), why
    assert torch.equal(fresh, out), why


@pytest.mark.parametrize("weight", ["none", "bf16"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,half,layout", ROPE_CASES)
def test_rms_norm_rope_matches_reference(
    shape: tuple[int, ...], half: int, layout: str, dtype: torch.dtype, weight: str, device: str
) -> None:
    _run_rope(shape, half, layout, dtype, weight, device)


@pytest.mark.skipif(not CUDA, reason="model-sized rows need a GPU")
@pytest.mark.parametrize("weight", ["none", "bf16"])
@pytest.mark.parametrize("shape,half,layout", ROPE_CUDA_CASES)
def test_rms_norm_rope_model_sizes(shape: tuple[int, ...], half: int, layout: str, weight: str) -> None:
    _run_rope(shape, half, layout, torch.bfloat16, weight, "cuda")


def test_rms_norm_rope_rows_alone_equal_rows_in_a_batch(device: str) -> None:
    """A position's rows come out bit-identical whichever batch they are normed in."""
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(11, 4, 64, generator=g).to(device)
    angles = torch.rand(11, 8, generator=g) * 50
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    whole = rms_norm_triton(x, None, 1e-6, None, cos, sin)
    for t in (0, 5, 10):
        alone = rms_norm_triton(x[t : t + 1], None, 1e-6, None, cos[t : t + 1], sin[t : t + 1])
        assert torch.equal(alone[0], whole[t]), f"seed={seed} t={t}"


def test_rms_norm_rope_bad_tables_and_odd_rows(device: str) -> None:
    """Tables without x's leading dims are refused by name; an odd row goes to the reference."""
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 2, 64, generator=g).to(device)
    with pytest.raises(ValueError, match="rms_norm_rope: x \\(3, 2, 64\\) with cos \\(2, 8\\)"):
        rms_norm_triton(x, None, 1e-6, None, torch.ones(2, 8, device=device), torch.zeros(2, 8, device=device))
    with pytest.raises(ValueError, match="rd/2 <= d/2"):
        rms_norm_triton(x, None, 1e-6, None, torch.ones(3, 40, device=device), torch.zeros(3, 40, device=device))
    odd = torch.randn(3, 2, 63, generator=g).to(device)
    angles = torch.rand(3, 8, generator=g)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    torch.testing.assert_close(
        rms_norm_triton(odd, None, 1e-6, None, cos, sin),
        norm_rope(odd, None, 1e-6, cos, sin),
        rtol=0,
        atol=0,
        msg=lambda m: f"seed={seed}\n{m}",
    )


@pytest.mark.skipif(not CUDA, reason="the CUDA registration only dispatches for CUDA tensors")
def test_rms_norm_rope_op_dispatches_to_triton() -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key("deepinfer::rms_norm_rope", "CUDA")
    seed = torch.seed() % 2**31
    x = _inputs((9, 64, 512), "contiguous", torch.bfloat16, "cuda", seed)
    angles = torch.rand(9, 32, generator=torch.Generator().manual_seed(seed)) * 100
    cos, sin = angles.cos().cuda(), angles.sin().cuda()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        got = torch.ops.deepinfer.rms_norm_rope(x, None, 1e-6, cos, sin)
        torch.cuda.synchronize()
    assert any("_rms_norm_kernel" in e.name for e in prof.events()), f"seed={seed}: the op did not launch the kernel"
    assert torch.equal(got, rms_norm_triton(x, None, 1e-6, None, cos, sin)), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.rms_norm_rope.default, (x, None, 1e-6, cos, sin))


# (D, weighted, rope pairs): V4's norms at P8 widths: the hidden size (attn_norm, ffn_norm, the
# final norm), q_norm, the K = V latent and the query heads (normed and rotated), and the chunked
# path of rows wider than _MAX_FUSED.
SM90_CASES = [(4096, True, 0), (1024, True, 0), (512, True, 32), (512, False, 32), (2 * _MAX_FUSED, True, 0)]


def _sm90_name(d: int, weighted: bool, half: int) -> str:
    return f"{d}-{'w' if weighted else 'n'}-{half}"


def _compile_for_sm90(out_dir: str) -> None:
    """PTX of each case for sm_90, with the launcher's configuration and the pointer and stride
    alignment a launch specialises on (bf16 rows and weight, fp32 tables)."""
    for d, weighted, half in SM90_CASES:
        rows, block, fused, num_warps = _launch_config(d)
        constants = {
            "D": d,
            "HAS_WEIGHT": weighted,
            "ROWS": rows,
            "BLOCK": block,
            "FUSED": fused,
            "HALF": half,
            "PDL": True,
        }
        types = {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32"}
        kernel = compile_sm90(_rms_norm_kernel, types, constants, ["stride_x", "stride_out"], num_warps=num_warps)
        Path(out_dir, f"{_sm90_name(d, weighted, half)}.ptx").write_text(kernel.asm["ptx"])


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_triton_norm", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("d,weighted,half", SM90_CASES)
def test_rms_norm_compiles_for_sm90_without_spills(d: int, weighted: bool, half: int, sm90_ptx: Path) -> None:
    """No spills; PDL's wait before any load (every launch of the step chains on the one before);
    rows read and written in 16-byte vectors."""
    ptx = (sm90_ptx / f"{_sm90_name(d, weighted, half)}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 128, log
    lines = [line.strip() for line in ptx.splitlines()]
    wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait;"))
    assert not any(("ld.global" in line or "cp.async" in line) for line in lines[:wait]), "a load before the wait"
    assert "griddepcontrol.launch_dependents" in ptx, "PDL (kernels/triton/pdl.py)"
    assert "ld.global.v4" in ptx and "st.global.v4" in ptx, "rows move in 16-byte vectors"
