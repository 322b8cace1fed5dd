"""deepinfer_fx: offline inference engine for DeepSeek-V4-class MoE models.

The public names load on first use (PEP 562), not at import: ``python -m deepinfer_fx.generate
--help`` imports this package first, and must answer before torch would have loaded.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "engine",
    "CompletionOutput": "engine",
    "EngineType": "engine",
    "RequestOutput": "engine",
    "SamplingParams": "engine",
    "Model": "api",
    "load_model": "api",
    "logits": "api",
    "random_model": "api",
    "ModelConfig": "config",
    "config_from_dict": "config",
    "load_config": "config",
    "write_random_checkpoint": "io.writer",
    "input_embeddings": "vision.merge",
}


def count_params(config, mtp: bool = False, engram: bool = False) -> int:
    """Parameters of a config (a ModelConfig, an HF config dict or a config.json path), counted
    without allocating; draft layers and V4.1 Engram tables are excluded unless asked for."""
    from .config import ModelConfig, config_from_dict, load_config
    from .graphs.params import count_params as count

    if isinstance(config, dict):
        config = config_from_dict(config)
    elif not isinstance(config, ModelConfig):
        config = load_config(config)
    return count(config, mtp=mtp, engram=engram)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepinfer_fx' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = sorted([*_EXPORTS, "count_params"])
