"""The released models' configs, read with the project's own parser: the one place tests find
them. Today they are the workspace's transcriptions (``shared/spec/configs``); a packaged copy
may replace this folder, and only ``released_dir`` then changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from deepinfer_fx.config import ModelConfig, load_config

# Test ids -> file names of the released configs (HF config.json form).
RELEASED: dict[str, str] = {
    "v4-flash": "deepseek_v4_flash.json",
    "v4-flash-0731": "deepseek_v4_flash_0731_dspark.json",
    "v41-flash": "deepseek_v41_flash.json",
    "v4-pro": "deepseek_v4_pro.json",
}


def released_dir() -> Path:
    """The folder holding the released configs."""
    return Path(__file__).resolve().parents[3] / "shared" / "spec" / "configs"


def released_path(name: str) -> Path:
    """The config file of released model ``name`` (a key of ``RELEASED``); skips the calling
    test, saying where it looked, when the file is not there."""
    path = released_dir() / RELEASED[name]
    if not path.is_file():
        pytest.skip(f"released config {RELEASED[name]} not found in {released_dir()} (the workspace's shared/spec/configs)")
    return path


def released_config(name: str) -> ModelConfig:
    return load_config(released_path(name))
