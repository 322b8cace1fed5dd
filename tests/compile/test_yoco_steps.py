"""Compiled compact prefill (V4.1, graphs/yoco.py) == its eager twin: one aot_eager bucket, CPU fp32."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import tiny_v41

from deepinfer_fx.api import Model, random_model
from deepinfer_fx.engine.graph_runner import StepGraphs
from deepinfer_fx.graphs.state import init_state


@pytest.mark.usefixtures("fresh_compile")
def test_compiled_compact_prefill_equals_eager() -> None:
    """One aot_eager prefill bucket (4 chunks x 16 tokens, 12 kept rows each) against the eager
    twin, chunks whose kept rows start inside, before and after them; then the states agree."""
    m = random_model(tiny_v41(), seed=5)
    v41 = Model(m.config.replace(fake_quant=False), m.params)
    c = v41.config
    state = init_state(c, 64, torch.float32, mtp=False, slots=3)
    eager_state = copy.deepcopy(state)
    kw = dict(max_requests=4, max_tokens=16, keep=12)
    compiled = StepGraphs(v41, state, torch.zeros(4, dtype=torch.long), **kw)
    eager = StepGraphs(v41, eager_state, torch.zeros(4, dtype=torch.long), compile=False, **kw)
    g = torch.Generator().manual_seed(2)
    pos = [0, 0, 0]
    # prompts of 32, 14 and 17 tokens, KEEP 12: kept rows 0 / 7 / 9, then 12 / 5 / 3
    for lens, keep_from in (([16, 9, 14], [20, 2, 5]), ([16, 5, 3], [20, 2, 5])):
        chunks = [(s, pos[s], torch.randint(3, 300, (n,), generator=g).tolist()) for s, n in enumerate(lens)]
        with torch.no_grad():
            got, _ = compiled.prefill(chunks, keep_from=keep_from)
            want, _ = eager.prefill(chunks, keep_from=keep_from)
        torch.testing.assert_close(got.logits[:3], want.logits[:3], rtol=1e-5, atol=1e-5)
        pos = [p + n for p, n in zip(pos, lens)]
    assert {r["graph"] for r in compiled.report()} == {"prefill-t64-r4-kept12-greedy"}
    for i, (a, b) in enumerate(zip(state["layers"], eager_state["layers"])):
        torch.testing.assert_close(
            a["window"][:3], b["window"][:3], rtol=1e-5, atol=1e-5, msg=lambda m: f"layer {i}: {m}"
        )
