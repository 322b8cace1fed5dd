"""The P8 benchmark model: DeepSeek-V4-Flash widths cut to 8 layers and 64 experts.

hidden 4096, 64 heads x 512 (one shared K=V head, rope 64), q/o LoRA 1024, 8 output groups,
indexer 64 x 128 top-512, window 128; layers 2 SWA + 3 CSA + 3 HCA (V4-Flash's alternation);
64 routed experts top-6 + 1 shared, intermediate 2048; hash routing on the first 3 layers as in
V4-Flash. bf16, random weights, no fake-quant (HF transformers, the peer, has none).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from ..config import ModelConfig, config_from_dict

P8: dict[str, Any] = {
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 8,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 128],
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "num_hash_layers": 3,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "bfloat16",
}


def p8_config(**overrides: Any) -> ModelConfig:
    return config_from_dict({**P8, **overrides}, where="P8").replace(fake_quant=False)


def run_info(argv: list[str] | None = None) -> dict[str, Any]:
    """What a result needs to be reproduced: command, settings, commit, GPU, versions.
    ``DEEPINFER_COMMIT`` wins over git: a copied tree may carry a stale ``.git`` (the GPU
    machine's did)."""
    commit = os.environ.get("DEEPINFER_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
            ).stdout.strip()
        except OSError:
            pass
    return {
        "command": " ".join(["python", "-m", "deepinfer_fx.bench." + Path(sys.argv[0]).stem, *(argv or sys.argv[1:])]),
        "commit": commit or "unknown",
        # Settings that change what runs (DEEPINFER_PDL=0, TORCHINDUCTOR_*), as the command ran.
        "env": {
            k: v
            for k, v in sorted(os.environ.items())
            if (k.startswith("DEEPINFER_") and k != "DEEPINFER_COMMIT") or k.startswith("TORCHINDUCTOR_")
        },
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
        "torch": torch.__version__,
    }


def write_result(name: str, result: dict[str, Any], out_dir: str | os.PathLike = "bench/results/latest") -> Path:
    path = Path(out_dir) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def hf_kwargs(layers: int | None = None, config: dict[str, Any] = P8) -> dict[str, Any]:
    """A V4 bench config (P8 by default; ``bench/configs.py``) in HF transformers'
    ``DeepseekV4Config`` spelling (layer types and compress rates instead of DeepSeek's ratio
    list), for the peer runs of the benchmarks."""
    kinds = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    ratios = config["compress_ratios"][: layers or config["num_hidden_layers"]]
    drop = {"model_type", "compress_ratios", "rope_theta", "compress_rope_theta", "torch_dtype"}
    out = {k: v for k, v in config.items() if k not in drop}
    out.update(
        num_hidden_layers=len(ratios),
        layer_types=[kinds[r] for r in ratios],
        compress_rates={kinds[4]: 4, kinds[128]: 128},
        num_hash_layers=min(config["num_hash_layers"], len(ratios)),
    )
    return out
