"""Fixed decode-PPL workloads: a random tiny checkpoint (fixed config and seed) and fixed prompts.

Each workload writes its checkpoint once into ``~/.cache/deepinfer_fx/eval-ppl/`` (a directory
named by the config's digest, so an edited config never reads a stale one). Prompts are token ids:
no tokenizer stands between the workload and the numbers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import EvalError

# every layer kind the tiny widths allow: SWA, CSA (ratio 4, indexer top-k) and HCA (ratio 8)
TINY = {
    "model_type": "deepseek_v4",
    "vocab_size": 300,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 8,
    "compress_ratios": [0, 4, 8],
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
    "moe_intermediate_size": 32,
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
    "num_nextn_predict_layers": 0,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def _prompt(length: int, salt: int) -> list[int]:
    # deterministic, varied ids in [3, 300): no special tokens (0-2) inside a prompt
    return [3 + (salt * 131 + i * 37 + (i * i) % 17) % 297 for i in range(length)]


@dataclass(frozen=True)
class Workload:
    name: str
    config: dict
    seed: int
    prompts: list[list[int]] = field(hash=False)
    max_tokens: int = 16

    def model_dir(self) -> Path:
        """The checkpoint, written on first use (atomically: concurrent runs may race here)."""
        digest = hashlib.sha256(json.dumps([self.config, self.seed], sort_keys=True).encode()).hexdigest()[:12]
        root = Path.home() / ".cache" / "deepinfer_fx" / "eval-ppl"
        final = root / f"{self.name}-{digest}"
        if not (final / "model.safetensors.index.json").exists():
            from ..io.writer import write_random_checkpoint

            root.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(dir=root, prefix=f".{self.name}-"))
            write_random_checkpoint(tmp, self.config, seed=self.seed, mtp=False)
            try:
                os.replace(tmp, final)
            except OSError:  # another process got there first: its copy is the same
                shutil.rmtree(tmp, ignore_errors=True)
        return final


WORKLOADS = {
    w.name: w
    for w in (
        # four prompts of different lengths decoded together: batching, ring wrap-around, a few entries
        Workload(
            "cpu-tiny", TINY, seed=0, prompts=[_prompt(n, s) for s, n in enumerate((5, 12, 23, 40))], max_tokens=16
        ),
        # two longer prompts: the compressed entries and indexer top-k carry most of the context
        Workload(
            "cpu-tiny-long", TINY, seed=1, prompts=[_prompt(n, 7 + s) for s, n in enumerate((180, 257))], max_tokens=8
        ),
    )
}


def workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise EvalError(f"unknown workload {name!r}; known: {', '.join(WORKLOADS)}")
    return WORKLOADS[name]
