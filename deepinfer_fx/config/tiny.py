"""Tiny DeepSeek-style config dicts (the spelling of DeepSeek's released config.json): every
layer kind at toy widths, for the demo model, the eval workloads and the tests (which build their
checkpoints from these, with overrides)."""

from __future__ import annotations

import copy

# V4 -Base storage (spec §5): block-FP8 routed experts, beside the block-FP8 dense weights.
# 32x32 blocks, so the tiny widths span several blocks.
FP8_EXPERTS = {
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]},
    "expert_dtype": "fp8",
}


# fields both generations share at the tiny widths: routed and shared experts with their routing
_MOE = {
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
}
# the SwiGLU clamp and mHC
_MHC = {
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
}
# untied head, the special tokens and the stored dtype
_TAIL = {
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def tiny_v4(**overrides) -> dict:
    """Every layer kind (SWA, CSA ratio 4, HCA ratio 8), hash and learned routing, an MTP block.
    head_dim 128 / rope 64 and index_head_dim 64 so the fake-quant blocks (64 / 32) tile exactly."""
    cfg = {
        "model_type": "deepseek_v4",
        "vocab_size": 300,
        "hidden_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 128,
        "qk_rope_head_dim": 64,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 8,
        "compress_ratios": [0, 4, 8, 4, 0],
        "index_n_heads": 16,
        "index_head_dim": 64,
        "index_topk": 3,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        **_MOE,
        "num_hash_layers": 1,
        **_MHC,
        "num_nextn_predict_layers": 1,
        **_TAIL,
    }
    cfg.update(copy.deepcopy(overrides))
    return cfg


def tiny_v41(**overrides) -> dict:
    """A small V4.1 text config with every role: window-only layers (0, 1), a ratio-2 encoder
    group (source 2, reuse 3), a ratio-1 decoder group (source 4 = candidate source, reuse 5,
    reindex 6, reuse 7), Engram on layers 1 and 3. Widths tile the fake-quant blocks."""
    cfg = {
        "model_type": "deepseek_v41_text",
        "vocab_size": 300,
        "hidden_size": 64,
        "num_hidden_layers": 8,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "qk_rope_head_dim": 16,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "sliding_window": 8,
        "compress_ratios": [0, 0, 2, 2, 1, 1, 1, 1],
        "kv_source_layer_ids": [2, 4],
        "index_source_layer_ids": [2, 4, 6],
        "candidate_source_layer_id": 4,
        "candidate_topk_blocks": 2,
        "candidate_block_size": 4,
        "index_n_heads": 16,
        "index_head_dim": 32,
        "index_topk": 5,
        "rope_theta": 10000,
        "compress_rope_theta": 160000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-20,
        **_MOE,
        **_MHC,
        "num_nextn_predict_layers": 0,
        "engram_layer_ids": [1, 3],
        "engram_max_ngram_size": 3,
        "engram_n_heads": 2,
        "engram_head_dim": 32,
        "engram_vocab_size": 400,
        "engram_pad_token_id": 2,
        "engram_compressed_vocab_size": 250,
        **_TAIL,
    }
    cfg.update(copy.deepcopy(overrides))
    if "engram_num_embeddings" not in cfg:
        # here, not at the top: the demo imports this module on `generate --help`'s path, which stays torch-free
        from ..graphs.engram_hash import engram_layout
        from .parse import config_from_dict

        c = config_from_dict({**cfg, "engram_num_embeddings": [1] * len(cfg["engram_layer_ids"])})
        cfg["engram_num_embeddings"] = list(engram_layout(c).rows)
    return cfg
