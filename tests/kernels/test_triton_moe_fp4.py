"""The MXFP4 routed experts on a GPU at the P8 benchmark's widths (D 4096, I 2048, E 64, k 6):
Triton's microscaled dot, the codes decoded in PTX (``Tiles.fp4_bits``), and on sm_90 the Gluon
GEMMs (``moe_fp4_wgmma.py``, ``moe_fp4_tall.py``): each against the bf16 math over the dequantised
weights, against each other, and a token alone against its batches, bit for bit. The refusals
run on the CPU too; the interpreted kernels and the sm_90 compiles are ``test_moe_kernels_interpreted.py``,
``test_moe_fp4_wgmma.py`` and ``test_moe_fp4_tall.py``. Fresh seeds, named in failures."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer_fx.io.quant import dequant_mxfp4, quant_mxfp4
from deepinfer_fx.kernels.triton.moe import moe_experts_fp4_triton, moe_experts_triton
from deepinfer_fx.kernels.triton.moe_tiles import choose_tiles, expert_tiles
from moe_cases import check_close, cuda_only, moe_case, p8_case, reference


@pytest.fixture(scope="module")
def p8_weights() -> dict:
    return p8_case()


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
    check_close(_run_fp4(q, c, 10.0, triton_only), want, c["seed"], 2e-2)


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
    check_close(moe_experts_fp4_triton(c["x"], *w4, c["idx"], c["rw"], 10.0, wgmma=True), want, c["seed"], 1e-2)


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
    check_close(got, reference(deq, 10.0, c["x"], c["idx"], c["rw"]), c["seed"], 2e-2)


def test_fp4_bits_tiles_refuse_without_a_gpu_or_fp4_weights() -> None:
    """The PTX decode cannot run in the interpreter, and means nothing for bf16 weights: both
    refuse by name rather than run another decode."""
    seed = random.randrange(2**31)
    c = moe_case(seed, 3, 4, 64, 32, 2, "cpu")
    tiles = _fp4_bits_tiles(3, True)
    q = {n: tuple(t.view(torch.uint8) for t in quant_mxfp4(v)) for n, v in c["w"].items()}
    w4 = (q["w1"][0], q["w1"][1], q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1])
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="fp4_bits tiles decode MXFP4 weights in PTX"):
            moe_experts_fp4_triton(c["x"], *w4, c["idx"], c["rw"], 0.6, tiles=tiles)
    w = c["w"]
    with pytest.raises(ValueError, match="they need MXFP4 weights"):
        moe_experts_triton(c["x"], w["w1"], w["w3"], w["w2"], c["idx"], c["rw"], 0.6, tiles=tiles)
