"""The V4.1 vision path: image processor, ViT, aligner and image spans (pure functions over
the ``vision``, ``aligner`` and ``image_*`` entries of the parameter tree).

Names load on first use (PEP 562): the CLI's ``--help`` must answer before torch and PIL load.
The tower's configuration is ``config.VisionConfig``."""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "preprocess": "processor",
    "resize_plan": "processor",
    "encode": "merge",
    "input_embeddings": "merge",
    "span_ids": "spans",
    "span_length": "spans",
    "expand_placeholders": "spans",
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'deepinfer_fx.vision' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value


__all__ = ["encode", "expand_placeholders", "input_embeddings", "preprocess", "resize_plan", "span_ids", "span_length"]
