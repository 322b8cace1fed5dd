"""The CLI's bad input: every option range-checked and every combination that would do nothing
refused, each with one argparse-style line; runtime failures (device, launch, damaged checkpoint)
as ``error: ...`` and exit code 2, never a traceback; ``--help`` answers without importing torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx import generate

REPO = Path(__file__).resolve().parents[2]
PROG = "python -m deepinfer_fx.generate: error: "


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny")
    deepinfer_fx.write_random_checkpoint(path, tiny_v4(), seed=2)
    return path


def _usage_error(argv: list[str], capsys) -> str:
    """The one error line argparse printed (after its usage line) for ``argv``."""
    with pytest.raises(SystemExit) as e:
        generate.main(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("usage: ") and lines[-1].startswith(PROG), lines
    return lines[-1].removeprefix(PROG)


def _runtime_error(argv: list[str], capsys) -> str:
    assert generate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and not any("Traceback" in line for line in err), err
    return err[-1].removeprefix("error: ")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--max-model-len", "0"], "argument --max-model-len: must be an integer >= 1, got 0"),
        (["--max-model-len", "-5"], "argument --max-model-len: must be an integer >= 1, got -5"),
        (["--max-model-len", "1e3"], "argument --max-model-len: must be an integer >= 1, got '1e3'"),
        (["--max-num-seqs", "0"], "argument --max-num-seqs: must be an integer >= 1, got 0"),
        (["--max-num-batched-tokens", "x"], "argument --max-num-batched-tokens: must be an integer >= 1, got 'x'"),
        (["--max-tokens", "0"], "argument --max-tokens: must be an integer >= 1, got 0"),
        (["--threads", "0"], "argument --threads: must be an integer >= 1, got 0"),
        (["--seed", "-1"], "argument --seed: must be an integer >= 0, got -1"),
        (["--rank", "-1", "--dry-run"], "argument --rank: must be an integer >= 0, got -1"),
        (["--temperature", "-0.5"], "argument --temperature: must be a finite float >= 0, got -0.5"),
        (["--temperature", "nan"], "argument --temperature: must be a finite float >= 0, got nan"),
        (["--top-p", "0"], "argument --top-p: must be a float in (0, 1], got 0"),
        (["--top-p", "1.5"], "argument --top-p: must be a float in (0, 1], got 1.5"),
        (["--min-p", "-0.1"], "argument --min-p: must be a float in [0, 1], got -0.1"),
        (["--top-k", "-2"], "argument --top-k: must be -1 or 0 (off) or an integer >= 1, got -2"),
        (["--stop", ""], "argument --stop: must not be empty"),
        (["--mesh", "tp8"], "argument --mesh: bad mesh 'tp8'"),
        (["--dtype", "fp16"], "argument --dtype: invalid choice: 'fp16'"),
        (
            ["--rank", "3"],
            "argument --rank: only a --dry-run traces one chosen rank; under torchrun each process's rank "
            "comes from torchrun; drop --rank or add --dry-run",
        ),
        (
            ["--eager", "--dump-graphs", "d"],
            "argument --dump-graphs: acts on compiled steps, which --eager turns off; drop one of them",
        ),
        (
            ["--eager", "--disable-passes", "rope_kernel"],
            "argument --disable-passes: acts on compiled steps, which --eager turns off",
        ),
        (["--eager", "--no-inductor"], "argument --no-inductor: acts on compiled steps, which --eager turns off"),
        (["--eager", "--compile"], "argument --compile: not allowed with argument --eager"),
        (
            ["--dry-run", "--prompt", "hi"],
            "argument --prompt: has no effect with --dry-run (it traces one rank's steps on "
            "abstract weights; nothing is generated); drop it",
        ),
        (["--dry-run", "--threads", "2"], "argument --threads: has no effect with --dry-run"),
        (
            ["--device", "garbage"],
            "argument --device: device 'garbage' is not a device; use 'cpu', 'cuda', 'cuda:N' or 'npu'",
        ),
    ],
    ids=lambda v: " ".join(v)[:40] if isinstance(v, list) else "",
)
def test_bad_options(argv, message, capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DEEPINFER_DEMO_DIR", str(tmp_path / "demo"))  # never reached: every case fails first
    assert _usage_error(argv, capsys).startswith(message)
    assert not (tmp_path / "demo").exists()


def test_unreadable_prompts_file(tmp_path, capsys) -> None:
    f = tmp_path / "prompts.txt"
    f.write_bytes(b"caf\xe9\n")
    assert _usage_error(["--prompts-file", str(f)], capsys) == (
        f"argument --prompts-file: {f} is not UTF-8 text (byte 3); save it as UTF-8"
    )
    assert _usage_error(["--prompts-file", str(tmp_path / "none.txt")], capsys).startswith(
        "argument --prompts-file: [Errno 2] No such file or directory"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_on_a_machine_without_cuda(ckpt, capsys) -> None:
    assert _usage_error(["--model", str(ckpt), "--device", "cuda"], capsys) == (
        "argument --device: device 'cuda': this machine has no usable CUDA device (torch.cuda.is_available() is False); use 'cpu'"
    )


def test_runtime_errors_are_one_line(ckpt, tmp_path, capsys) -> None:
    assert _runtime_error(["--model", str(ckpt), "--mesh", "ep3"], capsys) == (
        "mesh ep3 has 3 ranks but this process was not started by torchrun; launch it under torchrun --nproc-per-node 3 "
        "(e.g. torchrun --nproc-per-node 3 -m deepinfer_fx.generate --mesh ep3 ...)"
    )
    assert _runtime_error(["--model", str(ckpt), "--disable-passes", "no_such_pass"], capsys).startswith(
        "unknown graph pass name(s) ['no_such_pass']"
    )
    tok = shutil.copytree(ckpt, tmp_path / "tok")
    (tok / "tokenizer.json").write_bytes(b"\xff\xfe")
    assert _runtime_error(["--model", str(tok)], capsys).startswith(
        f"{tok / 'tokenizer.json'}: not a readable tokenizer ("
    )
    bad = shutil.copytree(ckpt, tmp_path / "nan")
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"]["norm.weight"]
    tensors = load_file(shard)
    tensors["norm.weight"][3] = float("nan")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert _runtime_error(["--model", str(bad)], capsys) == (
        f"{shard.name}:norm.weight: tensor 'norm.weight' holds 1 non-finite value(s) (NaN or inf); "
        "the shard is damaged or the weights are broken: re-download it"
    )


def test_dump_graphs_on_the_cpu_compiles(ckpt, tmp_path, capsys) -> None:
    """Before: "drop eager=True (or --eager)" to a user who passed neither."""
    torch._dynamo.reset()
    dump = tmp_path / "graphs"
    assert (
        generate.main(
            [
                "--model",
                str(ckpt),
                "--dump-graphs",
                str(dump),
                "--max-tokens",
                "2",
                "--max-num-seqs",
                "2",
                "--no-inductor",
                "--no-warmup",  # the steps the run takes, not every bucket
                "--threads",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "graph decode" in out or "graph prefill" in out, out
    assert any(dump.rglob("*.py"))


def _env(tmp_path: Path) -> dict[str, str]:
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
    }


def test_help_imports_no_torch(tmp_path) -> None:
    """--help parses and prints before torch (or any module that loads it) is imported."""
    code = (
        "import sys, runpy; sys.argv = ['generate', '--help']\n"
        "try:\n    runpy.run_module('deepinfer_fx.generate', run_name='__main__')\n"
        "except SystemExit:\n    pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'numpy', 'safetensors', 'tokenizers'))\n"
        "print('HEAVY', heavy)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(tmp_path), timeout=120)
    assert r.returncode == 0, r.stderr
    assert "HEAVY []" in r.stdout, r.stdout[-400:]
    for option in ("--temperature", "--threads", "--max-model-len", "--dry-run"):
        assert option in r.stdout
    text = " ".join(r.stdout.split())  # argparse wraps the help lines
    assert "default: 0.0, greedy" in text and "defaults to 1.0, as in vLLM" in text


def test_no_traceback_in_a_subprocess(ckpt, tmp_path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "deepinfer_fx.generate", "--model", str(ckpt), "--mesh", "ep2"],
        capture_output=True,
        text=True,
        env=_env(tmp_path),
        timeout=300,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert (
        r.stderr.strip()
        .splitlines()[-1]
        .startswith("error: mesh ep2 has 2 ranks but this process was not started by torchrun")
    )
