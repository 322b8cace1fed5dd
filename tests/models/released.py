"""The released models' configs as tests name them: short ids over the packaged files
(``deepinfer_fx/config/released``), read with the project's own parser."""

from __future__ import annotations

from pathlib import Path

from deepinfer_fx.config import ModelConfig, load_config
from deepinfer_fx.config import released_config as packaged

# Test ids -> stems of the packaged released configs (HF config.json form).
RELEASED: dict[str, str] = {
    "v4-flash": "deepseek_v4_flash",
    "v4-flash-0731": "deepseek_v4_flash_0731_dspark",
    "v41-flash": "deepseek_v41_flash",
    "v4-pro": "deepseek_v4_pro",
}


def released_path(name: str) -> Path:
    """The config file of released model ``name`` (a key of ``RELEASED``)."""
    return packaged(RELEASED[name])


def released_config(name: str) -> ModelConfig:
    return load_config(released_path(name))
