"""The released configs, shipped as package data (``config/released/*.json``).

``released_config("deepseek_v41_flash")`` is the path of DeepSeek's ``config.json`` for that
release, as published: V4-Flash, V4-Pro, V4-Flash-0731 (DSpark drafter), V4.1-Flash, and the
official inference code's ``ModelArgs`` files of V4-Flash and V4.1-Flash. ``load_config`` and
``count_params`` read them like any checkpoint's config, so a dry run or a parameter count of a
real model needs no download and nothing outside this package.
"""

from __future__ import annotations

from pathlib import Path

RELEASED_DIR = Path(__file__).resolve().parent / "released"
RELEASED = tuple(sorted(p.stem for p in RELEASED_DIR.glob("*.json")))


def released_config(name: str) -> Path:
    """The packaged file of release ``name`` (a stem of ``RELEASED``, e.g. ``deepseek_v4_flash``)."""
    if name not in RELEASED:
        raise ValueError(f"no released config named {name!r}; known: {', '.join(RELEASED)}")
    return RELEASED_DIR / f"{name}.json"
