"""Shared pieces of the deepinfer_fx.config tests (test_config, test_config_released, test_config_v41):
tiny V4 and V4.1 config dicts in DeepSeek's and HF's spellings, and the "raises a ConfigError naming
these words" check. Not a test module."""

from __future__ import annotations

import copy

import pytest

from deepinfer_fx.config import ConfigError, config_from_dict
from deepinfer_fx.config.tiny import tiny_v4

YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}

# A change whose value is DROP removes the field: ``tiny(hidden_size=DROP)`` has no hidden_size.
DROP = object()

# A tiny DeepSeek-spelled config (the released files' fields, small numbers): tiny_v4 at other
# head widths and window, without the fields the released files leave out.
TINY = {
    k: v
    for k, v in tiny_v4(
        vocab_size=256,
        head_dim=64,
        qk_rope_head_dim=16,
        sliding_window=16,
        compress_ratios=[0, 4, 128, 4, 0],
        index_head_dim=32,
        index_topk=4,
        rope_scaling=dict(YARN),
        max_position_embeddings=1048576,
    ).items()
    if k not in ("topk_method", "torch_dtype")
}

# A tiny bare text config (deepseek_v41_text): 10 layers, ratio-2 groups at 2 and 4, a ratio-1
# decoder from layer 6 with a reindex source at 8, Engram at 1 and 4, two DSpark stages.
TINY41 = {
    "model_type": "deepseek_v41_text",
    **{
        k: v
        for k, v in TINY.items()
        if k not in ("model_type", "compress_ratios", "num_hash_layers", "num_hidden_layers")
    },
    "num_hidden_layers": 10,
    "rms_norm_eps": 1e-20,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0],
    "kv_source_layer_ids": [2, 4, 6],
    "index_source_layer_ids": [2, 4, 6, 8],
    "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 2,
    "engram_layer_ids": [1, 4],
    "engram_num_embeddings": [300, 320],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 50,
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 2,
    "dspark_target_layer_ids": [8, 9],
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}


def _changed(base: dict, changes: dict) -> dict:
    d = copy.deepcopy(base)
    d.update(changes)
    return {k: v for k, v in d.items() if v is not DROP}


def tiny(**changes) -> dict:
    return _changed(TINY, changes)


def tiny_hf(**changes) -> dict:
    """The same model in HF's spelling (layer_types / compress_rates / mlp_layer_types)."""
    hf = {
        "layer_types": [
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    }
    return _changed(tiny(compress_ratios=DROP, num_hash_layers=DROP), {**hf, **changes})


def tiny41(**changes) -> dict:
    return _changed(TINY41, changes)


def composite41(text: dict, **top) -> dict:
    """The V4.1 composite config (deepseek_v41) around the text config ``text``."""
    d = {
        "model_type": "deepseek_v41",
        "eos_token_id": [1, 2],
        "image_token_id": 200,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "expert_dtype": "fp4"},
        "text_config": text,
        "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 8, "num_attention_heads": 2},
    }
    return _changed(d, top)


def raises_naming(d: dict, *words: str) -> str:
    """``config_from_dict(d)`` raises a ConfigError whose message names each of ``words``; returns it."""
    with pytest.raises(ConfigError) as ei:
        config_from_dict(d)
    msg = str(ei.value)
    for w in words:
        assert w in msg, f"ConfigError message {msg!r} does not name {w!r}"
    return msg


def fields_of(d: dict, want: dict) -> dict:
    """The fields ``want`` names, of the config parsed from ``d``."""
    c = config_from_dict(d)
    return {name: getattr(c, name) for name in want}
