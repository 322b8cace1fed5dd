"""Decode reading its keys in place (``attention.mqa_ring``) == decode gathering them: the same
logits and state, bit for bit, whatever ``RING_MIN_CHUNKS`` picks, so the chunk-count rule cannot
move a request's result. Tiny V4 and V4.1 in fp32 (eager references on CPU), with contexts past
the window and past the indexer's top-k, so the ring wraps and the top-k is read by row."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from tiny import tiny_v4, tiny_v41

from deepinfer_fx.api import random_model
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.engine.steps import decode_logits, prefill_logits
from deepinfer_fx.graphs import attention
from deepinfer_fx.graphs.state import init_state


@pytest.mark.parametrize("which", ["v4", "v41"])
def test_in_place_decode_equals_gathered(which: str, monkeypatch) -> None:
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    c = config_from_dict(tiny_v4() if which == "v4" else tiny_v41()).replace(fake_quant=False)
    c, params = random_model(c, seed=seed)
    slots, length = 3, 40
    state = init_state(c, 64, torch.float32, mtp=False, slots=slots)
    lens = [rng.randint(20, length) for _ in range(slots)]
    ids = torch.tensor([rng.randrange(3, c.vocab_size) for _ in range(slots * length)])
    meta = torch.tensor([list(range(slots)), [0] * slots, lens])
    with torch.no_grad():
        prefill_logits(params, state, c, ids, *meta, torch.arange(slots) * length)
        states = {"in place": state, "gathered": copy.deepcopy(state)}
        pos = list(lens)
        for _ in range(4):
            tokens = torch.tensor([rng.randrange(3, c.vocab_size) for _ in range(slots)])
            step = torch.tensor([list(range(slots)), pos, [1] * slots])
            logits = {}
            for name, st in states.items():
                monkeypatch.setattr(attention, "RING_MIN_CHUNKS", 1 if name == "in place" else 10**9)
                logits[name] = decode_logits(params, st, c, tokens, *step)
            assert torch.equal(logits["in place"], logits["gathered"]), f"seed={seed}"
            pos = [p + 1 for p in pos]
    flat = lambda tree: [
        x
        for v in tree.values()
        for x in (
            flat(v)
            if isinstance(v, dict)
            # noqa: E731
            else [y for e in v for y in flat(e)]
            if isinstance(v, list)
            else [v]
            if torch.is_tensor(v)
            else []
        )
    ]
    for a, b in zip(flat(states["in place"]), flat(states["gathered"])):
        assert torch.equal(a, b), f"seed={seed}"
