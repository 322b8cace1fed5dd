"""Random checkpoints in DeepSeek's own format, for tests and the demo.

Weights are drawn from the parameter specs and stored the way the released checkpoints store
them: dense projections as FP8 e4m3 with ue8m0 block scales when the config has a
``quantization_config``, routed experts as MXFP4 (``expert_dtype: fp4``) or block FP8,
everything else in the config's dtype, split over several safetensors shards with an index.
A real tokenizer (byte-level BPE) is written beside them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..config import ModelConfig, config_from_dict
from ..graphs.params import param_specs
from ..graphs.random_init import random_flat
from ..graphs.engram_hash import check_engram_rows, compressed_vocab, engram_layout
from .quant import quant_fp8_block, quant_fp8_rows, quant_mxfp4
from .tokenizer import MIN_VOCAB_SIZE, build_demo_tokenizer, save_tokenizer

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
MAX_DEMO_TOKENIZER_VOCAB = 1024


def _storage(
    name: str, w: torch.Tensor, quant: str | None, c: ModelConfig, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Checkpoint tensors for one logical weight: the weight and, when quantised, its scale."""
    base = name[: -len(".weight")] if name.endswith(".weight") else name
    if quant == "engram":  # fp8 rows, one ue8m0 scale per 32 channels
        w8, scale = quant_fp8_rows(w.float(), 32)
        return {name: w8, base + ".scale": scale}
    if quant == "fp4":
        packed, scale = quant_mxfp4(w.float())
        return {name: packed, base + ".scale": scale}
    if quant == "fp8":
        w8, scale = quant_fp8_block(w.float(), c.fp8_block or 128)
        return {name: w8, base + ".scale": scale}
    return {name: w.contiguous() if w.dtype in (torch.float32, torch.int64) else w.to(dtype).contiguous()}


def write_random_checkpoint(
    path: str | os.PathLike, config: dict, seed: int = 0, shards: int = 2, mtp: bool = True
) -> Path:
    """Write ``config.json``, random weights (DeepSeek key names, quantised as the config asks)
    in ``shards`` safetensors files with ``model.safetensors.index.json``, and a tokenizer."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = None
    vocab = config.get("text_config", config).get("vocab_size", 0)
    if vocab >= MIN_VOCAB_SIZE:
        tokenizer = build_demo_tokenizer(min(vocab, MAX_DEMO_TOKENIZER_VOCAB))
    config = _complete_engram_fields(config, tokenizer)
    c = config_from_dict(config, where="config")
    dtype = _DTYPES.get(str(config.get("torch_dtype", config.get("dtype", "bfloat16"))), torch.bfloat16)
    quantised = c.fp8_block is not None
    values = random_flat(c, seed, torch.float32, mtp=mtp)
    tensors: dict[str, torch.Tensor] = {}
    for spec in param_specs(c, mtp=mtp):
        quant = spec.quant if quantised or spec.quant == "engram" else None
        w = values[spec.path]
        if quant is not None:
            w = w.to(dtype)  # quantise what a bf16 model would hold
        if spec.stacked:
            for e in range(spec.shape[0]):
                tensors.update(_storage(spec.key.format(e=e), w[e], quant, c, dtype))
        else:
            tensors.update(_storage(spec.key, w, quant, c, dtype))

    names = list(tensors)
    per = -(-len(names) // max(shards, 1))
    weight_map = {}
    groups = [names[i : i + per] for i in range(0, len(names), per)]
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({k: tensors[k] for k in group}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
    )
    (out / "config.json").write_text(json.dumps(config, indent=1))
    if tokenizer is not None:
        save_tokenizer(tokenizer, out)
    return out


def _complete_engram_fields(config: dict, tokenizer) -> dict:
    """V4.1 with Engram layers: fill ``engram_compressed_vocab_size`` (and, if absent,
    ``engram_num_embeddings``) from the tokenizer written beside the weights, and refuse table
    sizes that do not match the hash layout."""
    text = config.get("text_config", config)
    if not text.get("engram_layer_ids"):
        return config
    if tokenizer is None:
        raise ValueError(f"Engram layers need a tokenizer; vocab_size must be at least {MIN_VOCAB_SIZE}")
    n_classes = compressed_vocab(tokenizer)[1]
    text = dict(text)
    text.setdefault("engram_compressed_vocab_size", n_classes)
    probe = dict(text, engram_num_embeddings=text.get("engram_num_embeddings") or [1] * len(text["engram_layer_ids"]))
    layout = engram_layout(config_from_dict(_with_text(config, probe), where="config"), n_classes)
    if "engram_num_embeddings" not in text:
        text["engram_num_embeddings"] = list(layout.rows)
    check_engram_rows(config_from_dict(_with_text(config, text), where="config"), layout)
    return _with_text(config, text)


def _with_text(config: dict, text: dict) -> dict:
    return {**config, "text_config": text} if "text_config" in config else text
