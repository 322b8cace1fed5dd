"""``bench/mesh.py`` under torchrun with gloo on the CPU: the issue-8 script runs end to end at the
demo widths, its meshes reproduce the one-process tokens and logprobs (also across an EPLB
shuffle with redundant experts), and every JSON carries positive step times and, where ep > 1,
positive all-to-all times. A launch costs ~20 s (2 ranks) and ~40 s (4 ranks) here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import deepinfer_fx
from deepinfer_fx.bench.mesh import main

REPO = Path(deepinfer_fx.__file__).resolve().parents[1]
SMALL = [
    "--tiny",
    "--requests",
    "8",
    "--max-tokens",
    "4",
    "--prompt-lens",
    "3,9,20",
    "--decode-batches",
    "2,4",
    "--prefill-tokens",
    "32",
    "--context",
    "16",
    "--budget",
    "32",
    "--steps",
    "2",
    "--warmup",
    "1",
    "--profile-steps",
    "1",
]


def _launch(tmp_path: Path, ranks: int, args: list[str], extra_experts: int | None = None) -> dict[str, dict]:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", "OMP_NUM_THREADS": "1"}
    if extra_experts is not None:
        env["DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS"] = str(extra_experts)
    out = tmp_path / "results"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(ranks),
        "-m",
        "deepinfer_fx.bench.mesh",
        *SMALL,
        *args,
        "--out",
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return {json.loads(p.read_text())["mesh"]: json.loads(p.read_text()) for p in out.glob("mesh_*.json")}


def _check(result: dict, eplb: bool, decode: tuple[int, ...] = (2, 4)) -> None:
    mesh, ep = result["mesh"], result["degrees"]["ep"]
    check = result["correctness"]
    assert result["ok"] and check["ok"] and check["tokens_equal"] and check["max_logprob_diff"] <= 1e-4, (mesh, check)
    assert result["command"].startswith(f"torchrun --nproc-per-node {result['world_size']} -m deepinfer_fx.bench.mesh")
    assert result["commit"] and result["model"]["dtype"] == "float32"
    experts = result["experts"]
    assert experts["rounded_to_ep"] and experts["n_physical"] % ep == 0, (mesh, experts)
    if eplb:
        assert check["eplb"]["slots_moved"] > 0, (mesh, check["eplb"])
    else:
        assert check["eplb"] is None
    assert {(r["kind"], r["size"]) for r in result["rows"]} == {("decode", b) for b in decode} | {("prefill", 32)}
    for row in result["rows"]:
        for side in ("mesh", "one_gpu"):
            assert row[side]["step_ms"] > 0 and row[side]["tok_s_per_gpu"] > 0, (mesh, row)
        m = row["mesh"]
        assert m["dropped_pairs"] == 0 and m["ep_capacity"] > 0, (mesh, row)
        if ep > 1:  # dispatch, metadata and combine per MoE layer; ragged steps exchange the counts first
            assert m["a2a_ms_per_layer_mean"] > 0 and m["a2a_bytes_sent_per_layer_per_rank"] > 0, (mesh, row)
            eager = result["engine"]["steps"]["mesh"].startswith("eager")
            # compiled prefill sends the routed pairs too (the ragged op); compiled decode the capacity
            assert m["ep_dispatch"] == ("ragged" if eager or row["kind"] == "prefill" else "static"), (mesh, row)
            assert m["a2a_calls_per_layer"] == (3 if m["ep_dispatch"] == "static" else 4), (mesh, row)
        else:
            assert m["a2a_ms_per_layer_max"] == 0 and m["a2a_calls_per_layer"] == 0, (mesh, row)


def test_two_ranks_ep2_dp2_cp2(tmp_path) -> None:
    results = _launch(tmp_path, 2, ["--mesh", "ep2", "dp2", "cp2"])
    assert set(results) == {"ep2", "dp2", "cp2"}
    for result in results.values():
        _check(result, eplb=False)
    # auto on the CPU: eager steps, on every mesh
    assert {m: r["engine"]["steps"]["mesh"] for m, r in results.items()} == {
        "ep2": "eager",
        "dp2": "eager",
        "cp2": "eager",
    }


def test_four_ranks_with_eplb_shuffle(tmp_path) -> None:
    # 8 experts + 3 extra on ep4: 12 slots, not 11 (rounded up to the EP degree)
    results = _launch(tmp_path, 4, ["--mesh", "ep4", "cp2,ep2", "--eplb"], extra_experts=3)
    assert set(results) == {"ep4", "cp2,ep2"}
    for result in results.values():
        _check(result, eplb=True)
        assert result["experts"]["n_physical"] == 12


@pytest.mark.parametrize(
    ("argv", "world", "message"),
    [
        (["--mesh", "ep2"], None, r"mesh ep2 needs 2 processes; launch with torchrun --nproc-per-node 2"),
        (["--mesh", "ep4"], "2", r"mesh ep4 needs 4 ranks but torchrun started 2; use --nproc-per-node 4"),
        (["--mesh", "ep2", "ep4"], "2", r"need different world sizes \[2, 4\]; launch once per world size"),
        (["--mesh", "ep4,cp3"], "12", r"must nest"),
        (["--mesh", "1"], None, r"every mesh needs 2\+ ranks"),
    ],
)
def test_errors_are_one_line(monkeypatch, argv: list[str], world: str | None, message: str) -> None:
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    with pytest.raises(SystemExit, match=message) as e:
        main(argv)
    assert "\n" not in str(e.value.code)


def test_compare_accepts_only_near_tie_flips() -> None:
    """A differing greedy token passes only where the reference's two candidates are within the
    tolerance and each run holds the other's token; logprob drift beyond it fails."""
    from deepinfer_fx.bench.mesh_checks import compare

    ref = [([5, 7], [{5: -1.00, 6: -1.01}, {7: -0.5, 8: -2.0}])]
    same = compare(ref, ref, 0.05)
    assert same["ok"] and same["tokens_equal"] and same["max_logprob_diff"] == 0
    tie = compare([([6, 9], [{6: -0.99, 5: -1.00}, {9: -0.1}])], ref, 0.05)
    assert tie["ok"] and not tie["tokens_equal"] and tie["near_tie_flips"] == 1
    assert tie["mismatched"] == [{"request": 0, "first_differing_token": 0, "near_tie": True}]
    real = compare([([6, 9], [{6: -0.99, 5: -1.00}, {9: -0.1}])], ref, 0.001)  # the gap (0.01) exceeds the tolerance
    assert not real["ok"] and real["near_tie_flips"] == 0
    drift = compare([([5, 7], [{5: -1.2, 6: -1.01}, {7: -0.5}])], ref, 0.05)
    assert not drift["ok"] and drift["tokens_equal"]


def test_compiled_steps_on_two_ranks(tmp_path) -> None:
    """The engine's compiled steps (aot_eager on the CPU) serve the requests and time the rows,
    including the all-to-all inside the graphs, before and after the EPLB shuffle."""
    # one decode bucket and four requests: each bucket compiles on both ranks and the reference
    args = ["--mesh", "ep2", "--steps-mode", "compiled", "--eplb", "--decode-batches", "2", "--requests", "4"]
    results = _launch(tmp_path, 2, args, extra_experts=2)
    result = results["ep2"]
    assert result["engine"]["steps"] == {"mesh": "compiled", "one_gpu": "compiled"}, result["engine"]
    _check(result, eplb=True, decode=(2,))
