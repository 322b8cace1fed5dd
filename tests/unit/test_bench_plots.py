"""The numbers behind the benchmark plots (DeepInfer's throughput accounting) and what each result records."""

from deepinfer_fx.bench.plots import decode_curves, prefill_curves


def test_decode_points_follow_steps_times_batch_times_accepted_over_cp() -> None:
    res = {
        "model": "P8",
        "nextn": 1,
        "cp": 2,
        "decode": [
            {"batch": 8, "context": 512, "ours_ms": 4.0, "hf_ms": None, "roofline_ms": 2.0},
            {"batch": 1, "context": 512, "ours_ms": 2.0, "hf_ms": 50.0, "roofline_ms": 1.0},
        ],
    }
    curves = decode_curves([res])
    # 250 steps/s x 2 tokens per step = 500 tok/s per user; x 8 requests / cp 2 = 2000 per GPU
    assert curves[("ours", 512, "P8")] == [(1000.0, 500.0, 1), (500.0, 2000.0, 8)]
    assert curves[("hf", 512, "P8")] == [(40.0, 20.0, 1)]  # rows without a peer number are skipped
    assert curves[("roofline", 512, "P8")][1] == (1000.0, 4000.0, 8)


def test_prefill_points_are_tokens_per_second_and_latency() -> None:
    res = {
        "cp": 1,
        "prefill": [
            {"tokens": 4096, "ours_ms": 50.0, "hf_ms": 400.0, "roofline_ms": 32.0},
            {"tokens": 1024, "ours_ms": 20.0},
        ],
    }
    curves = prefill_curves([res])
    assert curves["ours"] == [(1024, 51200.0, 20.0), (4096, 81920.0, 50.0)]
    assert curves["hf"] == [(4096, 10240.0, 400.0)] and curves["roofline"] == [(4096, 128000.0, 32.0)]


def test_run_info_takes_the_given_commit_over_git(monkeypatch) -> None:
    """The GPU machine gets a copied tree whose stale ``.git`` named an old commit."""
    from deepinfer_fx.bench.p8 import run_info

    monkeypatch.setenv("DEEPINFER_COMMIT", "abc1234")
    assert run_info(["--x"])["commit"] == "abc1234"
    monkeypatch.delenv("DEEPINFER_COMMIT")
    assert run_info(["--x"])["commit"] not in ("", "abc1234")  # git's HEAD here, or "unknown"


def test_run_info_records_the_settings_a_run_ran_with(monkeypatch) -> None:
    from deepinfer_fx.bench.p8 import run_info

    monkeypatch.setenv("DEEPINFER_PDL", "0")
    monkeypatch.setenv("DEEPINFER_COMMIT", "abc1234")
    monkeypatch.setenv("TORCHINDUCTOR_ENABLE_PDL", "1")
    env = run_info(["--x"])["env"]
    assert env["DEEPINFER_PDL"] == "0" and env["TORCHINDUCTOR_ENABLE_PDL"] == "1" and "DEEPINFER_COMMIT" not in env


def test_sweep_runs_one_command_per_segment() -> None:
    """The sweep (``bench/sweep.py``): prefill first, then decode per context; long contexts stop at 64
    requests; random weights have no peer to time."""
    from deepinfer_fx.bench.sweep import commands

    runs = commands(
        "o",
        ["512", "32768"],
        hf=True,
        random_weights=True,
        batches="1,16,128",
        chunks="1024,4096",
        steps=5,
        config="v41",
    )
    args = [r[3:] for r in runs]  # after: python -m deepinfer_fx.bench.p8_vs_hf
    assert all(a[:7] == ["--out", "o", "--config", "v41", "--random-weights", "--steps", "5"] for a in args)
    assert [a[7:] for a in args] == [
        ["--segments", "prefill", "--prefill-tokens", "1024,4096"],
        ["--segments", "decode", "--context", "512", "--batches", "1,16,128"],
        ["--segments", "decode", "--context", "32768", "--batches", "1,16"],
    ]
    peerless = commands("o", ["512"], hf=False, chunks="")
    assert len(peerless) == 1 and "--no-hf" in peerless[0] and "--random-weights" not in peerless[0]
    assert "--no-hf" not in commands("o", ["512"], hf=True)[0]
    assert commands("o", ["512"], hf=True)[0][5:7] == ["--config", "p8"]
