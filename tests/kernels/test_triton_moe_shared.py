"""The shared expert folded into the Triton routed experts (``deepinfer::moe_experts_shared``,
``kernels/triton/moe.py``) against ``graphs/moe.py::experts_with_shared``: every token's extra
pair (expert E, weight 1) derived in the kernels, the combine's order (routed sum, then shared),
batch invariance, refused layouts, and an offline sm_90 compile of the changed kernels.

On CPU the launchers run under Triton's interpreter with fp32 inputs and tiny widths; on a GPU
the same tests run compiled, plus bf16 at the P8 benchmark's widths. Every case draws a fresh
seed and names it in its assert messages. The swap that puts the op in a step is
``tests/compile/test_moe_shared_swap.py``.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from sm90_ptxas import PTXAS, compile_in_subprocess, compile_sm90, ptxas_report

from deepinfer_fx.graphs.moe import experts_with_shared
from deepinfer_fx.kernels.triton.moe import Tiles, moe_experts_shared_triton, run_experts, sort_pairs, tile_smem


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


# --- offline compile for the H200 --------------------------------------------------------------

# (bm, bn, bk, group_m, warps, stages, half) of choose_tiles' decode and prefill tiles at P8 widths
# (narrow: the T = 1 tiles at 4 stages, and at 3 as ``_one_wave`` picks them with the fold)
_P8_TILES = {
    "decode": ((16, 128, 128, 1, 4, 3, False), (16, 128, 128, 1, 4, 3, False)),
    "narrow4": ((16, 32, 128, 1, 4, 4, False), (16, 32, 128, 1, 4, 4, False)),
    "narrow3": ((16, 32, 128, 1, 4, 3, False), (16, 32, 128, 1, 4, 3, False)),
    "prefill": ((128, 128, 64, 16, 8, 3, True), (128, 256, 64, 8, 8, 4, True)),
}


def _compile_for_sm90(out_dir: str) -> None:
    """PTX for sm_90 of the gate/up and down kernels (bf16, D 4096, I 2048, 64 experts, k 6) and
    of the pair sort and the combine, with and without the shared expert, into ``out_dir`` (run in a child
    process without the interpreter, see ``sm90_ptxas.compile_in_subprocess``). Pointers,
    strides and widths carry the 16-divisibility a real launch at these sizes specialises on."""
    from deepinfer_fx.kernels.triton.moe import Tiles, fp4_tiles
    from deepinfer_fx.kernels.triton.moe_kernels import (
        combine_kernel,
        count_pairs_kernel,
        down_kernel,
        gate_up_kernel,
        place_pairs_kernel,
        sort_pairs_one_kernel,
    )

    def emit(kernel, name: str, types: dict, consts: dict, warps: int, stages: int) -> None:
        compiled = compile_sm90(
            kernel,
            types,
            consts,
            lambda a: a.startswith("stride") or a in ("N", "SPAN", "D"),
            num_warps=warps,
            num_stages=stages,
        )
        Path(out_dir, f"{name}.ptx").write_text(compiled.asm["ptx"])
        Path(out_dir, f"{name}.smem").write_text(str(compiled.metadata.shared))

    bf16 = dict.fromkeys(
        (
            "x_ptr",
            "w1_ptr",
            "w3_ptr",
            "sw1_ptr",
            "sw3_ptr",
            "s1_ptr",
            "s3_ptr",
            "h_ptr",
            "w2_ptr",
            "sw2_ptr",
            "s2_ptr",
            "y_ptr",
        ),
        "*bf16",
    )
    types = {
        **bf16,
        "pairs_ptr": "*i32",
        "rw_ptr": "*fp32",
        "ends_ptr": "*i32",
        "limit": "fp32",
        "idx_ptr": "*i64",
        "hist_ptr": "*i32",
        "cursor_ptr": "*i32",
    }
    common = {"E_P": 128, "FP8": False, "FP4": False, "QBLOCK": 1, "EVEN": True, "PREC": "tf32", "PDL": True}
    for shared in (False, True):
        for kind, (g, d) in _P8_TILES.items():
            emit(
                gate_up_kernel,
                f"gate_up-{kind}-{shared}",
                types,
                {
                    **common,
                    "K": 4096,
                    "TOPK": 6,
                    "SHARED": shared,
                    "BM": g[0],
                    "BN": g[1],
                    "BK": g[2],
                    "GROUP_M": g[3],
                    "CLAMP": True,
                    "HALF": g[6],
                },
                g[4],
                g[5],
            )
            emit(
                down_kernel,
                f"down-{kind}-{shared}",
                types,
                {
                    **common,
                    "K": 2048,
                    "SHARED": shared,
                    "BM": d[0],
                    "BN": d[1],
                    "BK": d[2],
                    "GROUP_M": d[3],
                    "HALF": d[6],
                },
                d[4],
                d[5],
            )
            if not shared:  # MXFP4 weights (uint8 codes and ue8m0 scales) at the tiles moe.py picks for them
                fp4 = {**types, **dict.fromkeys(("w1_ptr", "w3_ptr", "w2_ptr", "s1_ptr", "s3_ptr", "s2_ptr"), "*u8")}
                g4, d4 = fp4_tiles(Tiles(*g), Tiles(*d), 2048, 4096)
                emit(
                    gate_up_kernel,
                    f"fp4-gate_up-{kind}",
                    fp4,
                    {
                        **common,
                        "FP4": True,
                        "K": 4096,
                        "TOPK": 6,
                        "SHARED": False,
                        "BM": g4[0],
                        "BN": g4[1],
                        "BK": g4[2],
                        "GROUP_M": g4[3],
                        "CLAMP": True,
                        "HALF": g4[6],
                    },
                    g4[4],
                    g4[5],
                )
                emit(
                    down_kernel,
                    f"fp4-down-{kind}",
                    fp4,
                    {
                        **common,
                        "FP4": True,
                        "K": 2048,
                        "SHARED": False,
                        "BM": d4[0],
                        "BN": d4[1],
                        "BK": d4[2],
                        "GROUP_M": d4[3],
                        "HALF": d4[6],
                    },
                    d4[4],
                    d4[5],
                )
        sort = {"TOPK": 6, "SHARED": shared, "E_P": 128, "CHUNK": 256, "PDL": True}
        emit(count_pairs_kernel, f"count-{shared}", types, sort, 4, 3)
        emit(
            place_pairs_kernel, f"place-{shared}", types, {**sort, "G_P": 64, "G_ROWS": 32}, 4, 3
        )  # moe.py's rule at E_P 128
        emit(sort_pairs_one_kernel, f"sort_one-{shared}", types, sort, 4, 3)
        # each token's k (+ the shared) bf16 expert rows summed into fp32, as moe.py launches it at D 4096
        emit(
            combine_kernel,
            f"combine-{shared}",
            {**types, "out_ptr": "*fp32"},
            {"TOPK": 6 + shared, "BD": 1024, "PDL": True},
            4,
            3,
        )


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("kind", list(_P8_TILES))
@pytest.mark.parametrize("kernel", ["gate_up", "down"])
def test_fp4_kernels_compile_for_sm90_without_spills(kernel: str, kind: str, sm90_ptx: Path) -> None:
    """The MXFP4 path decodes its weight tiles in registers: at the tiles moe.py picks for it
    (narrower than bf16's where those spilled) it compiles for the H200 with no spills, on
    tensor cores."""
    ptx = (sm90_ptx / f"fp4-{kernel}-{kind}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 255, log
    assert "mma" in ptx


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_triton_moe_shared", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("shared", [False, True], ids=["routed", "shared"])
@pytest.mark.parametrize(
    "kernel",
    [
        "gate_up-decode",
        "down-decode",
        "gate_up-narrow4",
        "down-narrow4",
        "gate_up-narrow3",
        "down-narrow3",
        "gate_up-prefill",
        "down-prefill",
        "count",
        "place",
        "sort_one",
        "combine",
    ],
)
def test_kernels_compile_for_sm90_without_spills(kernel: str, shared: bool, sm90_ptx: Path) -> None:
    """Both variants compile for the H200 with no spills; the GEMMs on tensor cores. The shared
    variant selects a base pointer per block and should cost no more than a few registers."""
    ptx = (sm90_ptx / f"{kernel}-{shared}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 255, log
    if kernel.startswith(("gate_up", "down")):
        assert "mma" in ptx
        _, routed_registers, _ = ptxas_report((sm90_ptx / f"{kernel}-False.ptx").read_text())
        assert registers <= routed_registers + 16, (
            f"{kernel}: {registers} registers, {routed_registers} without the shared expert"
        )
    assert "griddepcontrol.wait" in ptx, "PDL (kernels/triton/pdl.py)"
    if kernel == "combine":  # reads only what the down GEMM wrote: nothing before the wait; rows in 16-byte vectors
        lines = [line.strip() for line in ptx.splitlines()]
        wait = next(i for i, line in enumerate(lines) if line.startswith("griddepcontrol.wait;"))
        assert not any("ld.global" in line for line in lines[:wait]), "a load before the wait"
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("kind", ["decode", "narrow4", "narrow3"])
@pytest.mark.parametrize("kernel", ["gate_up", "down"])
def test_decode_tiles_shared_memory_is_what_the_one_wave_rule_assumes(kernel: str, kind: str, sm90_ptx: Path) -> None:
    """``moe.tile_smem`` (which sizes the narrow tiles' pipeline so that a launch is one wave)
    against the compiler's figure for sm_90, bf16."""
    gated = kernel == "gate_up"
    tiles = Tiles(*_P8_TILES[kind][0 if gated else 1])
    for shared in (False, True):
        assert int((sm90_ptx / f"{kernel}-{kind}-{shared}.smem").read_text()) == tile_smem(tiles, gated), (
            kernel,
            kind,
            shared,
        )
