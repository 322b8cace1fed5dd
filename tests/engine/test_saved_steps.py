"""Inductor-compiled steps saved ahead of time (``passes/saved_steps.py``): a second start of the
same model and settings loads them without tracing and generates the same tokens; a torn file
is compiled again; the key moves with what a trace reads."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from deepinfer_fx.passes import saved_steps
from deepinfer_fx.passes.compiler import make_backend

pytestmark = pytest.mark.skipif(not saved_steps.supported(), reason="this torch has no aot_compile")

SCRIPT = """
import json, sys
import torch
from torch._dynamo.utils import counters
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.api import random_model
from deepinfer_fx.config.tiny import tiny_v4

seed, prompt = int(sys.argv[1]), json.loads(sys.argv[2])
model = random_model(tiny_v4(num_hidden_layers=2, compress_ratios=[0, 4, 0]), seed=seed)
llm = LLM(model=model, eager=False, inductor=True, warmup=False, max_model_len=64)
out = llm.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0))[0]
saved = llm.runner.steps.functions.saved
print(json.dumps({
    "tokens": out.outputs[0].token_ids,
    "loaded": saved.loaded, "saved": saved.saved, "skipped": saved.skipped,
    "traced": counters["stats"]["unique_graphs"],
}))
"""


def _start(root: Path, seed: int, prompt: list[int]) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "TORCHINDUCTOR_", "TRITON_"))}
    env["DEEPINFER_CACHE_DIR"] = str(root)
    cmd = [sys.executable, "-c", SCRIPT, str(seed), json.dumps(prompt)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_start_loads_the_steps_and_gives_the_same_tokens(tmp_path: Path) -> None:
    seed = random.randrange(2**31)
    prompt = random.Random(seed).sample(range(3, 300), 7)
    first = _start(tmp_path, seed, prompt)
    parts = sorted(first["saved"])
    assert parts == ["decode-t1-r1", "prefill-t16-r1"] and not first["loaded"] and not first["skipped"]

    second = _start(tmp_path, seed, prompt)
    assert second["tokens"] == first["tokens"], (seed, prompt)
    assert sorted(second["loaded"]) == parts and not second["saved"]
    # the sampler (its row count dynamic) is the only graph Dynamo traced again
    assert second["traced"] == 1 and first["traced"] == 3

    # a torn artifact does not load: that step is compiled again and saved over
    torn = next((tmp_path / "steps").glob("decode-*"))
    torn.write_bytes(torn.read_bytes()[:100])
    third = _start(tmp_path, seed, prompt)
    assert third["tokens"] == first["tokens"]
    assert third["loaded"] == ["prefill-t16-r1"] and third["saved"] == ["decode-t1-r1"]


def test_the_key_moves_with_what_a_trace_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = saved_steps.SavedSteps(tmp_path)
    backend = make_backend("cpu", name="decode-t1-r1", inductor=True, environ={})
    args = ({"w": torch.randn(4, 8)}, torch.zeros(3, dtype=torch.int64))
    key = store.key(backend, "layout A", args)
    assert store.key(backend, "layout A", args) == key
    assert store.key(backend, "layout B", args) != key
    assert store.key(backend, "layout A", ({"w": torch.randn(4, 9)}, args[1])) != key
    assert store.key(backend, "layout A", ({"w": torch.randn(4, 8).bfloat16()}, args[1])) != key
    assert store.key(backend, "layout A", ({"v": args[0]["w"]}, args[1])) != key
    other = make_backend("cpu", disabled=[backend.pipeline.names[0]], name="decode-t1-r1", inductor=True, environ={})
    assert store.key(other, "layout A", args) != key
    monkeypatch.setenv("DEEPINFER_KV_FORMAT", "model")
    assert store.key(backend, "layout A", args) != key


def test_a_step_traced_under_stateful_swaps_is_not_saved() -> None:
    """A mesh's EP dispatch is a closure over its groups and placement (which a rebalance
    changes): no key can see that state, so such a step is compiled, never saved or loaded."""
    from deepinfer_fx.engine.step_functions import _swaps_id
    from deepinfer_fx.kernels.ops_engram import engram_rows
    from deepinfer_fx.passes.batch_invariant import batch_invariant_swaps

    plain = {**batch_invariant_swaps(), "engram.gather_rows": engram_rows, "op": torch.ops.deepinfer.sparse_mqa}
    assert _swaps_id(plain) == _swaps_id(dict(reversed(plain.items())))
    assert "deepinfer::engram_rows" in _swaps_id(plain) and "deepinfer.sparse_mqa" in _swaps_id(plain)
    placement = [3, 1, 2]

    def dispatch(*args):
        return placement

    assert _swaps_id({**plain, "moe.expert_parallel": dispatch}) is None
    assert _swaps_id({"moe.expert_parallel": lambda *a: None}) is None
    assert _swaps_id({}) == "[]"
