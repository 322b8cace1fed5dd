"""V4.1 compact prefill (graphs/yoco.py) against the exact one on a tiny random model, CPU fp32.

The tiny config (tests/models/tiny.py) has a window of 8 and four decoder layers (4..7), so
compact prefill is exact once KEEP >= 8 + 3 * 7 = 29 (every surviving window dependency is
replayed) and drifts below that."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny import tiny_v41  # noqa: E402

import deepinfer_fx  # noqa: E402
from deepinfer_fx.graphs.batch import make_batch  # noqa: E402
from deepinfer_fx.graphs.model import forward_batch  # noqa: E402
from deepinfer_fx.graphs.state import init_state  # noqa: E402
from deepinfer_fx.graphs.yoco import min_keep_tokens, replay_for  # noqa: E402

P, DECODE, EXACT_KEEP = 50, 3, 29


@pytest.fixture(scope="module")
def model():
    return deepinfer_fx.random_model(tiny_v41(), seed=3)


def _run(model, c, ids: torch.Tensor, keep: int | None, chunks: list[int]):
    """Prefill ``ids`` in ``chunks`` (compact with ``keep``, exact with None), then greedy-free
    teacher-forced decode of DECODE tokens: the logits of the prompt's last row and of each
    decode step, and the state."""
    st = init_state(c, P + DECODE, torch.float32)
    out, start = [], 0
    for n in chunks:
        b = make_batch([ids[start : start + n]], [0], [start])
        logits, _ = forward_batch(model.params, st, c, b, replay=None if keep is None else replay_for(b, [P], keep))
        out.append(logits[-1:])
        start += n
    for t in range(DECODE):
        out.append(
            forward_batch(model.params, st, c, make_batch([ids[P - DECODE + t : P - DECODE + t + 1]], [0], [P + t]))[0]
        )
    return torch.cat(out[-DECODE - 1 :]).log_softmax(-1), st


def _exact_parts(c, st: dict) -> dict[str, torch.Tensor]:
    """Every state tensor compact prefill computes on every row: the encoder's and the first
    decoder layer's rings, every KV source's compressed entries, index keys and open rows, Engram."""
    parts = {"engram": st["engram"]["history"][0]}
    for i, ls in enumerate(st["layers"]):
        if i <= c.decoder_layers[0]:
            parts[f"window{i}"] = ls["window"][0]
        for k, v in ls.get("comp", {}).items():
            parts[f"{k}{i}"] = v[0]
    return parts


def test_compact_is_exact_at_the_exact_bound(model) -> None:
    c = model.config.replace(fake_quant=False)
    ids = torch.randint(3, 300, (P,), generator=torch.Generator().manual_seed(1))
    ref, st_ref = _run(model, c, ids, None, [P])
    for chunks in ([P], [17, 13, 20], [P - 1, 1]):
        got, st = _run(model, c, ids, EXACT_KEEP, chunks)
        assert (got - ref).abs().max().item() < 1e-4, chunks
        for i in c.decoder_layers:  # the kept window of every decoder ring, too
            assert torch.allclose(st["layers"][i]["window"][0], st_ref["layers"][i]["window"][0], atol=1e-5), (
                chunks,
                i,
            )


def test_compact_with_engram_in_the_decoder() -> None:
    """An Engram layer after the first decoder layer looks up the kept rows' hashes."""
    m = deepinfer_fx.random_model(tiny_v41(engram_layer_ids=[1, 5]), seed=2)
    c = m.config.replace(fake_quant=False)
    ids = torch.randint(3, 300, (P,), generator=torch.Generator().manual_seed(0))
    ref, _ = _run(m, c, ids, None, [P])
    got, _ = _run(m, c, ids, EXACT_KEEP, [17, 13, 20])
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("keep", [8, 20])
def test_compact_below_the_bound_bounds_the_drift(model, keep) -> None:
    """Below the exact bound the decoder rings are replayed from KEEP rows, so the logprobs of the
    prompt's last row and the decode steps after it drift, by an amount measured here (fake-quant
    off: with it on, an fp8 rounding flip moves even exact chunked prefill by up to ~1 nat on this
    random model). Chunked compact equals one-shot compact wherever the chunks fall."""
    c = model.config.replace(fake_quant=False)
    ids = torch.randint(3, 300, (P,), generator=torch.Generator().manual_seed(keep))
    ref, _ = _run(model, c, ids, None, [P])
    got, _ = _run(model, c, ids, keep, [P])
    drift = (got - ref).abs().max().item()
    # max |logprob difference| over 10 random models of this config (seeds 0..9):
    # KEEP 8 (= W): 0.58, KEEP 12: 0.64, KEEP 20: 0.001 (median 0.10 / 0.04 / 0.0005; 60-token
    # prompts, the last row and 4 decode steps)
    assert drift < {8: 1.0, 20: 0.01}[keep], drift
    for chunks in ([P - keep + 3, keep - 3], [20, 20, P - 40]):
        chunked, _ = _run(model, c, ids, keep, chunks)
        assert (chunked - got).abs().max().item() < 1e-4, chunks


def test_compact_keeps_the_global_state_bit_for_bit(model) -> None:
    """What compact prefill computes on every row (encoder rings, the first decoder layer's ring,
    every KV source's entries, index keys and open rows, the Engram history) is the exact state,
    bit for bit, with the model's own numerics (fake-quant on)."""
    c = model.config
    ids = torch.randint(3, 300, (P,), generator=torch.Generator().manual_seed(7))
    _, st_ref = _run(model, c, ids, None, [P])
    _, st = _run(model, c, ids, c.sliding_window, [P])
    want = _exact_parts(c, st_ref)
    for name, t in _exact_parts(c, st).items():
        assert torch.equal(t, want[name]), name


def test_min_keep_covers_window_and_rollback(model) -> None:
    c = model.config
    assert min_keep_tokens(c) == c.sliding_window
    assert min_keep_tokens(c, max_draft=5) == c.sliding_window + 6
