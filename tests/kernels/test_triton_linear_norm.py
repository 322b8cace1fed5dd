"""RMSNorm then decode projections in one launch (``skinny_linear_norm_triton``, the
``deepinfer::skinny_linear_norm`` op) against the norm then the projections: the exact products
of the exactly normed rows, and, where K is split (the norm then runs first, as its own launch),
the two kernels bit for bit. On CPU under Triton's interpreter (fp32) and, on a GPU, P8's
``q_norm`` -> ``wq_b`` (+ the indexer's ``wq_b``) and final norm -> head in bf16, with batch
invariance. ``test_triton_linear.py`` compiles the fused variant for sm_90."""

from __future__ import annotations

import pytest
import torch
from linear_helpers import DTYPES, cuda_only, fresh_seed

from deepinfer_fx.graphs.norm import project, rms_norm
from deepinfer_fx.kernels.triton.linear import Tiles, norm_tiles, skinny_linear_group_triton, skinny_linear_norm_triton
from deepinfer_fx.kernels.triton.norm import rms_norm_triton

EPS = 1e-6
# (M, widths of the weights, K, tiles): one split with even and ragged tiles, TMA-sized single
# weights, two row blocks; and split K (the norm's own launch first).
CASES = [
    (1, (64,), 128, Tiles(32, 32, 1, 4, 3)),
    (5, (48, 40), 96, Tiles(32, 32, 1, 4, 3)),
    (20, (32,), 64, Tiles(16, 16, 1, 4, 3, tma=True)),
    (3, (32, 16), 128, Tiles(16, 32, 2, 4, 3)),
]


def _operands(seed: int, m: int, ns: tuple[int, ...], k: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(seed)
    # Rows of unlike scales (the norm must undo them) and a norm weight away from 1.
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g).mul(8).add(0.1)
    nw = 1 + 0.5 * torch.randn(k, generator=g)
    ws = [torch.randn(n, k, generator=g) * k**-0.5 for n in ns]
    return x.to(device, dtype), nw.to(device, dtype), [w.to(device, dtype) for w in ws]


def _assert_normed_products(got: list[torch.Tensor], x: torch.Tensor, nw: torch.Tensor, ws: list[torch.Tensor],
                            out_fp32: bool, why: str) -> None:
    """Each result within rounding of the exact product of the exactly normed rows: the normed
    row's own rounding to x's dtype (one ulp of each term) plus fp32 accumulation, plus one
    rounding of a bf16 result."""
    xd = x.double()
    normed = xd * torch.rsqrt(xd.square().mean(-1, keepdim=True) + EPS) * nw.double()
    ulp = 2.0**-7 if x.dtype == torch.bfloat16 else 2e-6
    for i, (w, y) in enumerate(zip(ws, got)):
        assert y.dtype == (torch.float32 if out_fp32 else x.dtype) and y.shape == (x.shape[0], w.shape[0]), why
        want = normed @ w.double().T
        bound = ulp * (normed.abs() @ w.double().abs().T)
        if y.dtype == torch.bfloat16:
            _, exp = torch.frexp(want)
            bound = bound + torch.ldexp(torch.ones_like(want), exp - 8)
        bad = ~((y.double() - want).abs() <= bound)
        assert not bad.any(), f"{why}: weight {i}: {int(bad.sum())} of {bad.numel()} elements off"


@pytest.mark.parametrize("out_fp32", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,ns,k,tiles", CASES)
def test_matches_the_norm_then_the_projections(m: int, ns: tuple[int, ...], k: int, tiles: Tiles, dtype: torch.dtype,
                                               out_fp32: bool, device: str) -> None:
    seed = fresh_seed()
    x, nw, ws = _operands(seed, m, ns, k, dtype, device)
    why = f"seed={seed} M={m} N={ns} K={k} tiles={tiles} {dtype} out_fp32={out_fp32}"
    got = skinny_linear_norm_triton(x, nw, EPS, ws, out_fp32, tiles)
    _assert_normed_products(got, x, nw, ws, out_fp32, why)
    if tiles.split > 1:  # the norm's launch, then the group's: the same bits as the two calls
        apart = skinny_linear_group_triton(rms_norm_triton(x, nw, EPS), ws, out_fp32, tiles)
        assert all(torch.equal(a, b) for a, b in zip(got, apart)), why


def test_refuses_a_norm_weight_of_another_width(device: str) -> None:
    x, nw, ws = _operands(fresh_seed(), 2, (16,), 32, torch.float32, device)
    with pytest.raises(ValueError, match="norm weight of x's width 32"):
        skinny_linear_norm_triton(x, nw[:16], EPS, ws, False)
    with pytest.raises(ValueError, match="1 to"):
        skinny_linear_norm_triton(x, nw, EPS, [], False)


def test_op_reference_on_cpu() -> None:
    seed = fresh_seed()
    x, nw, ws = _operands(seed, 3, (32, 16), 48, torch.float32, "cpu")
    got = torch.ops.deepinfer.skinny_linear_norm(x, nw, EPS, ws, True)
    normed = rms_norm(x, nw, EPS)
    assert all(torch.equal(a, project.reference(normed, w, True)) for a, w in zip(got, ws)), f"seed={seed}"
    torch.library.opcheck(torch.ops.deepinfer.skinny_linear_norm.default, (x, nw, EPS, ws, True))


# P8 at decode: q_norm -> wq_b in a window layer and in a CSA layer (with the indexer's wq_b), the
# final norm -> the head; all take K in one split.
MODEL_CASES = [((32768,), 1024, False), ((32768, 8192), 1024, False), ((129280,), 4096, True)]


@cuda_only
@pytest.mark.parametrize("ns,k,out_fp32", MODEL_CASES, ids=str)
def test_model_sizes(ns: tuple[int, ...], k: int, out_fp32: bool) -> None:
    """In one split (so in one launch), within rounding of the exact normed products, and row r
    alone == row r in a batch of 16."""
    assert norm_tiles(sum(ns), k).split == 1
    seed = fresh_seed()
    x, nw, ws = _operands(seed, 16, ns, k, torch.bfloat16, "cuda")
    full = skinny_linear_norm_triton(x, nw, EPS, ws, out_fp32)
    _assert_normed_products(full, x, nw, ws, out_fp32, f"seed={seed} N={ns}")
    for r in (0, 9):
        alone = skinny_linear_norm_triton(x[r : r + 1], nw, EPS, ws, out_fp32)
        assert all(torch.equal(a[0], y[r]) for a, y in zip(alone, full)), f"seed={seed} N={ns} row {r}"


@cuda_only
def test_one_launch_per_call() -> None:
    x, nw, ws = _operands(fresh_seed(), 1, (32768, 8192), 1024, torch.bfloat16, "cuda")
    skinny_linear_norm_triton(x, nw, EPS, ws, False)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        skinny_linear_norm_triton(x, nw, EPS, ws, False)
        torch.cuda.synchronize()
    launches = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(launches) == 1 and "_skinny_kernel" in launches[0], launches
