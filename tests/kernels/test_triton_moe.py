"""The Triton routed experts (``kernels/triton/moe.py``) against ``graphs/moe.py``.

On CPU the launchers run under Triton's interpreter with fp32 inputs and tiny widths; on a GPU
the same tests also run bf16 at the P8 benchmark's widths. Every case draws a fresh seed and
names it in its assert messages.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_fx.graphs.moe import routed_experts
from deepinfer_fx.io.quant import dequant_fp8_block, dequant_mxfp4, quant_mxfp4
from deepinfer_fx.kernels.triton import moe, moe_tiles
from deepinfer_fx.kernels.triton.moe import (
    moe_experts_fp4_triton,
    moe_experts_fp8_triton,
    moe_experts_triton,
    run_experts,
    sort_pairs,
)
from deepinfer_fx.kernels.triton.moe_tiles import Tiles, choose_tiles, expert_tiles, tile_smem

reference = routed_experts.reference
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def _case(
    seed: int,
    t: int,
    e: int,
    d: int,
    i: int,
    k: int,
    device: str,
    dtype: torch.dtype = torch.float32,
    experts: list[int] | None = None,
) -> dict:
    """Random inputs; ``experts`` restricts routing to those ids (k of them drawn per token,
    with repeats when fewer than k are given)."""
    g = torch.Generator(device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device)

    w = {"w1": randn(e, i, d) / d**0.5, "w3": randn(e, i, d) / d**0.5, "w2": randn(e, d, i) / i**0.5}
    pool = torch.tensor(experts if experts is not None else list(range(e)), device=device)
    if len(pool) >= k:
        idx = pool[torch.rand(t, len(pool), generator=g, device=device).argsort(-1)[:, :k]]
    else:
        idx = pool[torch.randint(len(pool), (t, k), generator=g, device=device)]
    rw = torch.rand(t, k, generator=g, device=device) + 0.1
    return {"x": randn(t, d).to(dtype), "w": {n: v.to(dtype) for n, v in w.items()}, "idx": idx, "rw": rw}


def _run(
    c: dict, limit: float, out: torch.Tensor | None = None, tiles: tuple[Tiles, Tiles] | None = None
) -> torch.Tensor:
    w = c["w"]
    return moe_experts_triton(c["x"], w["w1"], w["w3"], w["w2"], c["idx"], c["rw"], limit, out=out, tiles=tiles)


def _check(got: torch.Tensor, want: torch.Tensor, seed: int, tol: float) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape, f"seed {seed}: {got.dtype} {tuple(got.shape)}"
    assert torch.isfinite(got).all(), f"seed {seed}: non-finite output"
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
    assert err <= tol, f"seed {seed}: max |diff| / max |ref| = {err:.3g} > {tol}"


def _clamp_bites(c: dict, limit: float) -> bool:
    w1 = c["w"]["w1"][c["idx"]].float()  # [T, k, I, D]
    return bool((torch.einsum("td,tkid->tki", c["x"].float(), w1) > limit).any())


@pytest.mark.parametrize("t,e", [(1, 8), (700, 8), (600, 40)])
def test_sort_pairs(device: str, t: int, e: int) -> None:
    """Pairs grouped by expert over several sort programs (one per 256 pairs)."""
    seed = random.randrange(2**31)
    g = torch.Generator(device).manual_seed(seed)
    idx = torch.randint(e, (t, 6), generator=g, device=device)
    idx[: t // 2, 0] = 3  # skew: one expert takes many pairs, others none or few
    pairs, ends = sort_pairs(idx, e)
    flat = idx.reshape(-1)
    counts = torch.zeros(e, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    assert torch.equal(ends.long(), counts.cumsum(0)), f"seed {seed}: expert ends"
    every = torch.arange(flat.numel(), device=device)
    assert torch.equal(pairs.sort().values.long(), every), f"seed {seed}: not a permutation"
    assert torch.equal(flat[pairs.long()], flat.sort().values), f"seed {seed}: not grouped by expert"


@pytest.mark.parametrize("t,launches", [(1, ["sort_one"]), (42, ["sort_one"]), (43, ["count", "place"])])
def test_sort_is_one_launch_up_to_one_span(
    device: str, t: int, launches: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Up to 256 pairs (42 tokens of 6) one program sorts them; more take the two-launch sort."""
    seen: list[str] = []

    class Recorded:
        def __init__(self, name: str, kernel) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            seen.append(self.name)
            return self.kernel[grid]

    for name, attr in (
        ("sort_one", "sort_pairs_one_kernel"),
        ("count", "count_pairs_kernel"),
        ("place", "place_pairs_kernel"),
    ):
        monkeypatch.setattr(moe, attr, Recorded(name, getattr(moe, attr)))
    idx = torch.randint(8, (t, 6), device=device)
    pairs, ends = sort_pairs(idx, 8)
    assert seen == launches
    assert torch.equal(idx.reshape(-1)[pairs.long()], idx.reshape(-1).sort().values)


@pytest.mark.parametrize("t,e,d,i,k", [(1, 8, 48, 40, 4), (5, 8, 64, 32, 2), (40, 4, 48, 40, 4), (72, 4, 32, 64, 4)])
@pytest.mark.parametrize("limit", [0.0, 0.6])
def test_matches_reference(device: str, t: int, e: int, d: int, i: int, k: int, limit: float) -> None:
    seed = random.randrange(2**31)
    c = _case(seed, t, e, d, i, k, device)
    if limit:
        assert _clamp_bites(c, limit), f"seed {seed}: the clamp never bites"
    _check(_run(c, limit), reference(c["w"], limit, c["x"], c["idx"], c["rw"]), seed, 1e-5)


@pytest.mark.parametrize("experts", [[3], [0, 5]], ids=["all-one-expert", "two-of-eight"])
def test_skewed_and_empty_experts(device: str, experts: list[int]) -> None:
    seed = random.randrange(2**31)
    c = _case(seed, 20, 8, 48, 40, 4, device, experts=experts)  # 80 rows: several blocks of one expert
    _check(_run(c, 0.6), reference(c["w"], 0.6, c["x"], c["idx"], c["rw"]), seed, 1e-5)


def test_half_height_last_blocks(device: str) -> None:
    """Tiles with ``half``: an expert's last block of <= bm / 2 rows runs as a bm / 2 tile. The
    experts get 1..46 rows, so last blocks of both heights (and full blocks) occur; bf16-style
    weights and fp8 block-scaled ones."""
    seed = random.randrange(2**31)
    g = torch.Generator(device).manual_seed(seed)
    c = _case(seed, 60, 6, 48, 40, 2, device)
    rows = [1, 9, 16, 17, 31, 40]  # per expert; 114 of the 120 pairs, the rest to expert 5
    c["idx"] = torch.repeat_interleave(torch.arange(6, device=device), torch.tensor(rows, device=device))
    c["idx"] = torch.cat([c["idx"], torch.full((6,), 5, device=device)])[
        torch.randperm(120, generator=g, device=device)
    ]
    c["idx"] = c["idx"].view(60, 2)
    half = (Tiles(32, 16, 16, 1, 4, 2, True), Tiles(32, 16, 16, 1, 4, 2, True))
    want = reference(c["w"], 0.6, c["x"], c["idx"], c["rw"])
    _check(_run(c, 0.6, tiles=half), want, seed, 1e-5)
    _check(_run(c, 0.6, tiles=tuple(t._replace(half=False) for t in half)), want, seed, 1e-5)
    q, deq = _fp8(c, 16, seed)
    got = run_experts(
        c["x"],
        (q["w1"], q["w3"], q["w2"]),
        (q["w1_scale"], q["w3_scale"], q["w2_scale"]),
        16,
        c["idx"],
        c["rw"],
        0.6,
        None,
        half,
    )
    _check(got, reference(deq, 0.6, c["x"], c["idx"], c["rw"]), seed, 1e-5)
    with pytest.raises(ValueError, match="half-height tiles need bm >= 32"):
        _run(c, 0.6, tiles=(Tiles(16, 16, 16, 1, 4, 2, True), half[1]))


def test_prefill_tiles_take_half_height_last_blocks() -> None:
    """The 128-row prefill tiles split their last blocks; decode tiles stream weights and do not."""
    assert (
        choose_tiles(4096 * 6, 64, 2048, 4096, True, 0).half and choose_tiles(4096 * 6, 64, 4096, 2048, False, 0).half
    )
    assert not choose_tiles(8 * 6, 64, 2048, 4096, True, 0).half


@pytest.mark.parametrize("gated", [True, False], ids=["gate_up", "down"])
def test_narrow_decode_tiles_run_in_one_wave(gated: bool) -> None:
    """At T = 1 (P8: D 4096, I 2048, top-6 of 64) the narrow tiles keep 4 stages while every
    program is resident at once (6 row blocks); with the shared expert folded in (7 blocks over
    65 experts) 4 stages would need a second wave, so they drop to 3. Where one stage fewer does
    not fit either (T = 2 folded) the tiles stay as they were; the k tile never changes."""
    n, k = (2048, 4096) if gated else (4096, 2048)
    routed, folded, two = (choose_tiles(p, e, n, k, gated, 0) for p, e in ((6, 64), (7, 65), (14, 65)))
    assert (routed.bn, routed.stages, folded.bn, folded.stages) == (32, 4, 32, 3)
    # T = 2 folded: gate/up's 14 x 64 programs fit no better at 3 stages; down takes wide tiles
    assert (two.bn, two.stages) == ((32, 4) if gated else (128, 3))
    assert routed.bk == folded.bk == two.bk == 128
    for tiles, blocks in ((routed, 6), (folded, 7)):
        per_sm = moe_tiles._SMEM_PER_SM // (tile_smem(tiles, gated) + moe_tiles._SMEM_RESERVED)
        assert blocks * (n // tiles.bn) <= moe_tiles._SMS * per_sm, (tiles, per_sm)
    per_sm4 = moe_tiles._SMEM_PER_SM // (tile_smem(folded._replace(stages=4), gated) + moe_tiles._SMEM_RESERVED)
    assert 7 * (n // 32) > moe_tiles._SMS * per_sm4  # why the fold needs the shallower pipeline
    # fp8 weights (a byte an element) fit more programs: the 4-stage tiles stay one wave folded
    assert choose_tiles(7, 65, n, k, gated, 128, 2, 1).stages == 4


def test_poisoned_out(device: str) -> None:
    seed = random.randrange(2**31)
    c = _case(seed, 6, 8, 48, 40, 3, device)
    out = torch.full((6, 48), float("nan"), device=device)
    got = _run(c, 0.6, out=out)
    assert got.data_ptr() == out.data_ptr(), f"seed {seed}: out not used"
    _check(got, reference(c["w"], 0.6, c["x"], c["idx"], c["rw"]), seed, 1e-5)


def _alone_vs_batch(c: dict, limit: float, seed: int, rows: list[int]) -> None:
    batch = _run(c, limit)
    for r in rows:
        alone = _run({**c, "x": c["x"][r : r + 1], "idx": c["idx"][r : r + 1], "rw": c["rw"][r : r + 1]}, limit)
        assert torch.equal(alone[0], batch[r]), f"seed {seed}: token {r} alone differs from the batch"


def test_batch_invariant(device: str) -> None:
    seed = random.randrange(2**31)
    c = _case(seed, 12, 8, 48, 40, 4, device)
    _alone_vs_batch(c, 0.6, seed, list(range(12)))


def _fp8(c: dict, block: int, seed: int) -> tuple[dict, dict]:
    """fp8 weights with random block scales, and their dequantised twins for the reference."""
    g = torch.Generator(c["x"].device).manual_seed(seed + 1)
    q, deq = {}, {}
    for n, w in c["w"].items():
        e, o, i = w.shape
        s = torch.rand(e, -(-o // block), -(-i // block), generator=g, device=w.device) + 0.5
        w8 = (w.float() * 8).to(torch.float8_e4m3fn)
        q[n], q[n + "_scale"] = w8, s / 8
        deq[n] = dequant_fp8_block(w8, s / 8, block, c["x"].dtype)
    return q, deq


@pytest.mark.parametrize("t,d,i,block", [(3, 64, 48, 16), (20, 64, 64, 32)])
def test_fp8_matches_reference(device: str, t: int, d: int, i: int, block: int) -> None:
    seed = random.randrange(2**31)
    c = _case(seed, t, 4, d, i, 3, device)
    q, deq = _fp8(c, block, seed)
    got = moe_experts_fp8_triton(
        c["x"], q["w1"], q["w1_scale"], q["w3"], q["w3_scale"], q["w2"], q["w2_scale"], c["idx"], c["rw"], 0.6, block
    )
    _check(got, reference(deq, 0.6, c["x"], c["idx"], c["rw"]), seed, 1e-5)
    op = torch.ops.deepinfer.moe_experts_fp8(
        c["x"], q["w1"], q["w1_scale"], q["w3"], q["w3_scale"], q["w2"], q["w2_scale"], c["idx"], c["rw"], 0.6, block
    )
    _check(op, reference(deq, 0.6, c["x"], c["idx"], c["rw"]), seed, 1e-6 if device == "cpu" else 1e-5)


def test_opcheck(device: str) -> None:
    """Schemas, fake impls and (on a GPU) the registered Triton kernels of both ops."""
    seed = random.randrange(2**31)
    c = _case(seed, 5, 4, 64, 32, 2, device)
    w = c["w"]
    args = (c["x"], w["w1"], w["w3"], w["w2"], c["idx"], c["rw"], 0.6)
    torch.library.opcheck(torch.ops.deepinfer.moe_experts.default, args)
    q, _ = _fp8(c, 16, seed)
    args = (c["x"], q["w1"], q["w1_scale"], q["w3"], q["w3_scale"], q["w2"], q["w2_scale"], c["idx"], c["rw"], 0.6, 16)
    # test_schema compares inputs before and after with allclose, which fp8 tensors do not take.
    utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.deepinfer.moe_experts_fp8.default, args, test_utils=utils)


# --- GPU: bf16 at the P8 benchmark's widths (D 4096, I 2048, E 64, k 6) ----------------------


@pytest.fixture(scope="module")
def p8_weights() -> dict:
    seed = random.randrange(2**31)
    return {"seed": seed, **_case(seed, 4096, 64, 4096, 2048, 6, "cuda", torch.bfloat16)}


@cuda_only
@pytest.mark.parametrize("t", [1, 7, 64, 256, 4096])
def test_p8_bf16_matches_reference(p8_weights: dict, t: int) -> None:
    c = {**p8_weights, "x": p8_weights["x"][:t], "idx": p8_weights["idx"][:t], "rw": p8_weights["rw"][:t]}
    want = reference(c["w"], 10.0, c["x"], c["idx"], c["rw"])
    _check(_run(c, 10.0), want, c["seed"], 2e-2)
    op = torch.ops.deepinfer.moe_experts(c["x"], c["w"]["w1"], c["w"]["w3"], c["w"]["w2"], c["idx"], c["rw"], 10.0)
    assert torch.equal(op, _run(c, 10.0)), f"seed {c['seed']}: the registered CUDA kernel is not the launcher"


@cuda_only
def test_p8_bf16_batch_invariant(p8_weights: dict) -> None:
    c = p8_weights
    for t in (256, 4096):  # decode-sized and prefill-sized tiles against each token alone
        _alone_vs_batch({**c, "x": c["x"][:t], "idx": c["idx"][:t], "rw": c["rw"][:t]}, 10.0, c["seed"], [0, 5, 200])


@cuda_only
def test_p8_half_height_blocks_bitwise(p8_weights: dict) -> None:
    """At 4096 tokens every row equals the run without half-height last blocks, bit for bit."""
    c = p8_weights
    tiles = (choose_tiles(4096 * 6, 64, 2048, 4096, True, 0), choose_tiles(4096 * 6, 64, 4096, 2048, False, 0))
    assert all(t.half for t in tiles)
    got = _run(c, 10.0, tiles=tiles)
    full = _run(c, 10.0, tiles=tuple(t._replace(half=False) for t in tiles))
    assert torch.equal(got, full), f"seed {c['seed']}: half-height blocks change results"


@cuda_only
def test_p8_cuda_graph_replay(p8_weights: dict) -> None:
    """No host sync inside: the launcher captures, and replaying with new routing matches eager."""
    c = {
        **p8_weights,
        "x": p8_weights["x"][:64].clone(),
        "idx": p8_weights["idx"][:64].clone(),
        "rw": p8_weights["rw"][:64].clone(),
    }
    _run(c, 10.0)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _run(c, 10.0)
    c["idx"].copy_(p8_weights["idx"][64:128])
    c["x"].copy_(p8_weights["x"][64:128])
    graph.replay()
    assert torch.equal(static_out, _run(c, 10.0)), f"seed {c['seed']}: graph replay differs from eager"


@cuda_only
@pytest.mark.parametrize("t", [1, 256, 4096])
def test_p8_fp8_matches_reference(p8_weights: dict, t: int) -> None:
    c = {**p8_weights, "x": p8_weights["x"][:t], "idx": p8_weights["idx"][:t], "rw": p8_weights["rw"][:t]}
    q, deq = _fp8(c, 128, c["seed"])
    got = torch.ops.deepinfer.moe_experts_fp8(
        c["x"], q["w1"], q["w1_scale"], q["w3"], q["w3_scale"], q["w2"], q["w2_scale"], c["idx"], c["rw"], 10.0, 128
    )
    _check(got, reference(deq, 10.0, c["x"], c["idx"], c["rw"]), c["seed"], 2e-2)


@pytest.fixture(scope="module")
def p8_fp4(p8_weights: dict) -> tuple[dict, dict]:
    """P8's expert weights as MXFP4 (codes and ue8m0 scales, uint8) and dequantised to bf16."""
    q = {n: tuple(t.view(torch.uint8) for t in quant_mxfp4(v)) for n, v in p8_weights["w"].items()}
    return q, {n: dequant_mxfp4(*q[n], torch.bfloat16) for n in q}


def _run_fp4(q: dict, c: dict, limit: float, triton_only: bool = False) -> torch.Tensor:
    """The registered op, or with ``triton_only`` Triton's tiles where the op would take the Gluon GEMMs."""
    w4 = (q["w1"][0], q["w1"][1], q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1])
    if triton_only:
        return moe_experts_fp4_triton(c["x"], *w4, c["idx"], c["rw"], limit, wgmma=False)
    return torch.ops.deepinfer.moe_experts_fp4(c["x"], *w4, c["idx"], c["rw"], limit)


@cuda_only
@pytest.mark.parametrize("t", [1, 7, 64, 256, 4096])
@pytest.mark.parametrize("triton_only", [False, True])
def test_p8_fp4_bf16_matches_reference(p8_weights: dict, p8_fp4: tuple[dict, dict], t: int, triton_only: bool) -> None:
    """bf16 rows take the Gluon GEMMs on sm_90 and Triton's microscaled dot elsewhere (fp32 ones
    decode in the kernel, tested in the interpreter): decode and prefill sizes against the bf16
    math over the dequantised weights."""
    q, deq = p8_fp4
    c = {**p8_weights, "x": p8_weights["x"][:t], "idx": p8_weights["idx"][:t], "rw": p8_weights["rw"][:t]}
    want = reference(deq, 10.0, c["x"], c["idx"], c["rw"])
    _check(_run_fp4(q, c, 10.0, triton_only), want, c["seed"], 2e-2)


@cuda_only
@pytest.mark.parametrize("triton_only", [False, True])
def test_p8_fp4_batch_invariant(p8_weights: dict, p8_fp4: tuple[dict, dict], triton_only: bool) -> None:
    q, _ = p8_fp4
    for t in (256, 4096):
        c = {**p8_weights, "x": p8_weights["x"][:t], "idx": p8_weights["idx"][:t], "rw": p8_weights["rw"][:t]}
        batch = _run_fp4(q, c, 10.0, triton_only)
        for r in (0, 5, 200):
            alone = _run_fp4(
                q,
                {**c, "x": c["x"][r : r + 1], "idx": c["idx"][r : r + 1], "rw": c["rw"][r : r + 1]},
                10.0,
                triton_only,
            )
            assert torch.equal(alone[0], batch[r]), f"seed {c['seed']}: token {r} alone differs from the batch of {t}"


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _sm90(), reason="the Gluon GEMMs run on sm_90 only")
@pytest.mark.parametrize("t", [1, 3, 64, 256, 4096])
@pytest.mark.parametrize("big", [False, True])
def test_p8_fp4_wgmma_matches_triton(p8_weights: dict, p8_fp4: tuple[dict, dict], t: int, big: bool) -> None:
    """The Gluon GEMMs (``wgmma=True``) against Triton's fp4 tiles on the same codes
    (``big``: four experts' scale bytes raised past 128, which the Gluon decode multiplies twice)."""
    q, _ = p8_fp4
    if big:
        q = {n: (w, torch.cat([s[:4] + 12, s[4:]])) for n, (w, s) in q.items()}
    c = {**p8_weights, "x": p8_weights["x"][:t], "idx": p8_weights["idx"][:t], "rw": p8_weights["rw"][:t]}
    w4 = (q["w1"][0], q["w1"][1], q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1])
    want = moe_experts_fp4_triton(c["x"], *w4, c["idx"], c["rw"], 10.0, wgmma=False)
    _check(moe_experts_fp4_triton(c["x"], *w4, c["idx"], c["rw"], 10.0, wgmma=True), want, c["seed"], 1e-2)


@pytest.mark.skipif(not _sm90(), reason="the Gluon GEMMs run on sm_90 only")
def test_p8_fp4_wgmma_batch_invariant(p8_weights: dict, p8_fp4: tuple[dict, dict]) -> None:
    """Alone a token's block is 8 rows high, in a batch of 256 32 and in one of 4,096 64: the
    MMA's N, which no row's sum depends on, so the bits are the same."""
    q, _ = p8_fp4
    w4 = (q["w1"][0], q["w1"][1], q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1])
    for t in (256, 4096):
        x, idx, rw = (p8_weights[n][:t] for n in ("x", "idx", "rw"))
        batch = moe_experts_fp4_triton(x, *w4, idx, rw, 10.0, wgmma=True)
        for r in (0, 5, 200):
            alone = moe_experts_fp4_triton(x[r : r + 1], *w4, idx[r : r + 1], rw[r : r + 1], 10.0, wgmma=True)
            assert torch.equal(alone[0], batch[r]), (
                f"seed {p8_weights['seed']}: token {r} alone differs from its batch of {t}"
            )


@pytest.mark.skipif(not _sm90(), reason="the Gluon GEMMs run on sm_90 only")
@pytest.mark.parametrize("big", [False, True])
def test_p8_fp4_tall_same_bits(p8_weights: dict, p8_fp4: tuple[dict, dict], big: bool, monkeypatch) -> None:
    """The 128-row prefill form (``moe_fp4_tall``: each weight tile decoded once into shared
    memory for two warpgroups, the rows by TMA in kappa order) sums a row as the 64-row blocks do:
    the same bits at 4,096 tokens (384 rows an expert) and 1,000 (ragged last blocks), with four
    experts' scale bytes past 128 (the two-multiply decode) too; so a token alone (8-row blocks)
    and in a prefill batch agree."""
    from deepinfer_fx.kernels.triton import moe_fp4_wgmma as wg

    q, _ = p8_fp4
    if big:
        q = {n: (w, torch.cat([s[:4] + 12, s[4:]])) for n, (w, s) in q.items()}
    w4 = (q["w1"][0], q["w1"][1], q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1])
    for t in (1000, 4096):
        x, idx, rw = (p8_weights[n][:t] for n in ("x", "idx", "rw"))
        monkeypatch.setattr(wg, "TALL_FROM", None)
        short = moe_experts_fp4_triton(x, *w4, idx, rw, 10.0, wgmma=True)
        monkeypatch.setattr(wg, "TALL_FROM", 64)
        assert wg.wgmma_rows(6 * t, 64) == 128
        tall = moe_experts_fp4_triton(x, *w4, idx, rw, 10.0, wgmma=True)
        assert torch.isfinite(tall).all()
        assert torch.equal(tall, short), f"seed {p8_weights['seed']}, {t} tokens, big {big}"
        alone = moe_experts_fp4_triton(x[5:6], *w4, idx[5:6], rw[5:6], 10.0, wgmma=True)
        assert torch.equal(alone[0], tall[5]), f"seed {p8_weights['seed']}: token 5 alone against {t} tall"


@pytest.mark.skipif(not _sm90(), reason="the Gluon GEMMs run on sm_90 only")
def test_p8_fp4_wgmma_two_steps_ahead_same_bits(p8_weights: dict, p8_fp4: tuple[dict, dict], monkeypatch) -> None:
    """Loading the weights two loop steps ahead (a token's launches, ``FEW_AHEAD``) sums in the
    same order as one step ahead: the same bits."""
    from deepinfer_fx.kernels.triton import moe_fp4_wgmma as wg

    q, _ = p8_fp4
    w4 = (q["w1"][0], q["w1"][1], q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1])
    x, idx, rw = (p8_weights[n][:1] for n in ("x", "idx", "rw"))
    dev = x.device
    assert wg.steps_ahead(6 * 2048 // 64, dev, 2) == 2 and wg.steps_ahead(6 * 4096 // 64, dev, 4) == 2  # both launches
    two = moe_experts_fp4_triton(x, *w4, idx, rw, 10.0, wgmma=True)
    monkeypatch.setattr(wg, "FEW_AHEAD", 1)
    one = moe_experts_fp4_triton(x, *w4, idx, rw, 10.0, wgmma=True)
    assert torch.equal(one, two), f"seed {p8_weights['seed']}"


@pytest.mark.skipif(not _sm90(), reason="the Gluon GEMMs run on sm_90 only")
def test_p8_fp4_unaligned_weights_take_triton(p8_weights: dict, p8_fp4: tuple[dict, dict]) -> None:
    """Codes or scales not 16-byte aligned (a view at an odd offset) cannot be read as the Gluon
    GEMMs read them: the op's default takes Triton's tiles (the same bits as ``wgmma=False``) and
    ``wgmma=True`` is refused by name."""
    q, _ = p8_fp4

    def odd(t: torch.Tensor) -> torch.Tensor:
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
        return buf.view(t.shape).copy_(t)

    w4 = (q["w1"][0], odd(q["w1"][1]), q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1])
    x, idx, rw = (p8_weights[n][:8] for n in ("x", "idx", "rw"))
    want = moe_experts_fp4_triton(x, *w4, idx, rw, 10.0, wgmma=False)
    assert torch.equal(moe_experts_fp4_triton(x, *w4, idx, rw, 10.0), want), f"seed {p8_weights['seed']}"
    with pytest.raises(ValueError, match="leave wgmma off"):
        moe_experts_fp4_triton(x, *w4, idx, rw, 10.0, wgmma=True)


def test_fp4_tiles_do_not_follow_the_row_count() -> None:
    """A row's sum has one order at every batch size only if the k tile is the same for all and
    the column tile never 32 (where sm_90's microscaled dot rounds differently), at every width."""
    from deepinfer_fx.kernels.triton.moe_tiles import fp4_tiles

    for d, i in ((4096, 2048), (5120, 2304), (7168, 3072)):  # V4-Flash, V4.1-Flash, V4-Pro
        ks = set()
        for t in (1, 8, 64, 256, 4096):
            g, dn = fp4_tiles(choose_tiles(t * 6, 64, i, d, True, 0), choose_tiles(t * 6, 64, d, i, False, 0), i, d)
            ks.add((g.bk, dn.bk))
            assert g.bn >= 64 and dn.bn >= 64, (d, t, g, dn)
        assert len(ks) == 1, ks


def _fp4_bits_tiles(t: int, fp32: bool) -> tuple:
    return tuple(v._replace(fp4_bits=True) for v in expert_tiles(t * 6, 64, 2048, 4096, 0, True, 4 if fp32 else 2, 1))


@cuda_only
@pytest.mark.parametrize("t", [1, 64, 4096])
def test_p8_fp4_bits_decode(p8_weights: dict, p8_fp4: tuple[dict, dict], t: int) -> None:
    """``Tiles.fp4_bits`` (the codes decoded in packed PTX): fp32 rows give the bits of the
    Triton decode, which they take otherwise (same values, same dots), at decode sizes; bf16 rows
    match the bf16 math over the dequantised weights at every size."""
    q, deq = p8_fp4
    w4 = (q["w1"][0], q["w1"][1], q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1])
    c = {**p8_weights, "x": p8_weights["x"][:t], "idx": p8_weights["idx"][:t], "rw": p8_weights["rw"][:t]}
    if t <= 64:  # fp32 rows at decode tiles (prefill-sized fp32 tiles are not what the engine runs)
        x32 = c["x"].float()
        plain = moe_experts_fp4_triton(x32, *w4, c["idx"], c["rw"], 10.0)
        bits = moe_experts_fp4_triton(x32, *w4, c["idx"], c["rw"], 10.0, tiles=_fp4_bits_tiles(t, True))
        assert torch.equal(plain, bits), f"seed {c['seed']}: the PTX decode differs from Triton's at T={t}"
    got = moe_experts_fp4_triton(c["x"], *w4, c["idx"], c["rw"], 10.0, tiles=_fp4_bits_tiles(t, False))
    _check(got, reference(deq, 10.0, c["x"], c["idx"], c["rw"]), c["seed"], 2e-2)


def test_fp4_bits_tiles_refuse_without_a_gpu_or_fp4_weights() -> None:
    """The PTX decode cannot run in the interpreter, and means nothing for bf16 weights: both
    refuse by name rather than run another decode."""
    seed = random.randrange(2**31)
    c = _case(seed, 3, 4, 64, 32, 2, "cpu")
    tiles = _fp4_bits_tiles(3, True)
    q = {n: tuple(t.view(torch.uint8) for t in quant_mxfp4(v)) for n, v in c["w"].items()}
    w4 = (q["w1"][0], q["w1"][1], q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp4_bits tiles decode MXFP4 weights in PTX"):
            moe_experts_fp4_triton(c["x"], *w4, c["idx"], c["rw"], 0.6, tiles=tiles)
    w = c["w"]
    with pytest.raises(ValueError, match="they need MXFP4 weights"):
        moe_experts_triton(c["x"], w["w1"], w["w3"], w["w2"], c["idx"], c["rw"], 0.6, tiles=tiles)
