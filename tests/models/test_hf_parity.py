"""Logits equal HF transformers' DeepseekV4ForCausalLM, loading the checkpoints HF itself
wrote with ``save_pretrained`` in both key formats (fake-quant off: HF V4 leaves it out)."""

from __future__ import annotations

import random

import pytest
import torch
from hf_oracle import SEQ_LEN, TINY_CONFIGS, hf_model

import deepinfer_fx


@pytest.mark.parametrize("original_format", [False, True], ids=["hf-names", "original-names"])
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_logits_match_hf(name: str, original_format: bool, tmp_path) -> None:
    seed = random.SystemRandom().randrange(2**31)
    model = hf_model(TINY_CONFIGS[name], seed)
    model.save_pretrained(tmp_path, save_original_format=original_format)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.config.vocab_size, (SEQ_LEN[name],), generator=g)
    with torch.no_grad():
        ref = model(ids[None]).logits[0]

    ours = deepinfer_fx.load_model(tmp_path, dtype=torch.float32, fake_quant=False)
    out = deepinfer_fx.logits(ours, ids)
    err = (out - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 1e-4 * scale, f"seed={seed}: max |diff| {err:.3e} vs max |logit| {scale:.3e}"
