"""``DEEPINFER_CACHE_DIR`` holds the compilers' caches: a fresh process that imported torch's
compiler first (which sets ``TORCHINDUCTOR_CACHE_DIR`` to Inductor's default) and then builds a
compiled engine writes Inductor's and Triton's caches there, and a second process hits them;
a cache folder the user chose stays theirs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, os
import torch, torch._dynamo  # as a user's script would, before the engine
from torch._dynamo.utils import counters
from deepinfer_fx import LLM
from deepinfer_fx.api import random_model
from deepinfer_fx.config.tiny import tiny_v4

LLM(model=random_model(tiny_v4()), eager=False, warmup=False, max_model_len=64)
f = torch.compile(lambda x: (x.sin() * 3 + 1).cumsum(0), backend="inductor")
f(torch.randn(16))
print(json.dumps({
    "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
    "triton": os.environ.get("TRITON_CACHE_DIR"),
    "hit": counters["inductor"]["fxgraph_cache_hit"],
    "miss": counters["inductor"]["fxgraph_cache_miss"],
}))
"""


def _start(root: Path, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")}
    clean.update({"DEEPINFER_CACHE_DIR": str(root), **env})
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=clean, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_cache_dir_holds_inductors_cache_and_a_second_start_hits_it(tmp_path) -> None:
    root = tmp_path / "cache"
    first = _start(root)
    assert first["inductor"] == str(root / "inductor") and first["triton"] == str(root / "triton")
    assert first["miss"] >= 1 and first["hit"] == 0
    assert any((root / "inductor").rglob("*.py")), "Inductor wrote nothing under DEEPINFER_CACHE_DIR"
    second = _start(root)
    assert second["hit"] >= 1 and second["miss"] == 0


def test_a_cache_folder_the_user_chose_stays(tmp_path) -> None:
    mine = tmp_path / "mine"
    got = _start(tmp_path / "cache", TORCHINDUCTOR_CACHE_DIR=str(mine))
    assert got["inductor"] == str(mine) and got["triton"] == str(tmp_path / "cache" / "triton")
    assert not (tmp_path / "cache" / "inductor").exists()
