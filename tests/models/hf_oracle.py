"""HF transformers' DeepseekV4ForCausalLM as the oracle: tiny random models saved with
``save_pretrained`` in both key formats."""

from __future__ import annotations

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM


def randomize(model: torch.nn.Module, seed: int, n_experts: int) -> None:
    """Give every parameter and persistent buffer a non-trivial random value (HF initialises
    sinks, biases, ape and the hash table to zero, which would hide mapping mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in name:
                continue
            if "tid2eid" in name:
                p.copy_(torch.argsort(torch.rand(p.shape[0], n_experts, generator=g), dim=1)[:, : p.shape[1]])
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif "norm" in name or name.endswith("scale"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def hf_model(kwargs: dict, seed: int) -> DeepseekV4ForCausalLM:
    cfg = DeepseekV4Config(**kwargs)
    model = DeepseekV4ForCausalLM(cfg).float().eval()
    randomize(model, seed, cfg.n_routed_experts)
    return model


def yarn(orig: int = 65536) -> dict:
    return {"type": "yarn", "factor": 16, "original_max_position_embeddings": orig, "beta_fast": 32, "beta_slow": 1}


SWA, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

# Three tiny shapes: every layer kind, hash and learned routing, HCA at ratio 16 and at the real
# 128 (with sequences covering two full windows), index_topk small enough that selection bites.
TINY_CONFIGS = {
    "all-kinds": dict(
        vocab_size=320,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=5,
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=3,
        sliding_window=8,
        layer_types=[SWA, CSA, HCA, CSA, HCA],
        compress_rates={CSA: 4, HCA: 16},
        num_hash_layers=2,
        rope_scaling=yarn(64),
        max_position_embeddings=4096,
    ),
    "hca128": dict(
        vocab_size=300,
        hidden_size=48,
        moe_intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        head_dim=32,
        q_lora_rank=24,
        qk_rope_head_dim=16,
        o_groups=4,
        o_lora_rank=8,
        n_routed_experts=6,
        num_experts_per_tok=3,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=20,
        sliding_window=16,
        layer_types=[HCA, CSA, SWA],
        compress_rates={CSA: 4, HCA: 128},
        num_hash_layers=1,
        rope_scaling=yarn(),
        max_position_embeddings=4096,
    ),
    "wide-groups": dict(
        vocab_size=280,
        hidden_size=96,
        moe_intermediate_size=40,
        num_hidden_layers=4,
        num_attention_heads=6,
        head_dim=64,
        q_lora_rank=48,
        qk_rope_head_dim=32,
        o_groups=3,
        o_lora_rank=24,
        n_routed_experts=10,
        num_experts_per_tok=4,
        index_n_heads=24,
        index_head_dim=64,
        index_topk=6,
        sliding_window=12,
        layer_types=[CSA, CSA, HCA, SWA],
        compress_rates={CSA: 4, HCA: 8},
        num_hash_layers=0,
        routed_scaling_factor=2.5,
        rope_scaling=yarn(128),
        max_position_embeddings=4096,
    ),
}
SEQ_LEN = {"all-kinds": 90, "hca128": 300, "wide-groups": 75}
