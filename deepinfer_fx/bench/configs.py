"""The benchmark models, one table: each released generation's widths cut to a model that fits
one H200 in bf16 (random weights, no fake-quant, as P8).

- ``p8``: V4-Flash widths, 8 layers, 64 experts (``p8.py``; its HF peer runs HF transformers'
  DeepseekV4ForCausalLM on the same weights).
- ``v41``: V4.1-Flash widths, 10 layers: hidden 5120, 64 heads x 512, q LoRA 1280, indexer 32 x
  128 top-512, the two-level top-k (2048 candidate blocks of 8), KV sources 2 (ratio 2, the CED
  encoder) and 5 (ratio 1: the decoder's global KV and the candidate source), index sources 2, 5,
  7 and 9 (7 and 9 reindex over layer 5's keys within its candidates), Engram on layers 1 and 6
  with tables of ~1.6M rows (primes from 65536, where the released tables are 384M rows: each
  fits the device as the compiled steps hold them), 64 experts top-6 of intermediate 2304, and a
  3-stage DSpark head (64 experts top-3), which `bench.spec --method dspark` drafts with.
  No HF peer (transformers has no V4.1).
- ``v41_deep``: ``v41`` at V4.1-Flash's released depth and layer layout (40 layers: ratio 2 on
  layers 2-19, ratio 1 on 20-39; KV sources 2, 8, 14, 20; index sources those and 24-36 by 4;
  candidate source 20; Engram on 1 and 14; DSpark over 37-39), still 64 experts: the depth at
  which the drafter weighs in a step what it weighs as released. It fits one GPU only held as
  released (``HELD_TO_FIT``: MXFP4 experts, FP8 dense; 58.7 GiB of weights by the memory plan).
- ``p8_deep``: ``p8`` at V4-Flash's released depth and layer layout (43 layers: two window-only,
  then CSA and HCA alternating, the last CSA; hash routing on the first 3), still 64 experts:
  with ``bench.spec --method mtp`` the depth at which the MTP-1 drafter weighs in a step what it
  weighs as released. Held as released to fit one GPU (``HELD_TO_FIT``).
- ``pro``: V4-Pro widths, 6 layers: hidden 7168, 128 heads x 512, q LoRA 1536, 16 output groups,
  indexer 64 x 128 top-1024, intermediate 3072, V4-Pro's schedule (two HCA layers, then CSA and
  HCA alternating), 3 hash layers, 64 experts top-6.

``python -m deepinfer_fx.generate --plan --model <a config.json of one>`` gives its bytes.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig, config_from_dict
from ..graphs.engram_hash import engram_layout
from .p8 import P8

V41: dict[str, Any] = {
    "model_type": "deepseek_v41_text",
    "vocab_size": 129280,
    "hidden_size": 5120,
    "num_hidden_layers": 10,
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 1],
    "kv_source_layer_ids": [2, 5],
    "index_source_layer_ids": [2, 5, 7, 9],
    "candidate_source_layer_id": 5,
    "candidate_topk_blocks": 2048,
    "candidate_block_size": 8,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "engram_layer_ids": [1, 6],
    "engram_max_ngram_size": 4,
    "engram_n_heads": 8,
    "engram_head_dim": 256,
    "engram_vocab_size": 65536,
    "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-20,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 3,
    "dspark_block_size": 5,
    "dspark_noise_token_id": 128799,
    "dspark_target_layer_ids": [7, 8, 9],
    "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 64,
    "dspark_num_experts_per_tok": 3,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": [1, 2],
    "torch_dtype": "bfloat16",
}

V41_DEEP: dict[str, Any] = {
    **V41,
    "num_hidden_layers": 40,
    "compress_ratios": [0, 0] + [2] * 18 + [1] * 20,
    "kv_source_layer_ids": [2, 8, 14, 20],
    "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer_id": 20,
    "engram_layer_ids": [1, 14],
    "dspark_target_layer_ids": [37, 38, 39],
}

P8_DEEP: dict[str, Any] = {**P8, "num_hidden_layers": 43, "compress_ratios": [0, 0] + [4, 128] * 20 + [4]}

PRO: dict[str, Any] = {
    **P8,
    "hidden_size": 7168,
    "num_hidden_layers": 6,
    "compress_ratios": [128, 128, 4, 128, 4, 128],
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "o_groups": 16,
    "index_topk": 1024,
    "moe_intermediate_size": 3072,
    "routed_scaling_factor": 2.5,
}

BENCH_CONFIGS: dict[str, dict[str, Any]] = {
    "p8": P8,
    "p8_deep": P8_DEEP,
    "v41": V41,
    "v41_deep": V41_DEEP,
    "pro": PRO,
}
# (expert format, dense format) a config must be held in to fit one GPU; the others fit in bf16
HELD_TO_FIT: dict[str, tuple[str, str]] = {"p8_deep": ("fp4", "fp8"), "v41_deep": ("fp4", "fp8")}


def check_held_to_fit(name: str, expert_format: str, dense_format: str) -> None:
    """Refuse formats in which bench config ``name`` cannot fit one GPU (``HELD_TO_FIT``)."""
    need = HELD_TO_FIT.get(name)
    if need is not None and (expert_format, dense_format) != need:
        raise ValueError(
            f"bench config {name!r} fits one GPU only as released: pass --expert-format {need[0]} "
            f"--dense-format {need[1]} (got {expert_format}, {dense_format})"
        )


def bench_config(name: str, layers: int | None = None, mtp: bool = False) -> ModelConfig:
    """Bench model ``name`` (a key of ``BENCH_CONFIGS``), cut to its first ``layers`` layers
    (None: all); layer roles past the cut are dropped, and the config's own checks refuse a cut
    that leaves a role inconsistent (V4.1's candidate source, say). ``mtp``: with V4's MTP-1
    block after the trunk (a window-only layer; the V4 layouts)."""
    if name not in BENCH_CONFIGS:
        raise ValueError(f"unknown bench config {name!r}; known: {sorted(BENCH_CONFIGS)}")
    d = dict(BENCH_CONFIGS[name])
    n = d["num_hidden_layers"] if layers is None else layers
    if not 0 < n <= d["num_hidden_layers"]:
        raise ValueError(f"bench config {name!r} has {d['num_hidden_layers']} layers; cannot cut it to {n}")
    d.update(
        num_hidden_layers=n,
        compress_ratios=d["compress_ratios"][:n],
        num_hash_layers=min(d.get("num_hash_layers", 0), n),
    )
    if mtp:
        d.update(num_nextn_predict_layers=1, compress_ratios=d["compress_ratios"] + [0])
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids", "dspark_target_layer_ids"):
        if key in d:
            d[key] = [i for i in d[key] if i < n]
    if d.get("candidate_source_layer_id", -1) >= n:
        d["candidate_source_layer_id"] = -1  # HF's spelling of "no two-level top-k"
    if d.get("engram_layer_ids"):  # tables as the hash layout sizes them
        probe = config_from_dict(
            {**d, "engram_num_embeddings": [1] * len(d["engram_layer_ids"])}, where=f"bench {name}"
        )
        d["engram_num_embeddings"] = list(engram_layout(probe).rows)
    return config_from_dict(d, where=f"bench config {name}").replace(fake_quant=False)


def held_as_released(c: ModelConfig, expert_format: str = "bf16", dense_format: str = "bf16") -> ModelConfig:
    """A bench config whose random weights are held as the checkpoints store them: ``expert_format``
    "fp4" (routed experts, the drafter's too, as MXFP4) and ``dense_format`` "fp8" (dense
    projections in block FP8, 128 x 128 blocks unless the config has its own); "bf16" leaves
    either as drawn. The values are drawn in bf16 and quantised, so the kernels read what a
    released checkpoint gives them."""
    if expert_format not in ("bf16", "fp4") or dense_format not in ("bf16", "fp8"):
        raise ValueError(
            f"expert format bf16 or fp4, dense format bf16 or fp8; got {expert_format!r}, {dense_format!r}"
        )
    if expert_format == "fp4":
        c = c.replace(fp8_block=c.fp8_block or 128, expert_dtype="fp4", held_experts="fp4")
    if dense_format == "fp8":
        c = c.replace(fp8_block=c.fp8_block or 128, held_dense="fp8")
        if c.expert_dtype is None:  # the experts stay bf16 (unquantised)
            c = c.replace(expert_dtype="bf16")
    return c
