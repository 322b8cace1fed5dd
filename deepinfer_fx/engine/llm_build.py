"""What ``LLM.__init__`` builds from its checked arguments: the run dtype, the model it serves
(a ``Model``, ``"demo"``, a path or hub id) and its tokenizer, the lengths and cache budget by
default."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..api import Model, load_model
from ..config import ModelConfig
from ..io.checkpoint import ENV_MODEL_DIR
from ..io.tokenizer import load_tokenizer
from ..graphs import fake_quant as fq
from ..settings import PREFIX, EngineConfig, argument
from .ranks import Ranks

DEFAULT_CPU_BUDGET = 2 << 30


def run_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """``"auto"`` (bf16 on CUDA, fp32 elsewhere), a dtype's name, or a ``torch.dtype`` as given."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        if dtype not in ("bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be 'auto', 'bfloat16', 'float16' or 'float32', got {dtype!r}")
        return getattr(torch, dtype)
    return dtype


def serve_model(
    model: str | os.PathLike | Model | None,
    ranks: Ranks,
    settings: EngineConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    fake_quant: bool | None,
    expert_format: str | None,
    dense_format: str | None = None,
) -> Model:
    """This rank's share of the model: a ``Model`` sharded as given, else loaded (only this
    rank's experts) from ``model``, ``"demo"`` (the built-in tiny model) or ``DEEPINFER_HF_MODEL_DIR``."""
    if isinstance(model, Model):
        given = [n for n, v in (("expert_format", expert_format), ("dense_format", dense_format)) if v is not None]
        if given:  # a Model's weights are served as its config says they are held
            raise ValueError(
                f"{' and '.join(given)} apply when a checkpoint is loaded; this Model is served as it is held "
                f"(held_experts={model.config.held_experts!r}, held_dense={model.config.held_dense!r}): drop "
                f"{' and '.join(given)} or pass a checkpoint path"
            )
        if fake_quant is not None:  # a switch of the forward, not of the weights: it applies here too
            model = Model(model.config.replace(fake_quant=fake_quant), model.params, model.path)
        return ranks.shard(model)
    if model == "demo":
        from ..demo import demo_model_dir

        model = demo_model_dir()
    if model is None and not settings.hf_model_dir:
        raise ValueError(f"no model given: pass LLM(model=path or hub id), set {ENV_MODEL_DIR}, or use model='demo'")
    return load_model(
        model,
        dtype=dtype,
        device=device,
        fake_quant=fake_quant,
        experts=ranks.experts(),
        expert_format=expert_format,
        dense_format=dense_format,
    )


def state_format(c: ModelConfig, kv_format: str | None, settings: EngineConfig) -> str:
    """How the cache holds window kv, compressed entries and index keys: ``kv_format`` (None:
    ``DEEPINFER_KV_FORMAT``) "model", "trained" (refused for a model without fake-quant), or
    "auto": "model" until kernels read the trained format (on the CPU and CUDA alike)."""
    fmt = settings.kv_format if kv_format is None else argument(f"{PREFIX}KV_FORMAT", kv_format)
    if fmt == "trained":
        fq.check_trained(c)
        return fmt
    return "model"


def model_tokenizer(model: Model) -> Any:
    """The checkpoint's ``tokenizer.json``, loaded; None where it has none (token ids only)."""
    if model.path is not None and (Path(model.path) / "tokenizer.json").exists():
        return load_tokenizer(model.path)
    return None


def model_len(c: ModelConfig, max_model_len: int | None) -> int:
    """The longest prompt + output: ``max_model_len`` within the model's limit; default the limit, at most 8192."""
    if max_model_len is not None and max_model_len > c.max_position_embeddings:
        raise ValueError(f"max_model_len {max_model_len} exceeds the model's limit ({c.max_position_embeddings})")
    return min(max_model_len or min(c.max_position_embeddings, 8192), c.max_position_embeddings)


def default_budget(device: torch.device) -> int:
    """The cache pool's bytes when ``memory_budget`` is not given: 80 % of a GPU's free memory
    (the rest stays for the CUDA graph pool), 2 GiB on the CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8)
    return DEFAULT_CPU_BUDGET
