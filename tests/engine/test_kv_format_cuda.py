"""``LLM(kv_format="trained")`` on a GPU: bf16, compiled by Inductor and replayed as CUDA graphs,
the cache held as fp8 / fp4 codes and scales gives the model format's tokens and logprobs bit for
bit, for V4 with MTP-1 drafting and V4.1 (Engram) with DSpark drafting, each with and without
speculation. What must hold before ``auto`` may pick the trained format on CUDA (issue 35 item 3;
``docs/decisions.md``). Skipped without CUDA. Fresh seeds, named in failures."""

from __future__ import annotations

import random

import pytest
import torch
from test_kv_format_engine import MODELS, _requests

from deepinfer_fx import LLM, random_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _generate(model, kv_format: str, seed: int, speculative: dict | None) -> list[tuple]:
    llm = LLM(
        model,
        device="cuda",
        kv_format=kv_format,
        eager=False,
        max_model_len=96,
        max_num_batched_tokens=16,
        max_num_seqs=4,
        speculative_config=speculative,
        warmup=False,  # compile only the buckets these requests reach: every bucket took ~280 s a case on an H100
    )
    assert llm.plan.kv_format == kv_format
    prompts, params = _requests(seed, model.config.vocab_size)
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    return [(o.token_ids, [sorted(d.items()) for d in o.logprobs]) for o in outs]


@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("speculate", [False, True])
def test_trained_cache_on_cuda_generates_what_the_model_format_does(name: str, speculate: bool) -> None:
    cfg, spec = MODELS[name]
    seed = random.randrange(1 << 30)
    model = random_model(cfg(), seed=seed, dtype=torch.bfloat16, device="cuda")
    speculative = spec if speculate else None
    want = _generate(model, "model", seed, speculative)
    got = _generate(model, "trained", seed, speculative)
    assert got == want, f"seed {seed}, {name}, speculative {speculative}"
