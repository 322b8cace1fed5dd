"""Decode-PPL regression: the committed baseline holds, a perturbed copy fails, and two concurrent
refreshes of different workloads both land."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_fx.eval.__main__ import main
from deepinfer_fx.eval.ppl import BASELINE, compare, measure, store
from deepinfer_fx.eval.workloads import workload

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    return measure(workload("cpu-tiny"))


def test_baseline_holds(tiny):
    platform, got = tiny
    entry = json.loads(BASELINE.read_text()).get(platform, {}).get("cpu-tiny")
    if entry is None:  # exact floats belong to one ISA/dtype/kernel set; this machine's has no row yet
        pytest.skip(f"no baseline for {platform}: python -m deepinfer_fx.eval ppl --workload cpu-tiny --refresh")
    assert compare(entry["samples"], got) == []
    assert all(math.isfinite(s["ppl"]) and s["ppl"] > 1 for s in got)


def test_perturbed_sample_fails(tiny, tmp_path, capsys):
    platform, got = tiny
    copy = tmp_path / "ppl.json"
    store(copy, platform, "cpu-tiny", {"samples": got})
    assert main(["ppl", "--workload", "cpu-tiny", "--baseline", str(copy)]) == 0
    data = json.loads(copy.read_text())
    data[platform]["cpu-tiny"]["samples"][2]["ppl"] = math.nextafter(got[2]["ppl"], math.inf)  # one ulp
    copy.write_text(json.dumps(data))
    capsys.readouterr()
    assert main(["ppl", "--workload", "cpu-tiny", "--baseline", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "1 of 4 samples differ" in out and "sample 2: ppl" in out


def test_unknown_workload_one_line(capsys):
    assert main(["ppl", "--workload", "nope"]) == 2
    assert "unknown workload 'nope'" in capsys.readouterr().err


def test_concurrent_refreshes_both_land(tmp_path):
    shared = tmp_path / "ppl.json"
    shutil.copy(BASELINE, shared)  # other platforms' rows must survive too
    before = json.loads(shared.read_text())
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DEEPINFER_COMMIT": "test"}
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "deepinfer_fx.eval",
                "ppl",
                "--workload",
                name,
                "--refresh",
                "--baseline",
                str(shared),
            ],
            env=env,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for name in ("cpu-tiny", "cpu-tiny-long")
    ]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err.decode()[-2000:]
    after = json.loads(shared.read_text())
    platform = next(k for k, v in after.items() if v.get("cpu-tiny-long", {}).get("commit") == "test")
    assert after[platform]["cpu-tiny"]["commit"] == "test"
    assert len(after[platform]["cpu-tiny-long"]["samples"]) == 2
    for other in set(before) - {platform}:
        assert after[other] == before[other]


def test_refresh_waits_for_the_lock(tmp_path):
    import fcntl
    import threading
    import time

    shared = tmp_path / "ppl.json"
    store(shared, "p", "first", {"samples": []})
    with open(shared, "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another node mid-refresh
        writer = threading.Thread(target=store, args=(shared, "p", "second", {"samples": []}))
        writer.start()
        time.sleep(0.3)
        assert writer.is_alive() and "second" not in shared.read_text()
        fcntl.flock(held, fcntl.LOCK_UN)
    writer.join(timeout=10)
    assert sorted(json.loads(shared.read_text())["p"]) == ["first", "second"]
