"""The Triton routed experts (``kernels/triton/moe.py``) against ``graphs/moe.py``.

On CPU the launchers run under Triton's interpreter with fp32 inputs and tiny widths; on a GPU
the same tests also run bf16 at the P8 benchmark's widths (MXFP4 weights there:
``test_triton_moe_fp4.py``). Every case draws a fresh seed and names it in its assert messages.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_fx.io.quant import dequant_fp8_block
from deepinfer_fx.kernels.triton import moe, moe_tiles
from deepinfer_fx.kernels.triton.moe import (
    moe_experts_fp8_triton,
    moe_experts_triton,
    run_experts,
    sort_pairs,
)
from deepinfer_fx.kernels.triton.moe_tiles import Tiles, choose_tiles, tile_smem
from moe_cases import check_close, cuda_only, moe_case, p8_case, reference


def _run(
    c: dict, limit: float, out: torch.Tensor | None = None, tiles: tuple[Tiles, Tiles] | None = None
) -> torch.Tensor:
    w = c["w"]
    return moe_experts_triton(c["x"], w["w1"], w["w3"], w["w2"], c["idx"], c["rw"], limit, out=out, tiles=tiles)


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
    c = moe_case(seed, t, e, d, i, k, device)
    if limit:
        assert _clamp_bites(c, limit), f"seed {seed}: the clamp never bites"
    check_close(_run(c, limit), reference(c["w"], limit, c["x"], c["idx"], c["rw"]), seed, 1e-5)


@pytest.mark.parametrize("experts", [[3], [0, 5]], ids=["all-one-expert", "two-of-eight"])
def test_skewed_and_empty_experts(device: str, experts: list[int]) -> None:
    seed = random.randrange(2**31)
    c = moe_case(seed, 20, 8, 48, 40, 4, device, experts=experts)  # 80 rows: several blocks of one expert
    check_close(_run(c, 0.6), reference(c["w"], 0.6, c["x"], c["idx"], c["rw"]), seed, 1e-5)


def test_half_height_last_blocks(device: str) -> None:
    """Tiles with ``half``: an expert's last block of <= bm / 2 rows runs as a bm / 2 tile. The
    experts get 1..46 rows, so last blocks of both heights (and full blocks) occur; bf16-style
    weights and fp8 block-scaled ones."""
    seed = random.randrange(2**31)
    g = torch.Generator(device).manual_seed(seed)
    c = moe_case(seed, 60, 6, 48, 40, 2, device)
    rows = [1, 9, 16, 17, 31, 40]  # per expert; 114 of the 120 pairs, the rest to expert 5
    c["idx"] = torch.repeat_interleave(torch.arange(6, device=device), torch.tensor(rows, device=device))
    c["idx"] = torch.cat([c["idx"], torch.full((6,), 5, device=device)])[
        torch.randperm(120, generator=g, device=device)
    ]
    c["idx"] = c["idx"].view(60, 2)
    half = (Tiles(32, 16, 16, 1, 4, 2, True), Tiles(32, 16, 16, 1, 4, 2, True))
    want = reference(c["w"], 0.6, c["x"], c["idx"], c["rw"])
    check_close(_run(c, 0.6, tiles=half), want, seed, 1e-5)
    check_close(_run(c, 0.6, tiles=tuple(t._replace(half=False) for t in half)), want, seed, 1e-5)
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
    check_close(got, reference(deq, 0.6, c["x"], c["idx"], c["rw"]), seed, 1e-5)
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
    c = moe_case(seed, 6, 8, 48, 40, 3, device)
    out = torch.full((6, 48), float("nan"), device=device)
    got = _run(c, 0.6, out=out)
    assert got.data_ptr() == out.data_ptr(), f"seed {seed}: out not used"
    check_close(got, reference(c["w"], 0.6, c["x"], c["idx"], c["rw"]), seed, 1e-5)


def _alone_vs_batch(c: dict, limit: float, seed: int, rows: list[int]) -> None:
    batch = _run(c, limit)
    for r in rows:
        alone = _run({**c, "x": c["x"][r : r + 1], "idx": c["idx"][r : r + 1], "rw": c["rw"][r : r + 1]}, limit)
        assert torch.equal(alone[0], batch[r]), f"seed {seed}: token {r} alone differs from the batch"


def test_batch_invariant(device: str) -> None:
    seed = random.randrange(2**31)
    c = moe_case(seed, 12, 8, 48, 40, 4, device)
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
    c = moe_case(seed, t, 4, d, i, 3, device)
    q, deq = _fp8(c, block, seed)
    got = moe_experts_fp8_triton(
        c["x"], q["w1"], q["w1_scale"], q["w3"], q["w3_scale"], q["w2"], q["w2_scale"], c["idx"], c["rw"], 0.6, block
    )
    check_close(got, reference(deq, 0.6, c["x"], c["idx"], c["rw"]), seed, 1e-5)
    op = torch.ops.deepinfer.moe_experts_fp8(
        c["x"], q["w1"], q["w1_scale"], q["w3"], q["w3_scale"], q["w2"], q["w2_scale"], c["idx"], c["rw"], 0.6, block
    )
    check_close(op, reference(deq, 0.6, c["x"], c["idx"], c["rw"]), seed, 1e-6 if device == "cpu" else 1e-5)


def test_opcheck(device: str) -> None:
    """Schemas, fake impls and (on a GPU) the registered Triton kernels of both ops."""
    seed = random.randrange(2**31)
    c = moe_case(seed, 5, 4, 64, 32, 2, device)
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
    return p8_case()


@cuda_only
@pytest.mark.parametrize("t", [1, 7, 64, 256, 4096])
def test_p8_bf16_matches_reference(p8_weights: dict, t: int) -> None:
    c = {**p8_weights, "x": p8_weights["x"][:t], "idx": p8_weights["idx"][:t], "rw": p8_weights["rw"][:t]}
    want = reference(c["w"], 10.0, c["x"], c["idx"], c["rw"])
    check_close(_run(c, 10.0), want, c["seed"], 2e-2)
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
    check_close(got, reference(deq, 10.0, c["x"], c["idx"], c["rw"]), c["seed"], 2e-2)
