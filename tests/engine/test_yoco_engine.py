"""V4.1 compact prefill through the engine: options and refusals, exactness at the exact bound,
chunked prefill, prompt logprobs run exact, compiled == eager (CPU fp32, tiny random models)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from tiny import tiny_v4, tiny_v41  # noqa: E402

from deepinfer_fx import LLM, SamplingParams  # noqa: E402
from deepinfer_fx.api import Model, random_model  # noqa: E402
from deepinfer_fx.graphs import model  # noqa: E402
from deepinfer_fx.graphs.yoco import kept_rows  # noqa: E402

EXACT_KEEP = 29  # window 8, four decoder layers: 8 + 3 * 7 (tests/models/test_yoco.py)


@pytest.fixture(scope="module")
def v41() -> Model:
    m = random_model(tiny_v41(), seed=5)
    return Model(m.config.replace(fake_quant=False), m.params)


def _prompts(n: int = 4) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 300, (int(k),), generator=g).tolist() for k in torch.randint(10, 45, (n,), generator=g)]


def _tokens(llm: LLM, prompts, **kw) -> list[list[int]]:
    ps = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, **kw)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, ps)]


def test_mode_defaults_and_settings(v41: Model, monkeypatch) -> None:
    assert LLM(v41, eager=True, max_model_len=64).options.steps.keep == 140  # compact by default for V4.1
    assert LLM(v41, eager=True, max_model_len=64, yoco_mode="off").options.steps.keep is None
    v4 = random_model(tiny_v4(), seed=0)
    assert LLM(v4, eager=True, max_model_len=64).options.steps.keep is None  # V4 is unaffected
    with pytest.raises(ValueError, match="replays V4.1's CED decoder"):
        LLM(v4, eager=True, max_model_len=64, yoco_mode="compact")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "off")
    assert LLM(v41, eager=True, max_model_len=64).options.steps.keep is None
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "compact")
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "12")
    assert LLM(v41, eager=True, max_model_len=64).options.steps.keep == 12
    assert LLM(v41, eager=True, max_model_len=64, yoco_keep_tokens=20).options.steps.keep == 20


def test_keep_below_the_minimum_refuses(v41: Model, monkeypatch) -> None:
    with pytest.raises(
        ValueError, match=r"= 7 is below the minimum 8: the kept rows must cover the sliding window \(8 rows"
    ):
        LLM(v41, eager=True, max_model_len=64, yoco_keep_tokens=7)
    monkeypatch.setenv("DEEPINFER_YOCO_PREFILL_KEEP_TOKENS", "3")
    with pytest.raises(ValueError, match="DEEPINFER_YOCO_PREFILL_KEEP_TOKENS = 3 is below the minimum 8"):
        LLM(v41, eager=True, max_model_len=64)
    from deepinfer_fx.engine.options import compact_keep
    from deepinfer_fx.settings import EngineConfig

    with pytest.raises(
        ValueError, match=r"minimum 14: .*window \(8 rows.*\) plus the longest rollback \(a 5-token draft \+ 1\)"
    ):
        compact_keep(v41.config, EngineConfig.from_env(), "compact", 12, max_draft=5)


def test_compact_generate_exact_bound_and_chunked(v41: Model, monkeypatch) -> None:
    """At the exact bound compact generates what off does; chunked compact (8-token budget:
    the kept rows span chunk boundaries) generates what one-shot compact does."""
    replayed = []

    def counted(batch, replay):
        replayed.append(replay.rows)
        return kept_rows(batch, replay)

    monkeypatch.setattr(model, "kept_rows", counted)
    prompts = _prompts()
    off = _tokens(LLM(v41, eager=True, max_model_len=64, yoco_mode="off"), prompts)
    assert not replayed
    assert _tokens(LLM(v41, eager=True, max_model_len=64, yoco_keep_tokens=EXACT_KEEP), prompts) == off
    assert replayed, "compact prefill did not run"
    small = _tokens(LLM(v41, eager=True, max_model_len=64, yoco_keep_tokens=8), prompts)
    chunked = _tokens(LLM(v41, eager=True, max_model_len=64, yoco_keep_tokens=8, max_num_batched_tokens=8), prompts)
    assert chunked == small


def test_prompt_logprobs_requests_run_exact(v41: Model) -> None:
    prompts = _prompts(2)
    ps = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=0)
    off = LLM(v41, eager=True, max_model_len=64, yoco_mode="off").generate(prompts, ps)
    got = LLM(v41, eager=True, max_model_len=64, yoco_keep_tokens=8, max_num_batched_tokens=16).generate(prompts, ps)
    for a, b in zip(got, off):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.keys() == y.keys() and all(abs(x[k] - y[k]) < 1e-4 for k in x)
