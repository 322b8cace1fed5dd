"""The CLI: the demo model runs end to end from a fresh state; bad arguments get clear errors."""

from __future__ import annotations

import subprocess
import sys

from deepinfer_fx import generate


def test_demo_cli_in_a_subprocess(tmp_path) -> None:
    env = {"DEEPINFER_DEMO_DIR": str(tmp_path / "demo"), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "deepinfer_fx.generate",
            "--prompt",
            "Hello there",
            "--prompt",
            "Good morning",
            "--max-tokens",
            "5",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert "[demo]" in r.stdout and "random weights" in r.stdout
    assert r.stdout.count("--- request") == 2 and "Hello there" in r.stdout
    assert "prefill:" in r.stdout and "tok/s" in r.stdout and "B/token" in r.stdout


def test_bad_arguments(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_DEMO_DIR", str(tmp_path / "demo"))
    assert generate.main(["--model", "/nonexistent/dir", "--max-tokens", "2"]) == 2
    assert "no such directory" in capsys.readouterr().err
    for argv, needle in (
        (["--top-p", "0"], "argument --top-p: must be a float in (0, 1], got 0"),
        (["--mesh", "xx9"], "bad mesh"),
        (["--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1, got 0"),
    ):
        try:
            generate.main(argv)
        except SystemExit as e:
            assert e.code == 2
        assert needle in capsys.readouterr().err
