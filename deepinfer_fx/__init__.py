"""deepinfer_fx: offline inference engine for DeepSeek-V4-class MoE models."""

from .api import Model, load_model, logits, random_model
from .config import ModelConfig, config_from_dict, load_config
from .engine import LLM, CompletionOutput, EngineType, RequestOutput, SamplingParams
from .graphs.params import count_params as _count_params
from .io.writer import write_random_checkpoint


def count_params(config, mtp: bool = False, engram: bool = False) -> int:
    """Parameters of a config (a ModelConfig, an HF config dict or a config.json path), counted
    without allocating; draft layers and V4.1 Engram tables are excluded unless asked for."""
    if isinstance(config, dict):
        config = config_from_dict(config)
    elif not isinstance(config, ModelConfig):
        config = load_config(config)
    return _count_params(config, mtp=mtp, engram=engram)


__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineType",
    "RequestOutput",
    "SamplingParams",
    "Model",
    "ModelConfig",
    "config_from_dict",
    "count_params",
    "load_config",
    "load_model",
    "logits",
    "random_model",
    "write_random_checkpoint",
]
