"""Speculative decoding on meshes (gloo, CPU, fp32, tiny V4 and V4.1): n-gram and MTP-1 drafts on
ep2, dp2 and dp2 x ep2, DSpark drafts on ep2 and dp2, eager and compiled, give one process's
greedy tokens without speculation,
token for token, with drafts accepted and rejected (so verify steps and rollback re-runs run)
over requests of uneven work: some turns have one rank verifying while another prefills or
idles, and a rank with nothing of its own to verify or re-run then runs padding steps of the
agreed sizes (counted on every rank). MTP-1 keeps drafting after an EPLB shuffle (its experts
move with the trunk's); V4.1's DSpark drafter (its own 4 experts of top-2 beside the trunk's 8 of
top-2) runs its MoE over an EP group of its own, before and after the trunk's EPLB shuffle. What
is not built refuses at start: speculation with context parallelism. The ranks run
``spec_mesh_job.py`` under torchrun."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mesh_requests import spec_requests
from test_dspark import v41_dspark

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.engine.spec_config import SpeculativeConfig, check_mesh
from deepinfer_fx.sharding.eplb import num_physical_experts
from deepinfer_fx.sharding.mesh import MeshSpec

JOB = Path(__file__).with_name("spec_mesh_job.py")
REPO = Path(deepinfer_fx.__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "engine"))  # the models the job serves

from test_spec_decode import _tiny_model  # noqa: E402
from test_spec_drafters import drafting  # noqa: E402


def _one_process(model) -> list[list[int]]:
    reqs = spec_requests()
    llm = LLM(model, device="cpu", eager=True, max_model_len=96, num_threads=1)
    outs = llm.generate([r["prompt"] for r in reqs], [SamplingParams(**r["params"]) for r in reqs])
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain() -> dict[str, list[list[int]]]:
    """One eager process without speculation: the cycling models' tokens (V4 with MTP-1, V4.1 with
    DSpark) and the random one's."""
    return {
        "cycle": _one_process(drafting("mtp-v4")),
        "dspark": _one_process(drafting("dspark-v41")),
        "oracle": _one_process(_tiny_model("v4")),
    }


def _launch(tmp_path: Path, plain: dict, runs: list[str], ranks: int = 2, **settings: str) -> dict:
    """``spec_mesh_job.py`` on ``ranks`` ranks over ``runs`` (``settings``: DEEPINFER_* variables
    for the ranks); every run that was not refused gives the one-process tokens."""
    (tmp_path / "ref.json").write_text(json.dumps(plain["oracle"]))
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    env.update(settings)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd += [str(JOB), str(tmp_path / "out.json"), str(tmp_path / "ref.json"), *runs]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    got = json.loads((tmp_path / "out.json").read_text())
    for run, res in got.items():
        if "error" not in res:
            method = run.partition(":")[2].partition("+")[0]
            want = plain[method if method in ("oracle", "dspark") else "cycle"]
            assert res["tokens"] == want, run
    return got


def _speculated(res: dict, ranks: int) -> None:
    """Drafts accepted and rejected; every rank verified; padding verify steps ran where a rank
    had none of its own while another had; no rank re-ran anything after a rejection (the rings
    keep room for the rejected rows)."""
    drafted, accepted = (sum(d[j] for d in res["drafts"]) for j in (0, 1))
    assert 0 < accepted < drafted, res["drafts"]
    steps = res["steps"]
    assert len(steps) == ranks and all(s["verify"] > 0 for s in steps), steps
    assert any(s["padding verify"] > 0 for s in steps), steps
    assert all(s["undrafted prefill"] == 0 for s in steps), steps


def test_ngram_and_mtp_on_ep2_and_dp2(tmp_path: Path, plain: dict) -> None:
    """Eager: off, n-gram (its own drafts on the cycling model; the oracle's on the random one),
    MTP-1 before and after an EPLB shuffle, and n-gram on dp2; then the refusals."""
    runs = ["ep2:off", "ep2:ngram", "ep2:oracle", "ep2:mtp+eplb", "dp2:ngram", "cp2:ngram"]
    got = _launch(tmp_path, plain, runs)
    assert got["ep2:off"]["drafts"] == [[0, 0]] * 5
    for run in ("ep2:ngram", "ep2:oracle", "ep2:mtp", "ep2:mtp+eplb", "dp2:ngram"):
        _speculated(got[run], 2)
    assert got["ep2:mtp+eplb"]["placement"] != got["ep2:mtp"]["placement"]  # the shuffle moved experts
    assert got["ep2:mtp+eplb"]["drafts"] == got["ep2:mtp"]["drafts"]
    assert "not built with context parallelism" in got["cp2:ngram"]["error"]


def test_dspark_on_ep2_with_its_own_expert_group(tmp_path: Path, plain: dict) -> None:
    """DSpark's MoE (4 experts) on its own EP group beside the trunk's (8), every rank drafting in every step (padding blocks where it has none); after the trunk's
    EPLB shuffle the drafter keeps its placement and its drafts; and on dp2 (no EP); and on ep2
    drafting through the block-FP8 copy of the head."""
    got = _launch(tmp_path, plain, ["ep2:dspark+eplb", "dp2:dspark", "ep2:dspark+fp8head"])
    for run in ("ep2:dspark", "ep2:dspark+eplb", "dp2:dspark", "ep2:dspark+fp8head"):
        _speculated(got[run], 2)
    for run, ep in (("ep2:dspark", 2), ("dp2:dspark", 1)):  # each set's own placement, 32 extra slots
        assert got[run]["slots"] == [num_physical_experts(n, ep) // ep for n in (8, 4)], got[run]["slots"]
    assert got["ep2:dspark+eplb"]["placement"] != got["ep2:dspark"]["placement"]
    assert got["ep2:dspark+eplb"]["drafts"] == got["ep2:dspark"]["drafts"]


def test_compiled_ngram_on_ep2(tmp_path: Path, plain: dict) -> None:
    """Compiled steps (aot_eager on the CPU): the ranks agree on the verify and re-run graphs and
    buckets too, so a rank pads them with the same graph keys as the rank that has the work."""
    got = _launch(tmp_path, plain, ["ep2@compiled:oracle"])
    _speculated(got["ep2@compiled:oracle"], 2)


def test_compiled_mtp_on_ep2(tmp_path: Path, plain: dict) -> None:
    """MTP-1's block runs in every compiled step, its MoE over the EP group, padded steps too (the
    slowest test here: the drafter's pieces compile for every bucket)."""
    got = _launch(tmp_path, plain, ["ep2@compiled:mtp"])
    _speculated(got["ep2@compiled:mtp"], 2)


def test_confidence_scheduled_dspark_on_ep2(tmp_path: Path, plain: dict) -> None:
    """DEEPINFER_ENABLE_MTP_VARLEN=1: each rank picks its requests' draft lengths from DSpark's
    confidences and its own step-time curve; the verify sizes are agreed in the lock step."""
    got = _launch(tmp_path, plain, ["ep2:dspark"], DEEPINFER_ENABLE_MTP_VARLEN="1")
    assert got["ep2:dspark"]["varlen"]
    _speculated(got["ep2:dspark"], 2)


def test_compiled_dspark_on_ep2(tmp_path: Path, plain: dict) -> None:
    """Compiled DSpark: every step graph drafts, its stages' MoE over the drafter's own EP group
    at the capacity of the engine's draft blocks, padding ranks' graphs too."""
    got = _launch(tmp_path, plain, ["ep2@compiled:dspark"])
    _speculated(got["ep2@compiled:dspark"], 2)


def test_ngram_and_mtp_on_dp2_ep2(tmp_path: Path, plain: dict) -> None:
    """Four ranks, two EP groups: five requests dealt round-robin, so one rank serves two."""
    got = _launch(tmp_path, plain, ["dp2,ep2:ngram", "dp2,ep2:oracle", "dp2,ep2:mtp"], ranks=4)
    for run in ("dp2,ep2:ngram", "dp2,ep2:oracle", "dp2,ep2:mtp"):
        _speculated(got[run], 4)


def test_refusals_name_what_runs() -> None:
    c = config_from_dict(v41_dspark())
    for method in ("ngram", "mtp", "dspark"):
        with pytest.raises(ValueError, match=r"on mesh cp2,ep2: speculation is not built with context parallelism"):
            check_mesh(SpeculativeConfig(method, 3), MeshSpec(cp=2, ep=2))
        check_mesh(SpeculativeConfig(method, 3), MeshSpec(dp=2, ep=2))
    assert c.dspark_n_routed_experts != c.n_routed_experts  # the drafter the mesh tests run has its own experts
