"""Process-wide launch options of our kernels, set by the engine from its settings.

Kernel launchers run inside custom ops that compiled graphs call, so they cannot take the
engine's settings as arguments; ``LLM`` hands them down here once (``use_pdl(settings.pdl)``),
and nothing below reads the environment. Importable without Triton (a CPU machine has none).
"""

from __future__ import annotations

from ..settings import DEFAULTS

_PDL = [DEFAULTS.pdl]
_CACHES: list[dict] = []  # per-device answers derived from the options (kernels/triton/pdl.py's)


def use_pdl(on: bool) -> None:
    """Whether our kernels and Inductor's may be PDL-launched (``DEEPINFER_PDL``; on by default).
    Devices that cannot (below sm_90, the interpreter, the CPU) launch without it either way."""
    if not isinstance(on, bool):
        raise TypeError(f"use_pdl takes a bool, got {on!r}")
    _PDL[0] = on
    for cache in _CACHES:
        cache.clear()


def pdl_wanted() -> bool:
    return _PDL[0]


def derived_cache() -> dict:
    """A per-device cache that ``use_pdl`` empties when the options change."""
    cache: dict = {}
    _CACHES.append(cache)
    return cache
