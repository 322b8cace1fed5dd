"""The shared expert folded into the Triton routed experts (``deepinfer::moe_experts_shared``,
``kernels/triton/moe.py``) against ``graphs/moe.py::experts_with_shared``: every token's extra
pair (expert E, weight 1) derived in the kernels, the combine's order (routed sum, then shared),
batch invariance and refused layouts. The offline sm_90 compile of the changed kernels is
``test_triton_moe_shared_sm90.py``.

On CPU the launchers run under Triton's interpreter with fp32 inputs and tiny widths; on a GPU
the same tests run compiled, plus bf16 at the P8 benchmark's widths. Every case draws a fresh
seed and names it in its assert messages. The swap that puts the op in a step is
``tests/compile/test_moe_shared_swap.py``.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_fx.graphs.moe import experts_with_shared
from deepinfer_fx.kernels.triton.moe import moe_experts_shared_triton, run_experts, sort_pairs
from deepinfer_fx.kernels.triton.moe_tiles import Tiles


def _case(seed: int, t: int, e: int, d: int, i: int, k: int, device: str) -> dict:
    """Random routed experts ``w``, a shared expert ``s`` of the same width, tokens routed to k
    distinct experts with weights in [0.1, 1.1)."""
    g = torch.Generator(device).manual_seed(seed)

    def weight(*shape: int) -> torch.Tensor:  # unit-variance products with unit-variance inputs
        return torch.randn(*shape, generator=g, device=device) / shape[-1] ** 0.5

    w = {"w1": weight(e, i, d), "w3": weight(e, i, d), "w2": weight(e, d, i)}
    s = {"w1": weight(i, d), "w3": weight(i, d), "w2": weight(d, i)}
    x = torch.randn(t, d, generator=g, device=device)
    idx = torch.rand(t, e, generator=g, device=device).argsort(-1)[:, :k]
    rw = torch.rand(t, k, generator=g, device=device) + 0.1
    return {"x": x, "w": w, "s": s, "idx": idx, "rw": rw}


def _run(
    c: dict, limit: float, out: torch.Tensor | None = None, tiles: tuple[Tiles, Tiles] | None = None
) -> torch.Tensor:
    w, s = c["w"], c["s"]
    return moe_experts_shared_triton(
        c["x"], w["w1"], w["w3"], w["w2"], s["w1"], s["w3"], s["w2"], c["idx"], c["rw"], limit, out=out, tiles=tiles
    )


def _reference(c: dict, limit: float) -> torch.Tensor:
    real = torch.ones(len(c["x"]), dtype=torch.bool, device=c["x"].device)
    return experts_with_shared.reference(c["w"], c["s"], limit, c["x"], c["idx"], c["rw"], real)  # type: ignore[attr-defined]


def _check(got: torch.Tensor, want: torch.Tensor, seed: int, tol: float = 1e-5) -> None:
    assert got.dtype == torch.float32 and got.shape == want.shape, f"seed {seed}: {got.dtype} {tuple(got.shape)}"
    assert torch.isfinite(got).all(), f"seed {seed}: non-finite output"
    err = ((got - want).abs().max() / want.abs().max().clamp_min(1e-6)).item()
    assert err <= tol, f"seed {seed}: max |diff| / max |ref| = {err:.3g} > {tol}"


@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("e,d,i,k", [(8, 48, 40, 4), (4, 64, 32, 1), (6, 32, 64, 3)])
@pytest.mark.parametrize("limit", [0.0, 0.6])
def test_matches_reference(device: str, t: int, e: int, d: int, i: int, k: int, limit: float) -> None:
    seed = random.randrange(2**31)
    c = _case(seed, t, e, d, i, k, device)
    if limit:  # the clamp bites on the shared expert's gate too
        assert (c["x"] @ c["s"]["w1"].T > limit).any(), f"seed {seed}: the clamp never bites"
    _check(_run(c, limit), _reference(c, limit), seed)


def test_shared_is_added_after_the_routed_sum(device: str) -> None:
    """Bit for bit, the fused result is the routed experts' sum plus then the shared row, the
    reference's order. The shared row alone is the fused run with every routing weight 0 (the
    routed rows are then exact zeros); one set of tiles for all three runs."""
    seed = random.randrange(2**31)
    c = _case(seed, 9, 8, 48, 40, 3, device)
    tiles = (Tiles(16, 32, 16, 1, 4, 2), Tiles(16, 32, 16, 1, 4, 2))
    w = c["w"]
    routed = run_experts(c["x"], (w["w1"], w["w3"], w["w2"]), None, 0, c["idx"], c["rw"], 0.6, None, tiles)
    shared = _run({**c, "rw": torch.zeros_like(c["rw"])}, 0.6, tiles=tiles)
    assert torch.equal(_run(c, 0.6, tiles=tiles), routed + shared), f"seed {seed}"


def test_poisoned_out_and_half_height_tiles(device: str) -> None:
    """Every row of ``out`` is written; half-height last blocks serve the shared expert's rows
    (40 of them: a full 32-row block and a last one of 8) as they serve routed ones."""
    seed = random.randrange(2**31)
    c = _case(seed, 40, 6, 48, 40, 2, device)
    want = _reference(c, 0.6)
    out = torch.full((40, 48), float("nan"), device=device)
    got = _run(c, 0.6, out=out)
    assert got.data_ptr() == out.data_ptr(), f"seed {seed}: out not used"
    _check(got, want, seed)
    half = (Tiles(32, 16, 16, 1, 4, 2, True), Tiles(32, 16, 16, 1, 4, 2, True))
    _check(_run(c, 0.6, tiles=half), want, seed)
    assert torch.equal(_run(c, 0.6, tiles=half), _run(c, 0.6, tiles=tuple(t._replace(half=False) for t in half))), (
        f"seed {seed}"
    )


def test_sort_pairs_adds_the_shared_expert(device: str) -> None:
    """With ``shared`` each token's pair k is expert E: T*(k+1) pairs over E+1 experts, as if the
    routing had a last column of E (built here on the host for the check only)."""
    seed = random.randrange(2**31)
    g = torch.Generator(device).manual_seed(seed)
    t, e, k = 300, 8, 3  # 1200 pairs: several sort programs
    idx = torch.randint(e, (t, k), generator=g, device=device)
    pairs, ends = sort_pairs(idx, e, shared=True)
    flat = torch.cat([idx, torch.full((t, 1), e, device=device)], 1).reshape(-1)
    counts = torch.zeros(e + 1, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    assert torch.equal(ends.long(), counts.cumsum(0)), f"seed {seed}: expert ends"
    assert torch.equal(pairs.sort().values.long(), torch.arange(flat.numel(), device=device)), (
        f"seed {seed}: not a permutation"
    )
    assert torch.equal(flat[pairs.long()], flat.sort().values), f"seed {seed}: not grouped by expert"


def test_strided_single_expert_routing(device: str) -> None:
    """k = 1 routing sliced from a wider tensor: its [T, 1] view flattens to a strided view,
    which the pair sort once read as if contiguous (routed experts alone and with the shared)."""
    seed = random.randrange(2**31)
    c = _case(seed, 6, 8, 48, 40, 1, device)
    assert not c["idx"].reshape(-1).is_contiguous()
    w = c["w"]
    routed = run_experts(c["x"], (w["w1"], w["w3"], w["w2"]), None, 0, c["idx"], c["rw"], 0.6, None)
    _check(routed, _reference({**c, "s": {n: torch.zeros_like(v) for n, v in c["s"].items()}}, 0.6), seed)
    _check(_run(c, 0.6), _reference(c, 0.6), seed)


def test_batch_invariant(device: str) -> None:
    """A token alone gives the bits it gets inside a batch."""
    seed = random.randrange(2**31)
    c = _case(seed, 12, 8, 48, 40, 4, device)
    batch = _run(c, 0.6)
    for r in range(12):
        alone = _run({**c, "x": c["x"][r : r + 1], "idx": c["idx"][r : r + 1], "rw": c["rw"][r : r + 1]}, 0.6)
        assert torch.equal(alone[0], batch[r]), f"seed {seed}: token {r} alone differs from the batch"


def test_op_on_this_device(device: str) -> None:
    """The op: the launcher on a GPU, the reference (bit for bit) on CPU."""
    seed = random.randrange(2**31)
    c = _case(seed, 5, 4, 64, 32, 2, device)
    w, s = c["w"], c["s"]
    op = torch.ops.deepinfer.moe_experts_shared(
        c["x"], w["w1"], w["w3"], w["w2"], s["w1"], s["w3"], s["w2"], c["idx"], c["rw"], 0.6
    )
    assert torch.equal(op, _run(c, 0.6) if device == "cuda" else _reference(c, 0.6)), f"seed {seed}"


@pytest.mark.parametrize("bad", ["shape", "dtype", "layout"])
def test_bad_shared_weight_is_a_clear_error(device: str, bad: str) -> None:
    seed = random.randrange(2**31)
    c = _case(seed, 3, 4, 48, 40, 2, device)
    sw3 = c["s"]["w3"]
    c["s"]["w3"] = {"shape": sw3[:-1], "dtype": sw3.double(), "layout": sw3.T.contiguous().T}[bad]
    with pytest.raises(ValueError, match=r"moe_experts_shared: sw3 must be a contiguous torch.float32 \(40, 48\)"):
        _run(c, 0.6)


def test_fp8_experts_refuse_the_shared_expert(device: str) -> None:
    seed = random.randrange(2**31)
    c = _case(seed, 3, 4, 64, 32, 2, device)
    w8 = tuple(c["w"][n].to(torch.float8_e4m3fn) for n in ("w1", "w3", "w2"))
    scales = tuple(torch.ones(4, -(-v.shape[1] // 16), -(-v.shape[2] // 16), device=device) for v in w8)
    with pytest.raises(ValueError, match="shared expert folds into bf16/fp32 experts only"):
        run_experts(
            c["x"], w8, scales, 16, c["idx"], c["rw"], 0.6, None, shared=(c["s"]["w1"], c["s"]["w3"], c["s"]["w2"])
        )


# --- GPU: bf16 at the P8 benchmark's widths (D 4096, I 2048, E 64, k 6) ----------------------


@pytest.fixture(scope="module")
def p8_case() -> dict:
    seed = random.randrange(2**31)
    c = _case(seed, 4096, 64, 4096, 2048, 6, "cuda")
    return {
        "seed": seed,
        **c,
        "x": c["x"].bfloat16(),
        "w": {n: v.bfloat16() for n, v in c["w"].items()},
        "s": {n: v.bfloat16() for n, v in c["s"].items()},
    }


def _rows(c: dict, a: int, b: int) -> dict:
    return {**c, "x": c["x"][a:b].clone(), "idx": c["idx"][a:b].clone(), "rw": c["rw"][a:b].clone()}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("t", [1, 8, 256, 4096])
def test_p8_bf16_matches_reference(p8_case: dict, t: int) -> None:
    """Decode and prefill tiles against the reference (bf16 rounding apart), and each token of a
    decode batch alone gives its bits in the batch."""
    c = _rows(p8_case, 0, t)
    got = _run(c, 10.0)
    _check(got, _reference(c, 10.0), c["seed"], 2e-2)
    for r in {0, t // 2, t - 1} if t <= 256 else ():
        assert torch.equal(_run(_rows(c, r, r + 1), 10.0)[0], got[r]), f"seed {c['seed']}: token {r} alone differs"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_p8_cuda_graph_replay(p8_case: dict) -> None:
    """No host sync inside: the launches capture, and a replay with new routing matches eager."""
    c = _rows(p8_case, 0, 64)
    _run(c, 10.0)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _run(c, 10.0)
    new = _rows(p8_case, 64, 128)
    for n in ("x", "idx", "rw"):
        c[n].copy_(new[n])
    graph.replay()
    assert torch.equal(static_out, _run(c, 10.0)), f"seed {c['seed']}: graph replay differs from eager"
