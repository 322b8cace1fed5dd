"""The built-in tiny demo model: a V4 config at toy widths with a real tokenizer and RANDOM
weights (its text is gibberish), written on first use to ``DEEPINFER_DEMO_DIR`` (default
``~/.cache/deepinfer_fx/demo-v4-tiny``). The CLI and ``LLM(model="demo")`` both run it."""

from __future__ import annotations

from pathlib import Path

from .settings import setting

DEMO_CONFIG = {
    "model_type": "deepseek_v4",
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "sliding_window": 16,
    "compress_ratios": [0, 4, 128, 4, 0],
    "index_n_heads": 16,
    "index_head_dim": 64,
    "index_topk": 8,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "moe_intermediate_size": 64,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 1,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
    "expert_dtype": "fp4",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [32, 32]},
}


def demo_dir() -> Path:
    """Where the demo checkpoint lives (read when asked, so a changed setting is seen)."""
    return Path(setting("DEEPINFER_DEMO_DIR") or Path.home() / ".cache" / "deepinfer_fx" / "demo-v4-tiny")


def demo_model_dir() -> Path:
    """The demo checkpoint's directory, written first if it is not there yet."""
    path = demo_dir()
    if not (path / "model.safetensors.index.json").exists():
        from .io.writer import write_random_checkpoint

        write_random_checkpoint(path, DEMO_CONFIG, seed=0)
    return path
