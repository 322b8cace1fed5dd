"""The Triton skinny GEMM (``kernels/triton/linear.py``) against ``graphs/norm.py::project``.

On CPU the launcher runs under Triton's interpreter with fp32 operands (its bf16 ``tl.dot`` is
not usable) and small shapes; on a GPU the same cases also run bf16, plus the attention
projections of the P8 model, for accuracy and for batch invariance: a row's result must be the
same bits alone or inside any batch. Every case draws a fresh seed and names it on failure.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_fx.graphs.norm import project
from deepinfer_fx.kernels.triton.linear import _MAX_SPLIT, Tiles, choose_tiles, skinny_linear_triton

CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not CUDA, reason="needs a GPU")
DTYPES = [torch.float32] + ([torch.bfloat16] if CUDA else [])
reference = project.reference

# (M, N, K, tiles): None is the shape rule; explicit tiles reach the split-K and masked paths
# on shapes the interpreter can afford.
CASES = [
    (1, 96, 64, None),
    (3, 96, 64, None),
    (16, 96, 64, None),
    (16, 96, 160, Tiles(32, 32, 2, 4, 3)),  # two splits, the second masked past K
    (20, 80, 48, Tiles(32, 16, 3, 4, 3)),  # two row blocks, N not a multiple of the column tile
    (5, 64, 256, Tiles(64, 32, 4, 4, 4)),  # four full splits
    (2, 48, 24, None),  # K below one k tile
]
# The P8 projections at decode: wq_b, wo_b, wq_a, wkv, and a router-sized one.
MODEL_WEIGHTS = [(32768, 1024), (4096, 8192), (1024, 4096), (512, 4096), (256, 4096)]


def _seed() -> int:
    return torch.seed() % 2**31


def _operands(seed: int, m: int, n: int, k: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) * k**-0.5
    return x.to(device=device, dtype=dtype), w.to(device=device, dtype=dtype)


def _assert_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, out_fp32: bool, why: str) -> None:
    """Within fp32 accumulation error of the exact product (bounded by ``|x| @ |w|.T``), plus
    one rounding to bf16 where the result is bf16."""
    want = (x.double() @ w.double().T)
    assert got.shape == want.shape and got.dtype == (torch.float32 if out_fp32 else x.dtype), why
    bound = 2e-5 * (x.double().abs() @ w.double().abs().T)
    if got.dtype == torch.bfloat16:
        _, exp = torch.frexp(want)
        bound = bound + torch.ldexp(torch.ones_like(want), exp - 8)  # one bf16 ulp
    bad = ~((got.double() - want).abs() <= bound)
    assert not bad.any(), f"{why}: {int(bad.sum())} of {bad.numel()} elements off"


@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,tiles", CASES)
def test_matches_reference(m: int, n: int, k: int, tiles: Tiles | None, dtype: torch.dtype, out_fp32: bool, device: str) -> None:
    seed = _seed()
    x, w = _operands(seed, m, n, k, dtype, device)
    got = skinny_linear_triton(x, w, out_fp32, tiles)
    why = f"seed={seed} M={m} N={n} K={k} tiles={tiles} {dtype} out_fp32={out_fp32}"
    _assert_close(got, x, w, out_fp32, why)
    want = reference(x, w, out_fp32)
    assert got.dtype == want.dtype and got.shape == want.shape, why


def test_strided_operands(device: str) -> None:
    """Rows of a wider buffer and a weight stored transposed: strides are honoured."""
    seed = _seed()
    x, w = _operands(seed, 3, 48, 64, torch.float32, device)
    wide = torch.zeros(3, 80, device=device)
    wide[:, 8:72] = x
    w_t = w.T.contiguous().T  # [N, K] with stride (1, N)
    got = skinny_linear_triton(wide[:, 8:72], w_t, False, Tiles(16, 32, 2, 4, 3))
    _assert_close(got, x, w, False, f"seed={seed}")


def test_empty_and_mismatched(device: str) -> None:
    w = torch.randn(32, 16, device=device)
    assert skinny_linear_triton(torch.randn(0, 16, device=device), w, True).shape == (0, 32)
    with pytest.raises(ValueError, match="share a dtype"):
        skinny_linear_triton(torch.randn(2, 16, device=device, dtype=torch.float64), w, False)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        skinny_linear_triton(torch.randn(2, 8, device=device), w, False)


def test_shape_rule_fills_the_gpu_without_tiny_splits() -> None:
    """At model widths every weight gets ~two programs per SM, or the most splits that keep at
    least two k tiles each; every split's k range is whole k tiles."""
    for n, k in [*MODEL_WEIGHTS, (129280, 4096), (96, 64)]:
        t = choose_tiles(n, k)
        programs = -(-n // t.bn) * t.split
        assert t.split == 1 or k // t.split >= 2 * t.bk, (n, k, t)
        assert programs >= 256 or t.split == _MAX_SPLIT or k < 4 * t.split * t.bk, (n, k, t)


def test_op_reference_on_cpu() -> None:
    """On CPU the op is the reference math; it traces under fake tensors with the same metadata."""
    seed = _seed()
    for dtype in (torch.float32, torch.bfloat16):
        x, w = _operands(seed, 4, 32, 48, dtype, "cpu")
        for out_fp32 in (False, True):
            got = torch.ops.deepinfer.skinny_linear(x, w, out_fp32)
            assert torch.equal(got, reference(x, w, out_fp32)), f"seed={seed} {dtype} {out_fp32}"
            torch.library.opcheck(torch.ops.deepinfer.skinny_linear.default, (x, w, out_fp32))


# --- GPU: model sizes ----------------------------------------------------------------------


@cuda_only
@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("n,k", MODEL_WEIGHTS)
def test_model_sizes_match_reference(n: int, k: int, out_fp32: bool) -> None:
    seed = _seed()
    for m in (1, 8, 64):
        x, w = _operands(seed + m, m, n, k, torch.bfloat16, "cuda")
        got = skinny_linear_triton(x, w, out_fp32)
        _assert_close(got, x, w, out_fp32, f"seed={seed + m} M={m} N={n} K={k} out_fp32={out_fp32}")


@cuda_only
@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("n,k", [*MODEL_WEIGHTS, (129280, 4096)])
def test_batch_invariant(n: int, k: int, out_fp32: bool) -> None:
    """Row r alone == row r inside M = 8, 16, 64 == row r beside other rows, bitwise."""
    seed = _seed()
    x, w = _operands(seed, 64, n, k, torch.bfloat16, "cuda")
    full = skinny_linear_triton(x, w, out_fp32)
    other = x.clone()
    other[1:] = torch.randn_like(other[1:])
    for r in (0, 5, 15):
        alone = skinny_linear_triton(x[r : r + 1], w, out_fp32)
        for m in (8, 16, 64):
            if r < m:
                inside = skinny_linear_triton(x[:m], w, out_fp32)
                assert torch.equal(alone[0], inside[r]), f"seed={seed} N={n} K={k} row {r} of M={m}"
        assert torch.equal(alone[0], full[r]), f"seed={seed} N={n} K={k} row {r}"
    assert torch.equal(skinny_linear_triton(other, w, out_fp32)[0], full[0]), f"seed={seed}: other rows changed row 0"


@cuda_only
def test_op_dispatches_to_triton() -> None:
    assert torch._C._dispatch_has_kernel_for_dispatch_key("deepinfer::skinny_linear", "CUDA")
    seed = _seed()
    x, w = _operands(seed, 8, 4096, 8192, torch.bfloat16, "cuda")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        got = torch.ops.deepinfer.skinny_linear(x, w, True)
        torch.cuda.synchronize()
    assert any("_skinny_kernel" in e.name for e in prof.events()), f"seed={seed}: the op did not launch the kernel"
    assert torch.equal(got, skinny_linear_triton(x, w, True)), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.skinny_linear.default, (x, w, False))
