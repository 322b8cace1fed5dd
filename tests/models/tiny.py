"""Tiny DeepSeek-style config dicts (the spelling of DeepSeek's released config.json)."""

from __future__ import annotations

import copy


def tiny_v4(**overrides) -> dict:
    """Every layer kind (SWA, CSA ratio 4, HCA ratio 8), hash and learned routing, an MTP block.
    head_dim 128 / rope 64 and index_head_dim 64 so the fake-quant blocks (64 / 32) tile exactly."""
    cfg = {
        "model_type": "deepseek_v4", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 128, "qk_rope_head_dim": 64,
        "q_lora_rank": 32, "o_groups": 2, "o_lora_rank": 16, "sliding_window": 8,
        "compress_ratios": [0, 4, 8, 4, 0], "index_n_heads": 16, "index_head_dim": 64, "index_topk": 3,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32, "beta_slow": 1},
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "moe_intermediate_size": 32, "n_routed_experts": 8,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
        "norm_topk_prob": True, "routed_scaling_factor": 1.5, "num_hash_layers": 1, "swiglu_limit": 10.0,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "num_nextn_predict_layers": 1,
        "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "float32",
    }
    cfg.update(copy.deepcopy(overrides))
    return cfg
