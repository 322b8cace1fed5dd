"""``LLM(kv_format="trained")``: the cache holds window kv, compressed entries and index keys as
fp8 / fp4 codes and scales, and ``generate`` returns what a model-format cache returns, bit for
bit in fp32 (tokens and logprobs): V4 with MTP-1 drafting and V4.1 with DSpark drafting, chunked
prefill, greedy and sampled requests in one batch, eager and compiled steps. Its slots take less
than half the bytes. A checkpoint stored as released, run with every format native (fp4 experts,
fp8 dense weights, trained state), gives what it gives converted. PROMPT / COMPLETION engines
trade trained states; a COMPLETION engine that
holds the other format refuses the state by name, and so do a model without fake-quant and an
unknown ``DEEPINFER_KV_FORMAT``."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams, random_model

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_dspark import v41_dspark  # noqa: E402
from tiny import FP8_EXPERTS, tiny_v4, tiny_v41  # noqa: E402

MODELS = {
    "v4-mtp": (tiny_v4, {"method": "mtp", "num_speculative_tokens": 2}),
    "v41-dspark": (v41_dspark, {"method": "dspark", "num_speculative_tokens": 3}),
}


def _requests(seed: int, vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 30))] for _ in range(4)]
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=7, ignore_eos=True, logprobs=2, seq_seed=seed + i)
        for i in range(4)
    ]
    return prompts, params


def _generate(model, kv_format: str, seed: int, **kw) -> tuple[list, LLM]:
    llm = LLM(model, kv_format=kv_format, max_num_batched_tokens=16, max_num_seqs=4, memory_budget=1 << 26, **kw)
    prompts, params = _requests(seed, model.config.vocab_size)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [(o.token_ids, [sorted(d.items()) for d in o.logprobs]) for o in outs], llm


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trained_cache_generates_what_the_model_format_does(name: str) -> None:
    cfg, spec = MODELS[name]
    seed = random.randrange(1 << 30)
    model = random_model(cfg(), seed=seed)
    for speculative in (None, spec):
        want, plain = _generate(model, "model", seed, speculative_config=speculative)
        got, held = _generate(model, "trained", seed, speculative_config=speculative)
        assert got == want, f"seed {seed}, speculative {speculative}"
        assert held.plan.kv_format == "trained" and plain.plan.kv_format == "model"
        assert held.plan.bytes_per_slot < 0.6 * plain.plan.bytes_per_slot
        assert held.bytes_per_token() < 0.6 * plain.bytes_per_token()  # what the CLI prints


def test_trained_cache_in_compiled_steps() -> None:
    """bf16, as on a GPU: the compressors' fp32 entries go into bf16-sized rows."""
    seed = random.randrange(1 << 30)
    model = random_model(tiny_v4(), seed=seed, dtype=torch.bfloat16)
    want, _ = _generate(model, "model", seed, eager=False)
    got, _ = _generate(model, "trained", seed, eager=False)
    assert got == want, f"seed {seed}"


def test_prompt_and_completion_engines_trade_trained_states(tmp_path: Path) -> None:
    seed = random.randrange(1 << 30)
    model = random_model(tiny_v4(), seed=seed)
    prompts, _ = _requests(seed, model.config.vocab_size)
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in LLM(model, memory_budget=1 << 26).generate(prompts, greedy)]
    kw = {"memory_budget": 1 << 26, "state_dir": tmp_path}
    LLM(model, kv_format="trained", engine_type="prompt", **kw).generate(prompts, greedy)
    with pytest.raises(ValueError, match="holds kv_format 'trained'; this engine's cache holds 'model'"):
        LLM(model, engine_type="completion", **kw).generate(None, greedy)
    done = LLM(model, kv_format="trained", engine_type="completion", **kw).generate(None, greedy)
    assert [o.outputs[0].token_ids for o in done] == want


def test_every_format_native_equals_every_format_converted(tmp_path: Path) -> None:
    """A tiny V4.1 checkpoint stored as released (MXFP4 experts, 32 x 32 block-FP8 dense weights)
    run with everything kept as stored (experts fp4, dense fp8, the state as trained) gives the
    tokens and logprobs of the same checkpoint with everything converted (dequantised weights, a
    model-format state): every native path reproduces its conversion's values (fp32, eager)."""
    cfg = tiny_v41(quantization_config=FP8_EXPERTS["quantization_config"], expert_dtype="fp4")
    del cfg["engram_compressed_vocab_size"], cfg["engram_num_embeddings"]  # the writer derives them
    seed = random.randrange(1 << 30)
    deepinfer_fx.write_random_checkpoint(
        tmp_path, {"model_type": "deepseek_v41", "text_config": cfg, "eos_token_id": [1, 2]}, seed=seed
    )
    runs = {}
    for name, kw in {
        "native": {"expert_format": "fp4", "dense_format": "fp8", "kv_format": "trained"},
        "converted": {"expert_format": "dequant", "dense_format": "dequant", "kv_format": "model"},
    }.items():
        llm = LLM(str(tmp_path), dtype="float32", eager=True, max_num_batched_tokens=16, memory_budget=1 << 26, **kw)
        prompts, params = _requests(seed, llm.model.config.vocab_size)
        outs = [o.outputs[0] for o in llm.generate(prompts, params)]
        runs[name] = [(o.token_ids, [sorted(d.items()) for d in o.logprobs]) for o in outs]
    assert runs["native"] == runs["converted"], f"seed {seed}"


def test_refusals(monkeypatch) -> None:
    model = random_model(tiny_v4(), seed=1)
    with pytest.raises(ValueError, match="fake_quant off"):
        LLM(model, kv_format="trained", fake_quant=False, memory_budget=1 << 26)
    with pytest.raises(ValueError, match=r"kv_format='fp4' is invalid: expected auto, model or trained"):
        LLM(model, kv_format="fp4", memory_budget=1 << 26)
    monkeypatch.setenv("DEEPINFER_KV_FORMAT", "packed")
    with pytest.raises(ValueError, match="DEEPINFER_KV_FORMAT='packed' is invalid"):
        LLM(model, memory_budget=1 << 26)
