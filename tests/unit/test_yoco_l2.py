"""examples/yoco/l2.py on tiny random V4.1 checkpoints (CPU fp32): at the exact bound compact
and exact agree to the noise floor; at KEEP = the window the drift per position is reported.
With a DSpark head the drafts and confidences are compared too, and a prompt no longer than
KEEP (every row kept) must give bit-identical logprobs, drafts and confidences, which a
perturbed compact run fails. On 2 gloo ranks (``--mesh ep2``) exact on the mesh matches one
process and every rank reports its rows; meshes the script cannot run are refused."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "examples" / "yoco"))
sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
import l2  # noqa: E402
import l2_runs  # noqa: E402
from tiny import tiny_v41  # noqa: E402

import deepinfer_fx  # noqa: E402


def _write(path: Path, cfg: dict, seed: int) -> str:
    del cfg["engram_compressed_vocab_size"], cfg["engram_num_embeddings"]  # the writer derives them from its tokenizer
    deepinfer_fx.write_random_checkpoint(path, cfg, seed=seed)
    return str(path)


@pytest.fixture(scope="module")
def dspark_ckpt(tmp_path_factory) -> tuple[str, int]:
    """Three DSpark stages after the tiny V4.1 trunk, reading layers 5..7 (tests/models/test_dspark.py's)."""
    seed = random.SystemRandom().randrange(2**31)
    cfg = tiny_v41(
        num_nextn_predict_layers=3,
        compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1] + [0, 0, 0],
        dspark_target_layer_ids=[5, 6, 7],
        dspark_n_routed_experts=4,
        dspark_num_experts_per_tok=2,
        dspark_block_size=5,
        dspark_noise_token_id=299,
        dspark_markov_rank=16,
    )
    return _write(tmp_path_factory.mktemp("dspark") / "ckpt", cfg, seed), seed


def test_l2_reports_drift_per_position(tmp_path) -> None:
    ckpt = _write(tmp_path / "ckpt", tiny_v41(), seed=4)
    common = ["--model", ckpt, "--prompt-len", "40", "--decode", "3", "--chunk", "16"]
    exact = l2.main([*common, "--keep", "29", "--out", str(tmp_path / "l2.json")])  # window 8 + 3 x 7: exact
    assert len(exact["rows"]) == 4 and (tmp_path / "l2.json").exists()
    assert not exact["dspark"] and "same_drafts" not in exact["rows"][0]  # no DSpark weights: logprobs only
    assert exact["max_abs"] <= max(10 * exact["noise_max_abs"], 1e-4), exact["max_abs"]
    bounded = l2.main([*common, "--keep", "8"])
    assert 0 < bounded["max_abs"] < 5.0


def test_l2_dspark_drafts_and_the_exact_bound(dspark_ckpt, tmp_path) -> None:
    ckpt, seed = dspark_ckpt
    prompt = random.SystemRandom().randrange(2**31)
    common = ["--model", ckpt, "--decode", "3", "--seed", str(prompt)]
    msg = f"checkpoint seed={seed} prompt seed={prompt}"
    # prompt 13 <= KEEP 16: every row kept, chunks of 5 -> bit for bit (main exits non-zero otherwise)
    r = l2.main([*common, "--prompt-len", "13", "--keep", "16", "--chunk", "5"])
    assert r["dspark"] and r["exact_bound"] and r["bitwise"], msg
    assert len(r["rows"]) == 4 and all(x["same_drafts"] and x["conf_abs"] == 0 == x["max_abs"] for x in r["rows"]), msg
    # KEEP = the window on a longer prompt: drafts and confidences reported, nothing enforced
    r = l2.main([*common, "--prompt-len", "30", "--keep", "8", "--chunk", "12"])
    assert r["dspark"] and not r["exact_bound"] and 0 <= r["conf_max_abs"] <= 1 and 0 <= r["drafts_agree"] <= 1, msg
    assert {"same_drafts", "conf_abs"} <= set(r["rows"][0]), msg
    r = l2.main([*common, "--prompt-len", "13", "--keep", "16", "--no-dspark"])
    assert not r["dspark"] and r["bitwise"] and "same_drafts" not in r["rows"][0], msg


@pytest.mark.parametrize("what", ["logits", "drafter-context"])
def test_l2_exact_bound_catches_a_perturbed_compact_run(dspark_ckpt, tmp_path, monkeypatch, what: str) -> None:
    """Compact made to differ by one logit, or (logits untouched) by the streams the drafter's
    context reads: the bitwise check at the exact bound fails, and the JSON shows where."""
    forward_batch = l2_runs.forward_batch

    def perturbed(params, state, c, batch, captured=None, replay=None, **kw):
        logits, X = forward_batch(params, state, c, batch, captured=captured, replay=replay, **kw)
        if replay is not None:  # the compact prefill only
            if what == "logits":
                logits = logits.clone()
                logits[-1, 7] += 1e-3
            else:
                for layer in captured:
                    captured[layer] = captured[layer] + 0.05  # not a scale: main_norm would undo it
        return logits, X

    monkeypatch.setattr(l2_runs, "forward_batch", perturbed)
    out = tmp_path / "l2.json"
    args = ["--model", dspark_ckpt[0], "--prompt-len", "12", "--keep", "16", "--decode", "2", "--out", str(out)]
    with pytest.raises(SystemExit, match="bit for bit"):
        l2.main(args)
    rows = json.loads(out.read_text())["rows"]
    if what == "logits":
        assert rows[0]["max_abs"] > 0
    else:
        assert all(r["max_abs"] == 0 for r in rows) and max(r["conf_abs"] for r in rows) > 0


def test_l2_on_an_ep2_mesh(dspark_ckpt) -> None:
    ckpt, seed = dspark_ckpt
    prompt = random.SystemRandom().randrange(2**30)
    common = ["--model", ckpt, "--prompt-len", "20", "--keep", "8", "--decode", "2", "--chunk", "8"]
    common += ["--seed", str(prompt)]
    msg = f"checkpoint seed={seed} prompt seed={prompt}"
    mesh = l2.main([*common, "--mesh", "ep2"])
    assert mesh["mesh"] == "ep2" and [r["rank"] for r in mesh["ranks"]] == [0, 1], msg
    assert [r["seed"] for r in mesh["ranks"]] == [prompt, prompt + 1], msg  # each rank its own prompt
    for r in mesh["ranks"]:
        assert len(r["rows"]) == len(r["reference"]) == 3 and r["dspark"], msg
        assert r["reference_max_abs"] <= 1e-5, f"{msg} rank {r['rank']}: mesh vs one process {r['reference_max_abs']}"
        assert r["reference_summary"]["drafts_agree"] == 1.0 and r["reference_summary"]["conf_max_abs"] <= 1e-5, msg
    # rank 0 ran seed `prompt`, as one process does: the same compact-vs-exact drift
    alone = l2.main(common)
    for a, b in zip(alone["rows"], mesh["ranks"][0]["rows"]):
        assert abs(a["max_abs"] - b["max_abs"]) <= 1e-5 and abs(a["conf_abs"] - b["conf_abs"]) <= 1e-5, msg


@pytest.mark.parametrize(
    "mesh, why", [("cp2", "context parallelism"), ("ep2,dp2", "one EP group"), ("tp2", "unknown axis")]
)
def test_l2_refuses_meshes_it_cannot_run(mesh: str, why: str) -> None:
    with pytest.raises(SystemExit, match=why):
        l2.main(["--model", "unused", "--mesh", mesh])
