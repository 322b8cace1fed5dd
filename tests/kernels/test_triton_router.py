"""``deepinfer::route_topk`` on CUDA (``kernels/triton/router.py``) against ``graphs/moe.py::
route_weights``: the same experts (a near-tie may go either way), weights within a few ulp,
rows bit-identical alone and batched. Small cases run on CPU under ``TRITON_INTERPRET=1``; the
sm_90 compile is checked offline with ptxas."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from sm90_ptxas import PTXAS, compile_in_subprocess, compile_sm90, ptxas_report

from deepinfer_fx.graphs.moe import route_weights
from deepinfer_fx.kernels.triton.router import _route_kernel, route_topk_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
reference = route_weights.reference  # type: ignore[attr-defined]


def _inputs(seed: int, t: int, e: int, k: int, hashed: bool) -> tuple:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(t, e, generator=g) * 2
    bias = torch.randn(e, generator=g) * 0.3
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]) if hashed else None
    return logits.to(DEVICE), bias.to(DEVICE), None if ids is None else ids.to(DEVICE)


@pytest.mark.parametrize("kind", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("e,k", [(64, 6), (72, 8), (8, 2)])
@pytest.mark.parametrize("t", [1, 37])
def test_matches_the_reference(kind: str, e: int, k: int, t: int) -> None:
    seed = random.randrange(2**31)
    logits, bias, _ = _inputs(seed, t, e, k, False)
    temp, scale = random.choice([1.0, 1.7]), 2.5
    for norm in (True, False):
        idx, w = route_topk_triton(logits, bias, None, k, kind, temp, norm, scale)
        want_idx, _ = reference(logits, bias, None, k, kind, temp, norm, scale)
        assert idx.dtype == torch.int64 and w.dtype == torch.float32 and idx.shape == w.shape == (t, k)
        scores = reference(logits, None, torch.arange(e, device=DEVICE).expand(t, e), e, kind, temp, False, 1.0)[1]
        sel = scores + bias
        top = sel.sort(-1, descending=True).values
        clear = (top[:, k - 1] - top[:, k]) > 1e-5 * top[:, k - 1].abs().clamp(min=1)  # rows without a near-tie at k
        assert clear.float().mean() > 0.9, f"seed={seed}: the test's inputs tie too often"
        assert torch.equal(idx[clear].sort(-1).values, want_idx[clear].sort(-1).values), f"seed={seed} kind={kind}"
        # ids in descending order of score + bias, then the weights of exactly those ids
        picked = sel.gather(1, idx)
        assert (picked[:, :-1] >= picked[:, 1:]).all(), f"seed={seed}"
        _, want_w = reference(logits, None, idx, k, kind, temp, norm, scale)
        torch.testing.assert_close(w, want_w, rtol=2e-6, atol=1e-7, msg=f"seed={seed} kind={kind} norm={norm}")


@pytest.mark.parametrize("kind", ["sqrtsoftplus", "softmax"])
def test_hash_layers_take_the_given_ids(kind: str) -> None:
    seed = random.randrange(2**31)
    logits, _, ids = _inputs(seed, 21, 64, 6, True)
    idx, w = route_topk_triton(logits, None, ids, 6, kind, 1.0, True, 1.5)
    want_idx, want_w = reference(logits, None, ids, 6, kind, 1.0, True, 1.5)
    assert torch.equal(idx, want_idx) and idx.data_ptr() != ids.data_ptr()
    torch.testing.assert_close(w, want_w, rtol=2e-6, atol=1e-7, msg=f"seed={seed}")


def test_rows_alone_equal_rows_batched() -> None:
    seed = random.randrange(2**31)
    for hashed in (False, True):
        logits, bias, ids = _inputs(seed, 29, 64, 6, hashed)
        b = None if hashed else bias
        idx, w = route_topk_triton(logits, b, ids, 6, "sqrtsoftplus", 1.0, True, 2.5)
        for row in (0, 13, 28):
            one = route_topk_triton(
                logits[row : row + 1], b, None if ids is None else ids[row : row + 1], 6, "sqrtsoftplus", 1.0, True, 2.5
            )
            assert torch.equal(one[0][0], idx[row]) and torch.equal(one[1][0], w[row]), f"seed={seed} row={row}"


def test_ties_take_the_lowest_ids_and_bad_rows_stay_in_range() -> None:
    logits = torch.zeros(3, 16, device=DEVICE)
    logits[1, 5] = float("nan")
    logits[2] = float("nan")
    idx, w = route_topk_triton(logits, torch.zeros(16, device=DEVICE), None, 4, "sigmoid", 1.0, True, 1.0)
    assert idx[0].tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(w[0], torch.full((4,), 0.25, device=DEVICE))
    assert ((idx >= 0) & (idx < 16)).all(), idx  # never an id the expert kernels would read past


def test_empty_and_unsupported_shapes() -> None:
    logits, bias, _ = _inputs(1, 0, 64, 6, False)
    idx, w = route_topk_triton(logits, bias, None, 6, "sqrtsoftplus", 1.0, True, 1.0)
    assert idx.shape == w.shape == (0, 6)
    big, big_bias, _ = _inputs(2, 3, 2048, 4, False)  # more experts than a program holds: the reference
    got = route_topk_triton(big, big_bias, None, 4, "sigmoid", 1.0, False, 1.0)
    want = reference(big, big_bias, None, 4, "sigmoid", 1.0, False, 1.0)
    assert torch.equal(got[0].sort(-1).values, want[0].sort(-1).values) and torch.equal(
        got[1].sort(-1).values, want[1].sort(-1).values
    )


# --- offline compile for the H200 --------------------------------------------------------------

SM90_CASES = [(kind, hashed) for kind in (0, 1, 2) for hashed in (False, True)]


def _compile_for_sm90(out_dir: str) -> None:
    """PTX of each score kind, learned and hashed, at P8's 64 experts and top-6."""
    types = {"ids_ptr": "*i64", "idx_ptr": "*i64", "temp": "fp32", "scale": "fp32"}
    for kind, hashed in SM90_CASES:
        constants = {
            "E": 64,
            "EP": 64,
            "K": 6,
            "KP": 8,
            "KIND": kind,
            "HASHED": hashed,
            "NORM": True,
            "BT": 1,
            "PDL": True,
        }
        kernel = compile_sm90(_route_kernel, types, constants, align_pointers=False, num_warps=1)
        Path(out_dir, f"{kind}-{hashed}.ptx").write_text(kernel.asm["ptx"])


@pytest.fixture(scope="module")
def sm90_ptx(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return compile_in_subprocess("test_triton_router", tmp_path_factory.mktemp("sm90"))


@pytest.mark.skipif(PTXAS is None, reason="ptxas is not installed")
@pytest.mark.parametrize("kind,hashed", SM90_CASES)
def test_compiles_for_sm90_without_spills(kind: int, hashed: bool, sm90_ptx: Path) -> None:
    ptx = (sm90_ptx / f"{kind}-{hashed}.ptx").read_text()
    spills, registers, log = ptxas_report(ptx)
    assert spills == [0, 0] and registers <= 128, log
    assert "griddepcontrol.wait" in ptx, "PDL (kernels/triton/pdl.py)"
    assert "div.rn.f32" in ptx, "IEEE division, as the reference's"
    # one token a program keeps the k rounds' reductions short (router.py: 8 tokens on a warp
    # took 480 shuffles and 8.6 us a launch)
    assert ptx.count("shfl.sync") <= 100, ptx.count("shfl.sync")
