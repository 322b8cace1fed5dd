"""Named places in the model where another implementation may stand in for a function.

The model functions stay the reference math; two kinds of callers replace some of them while a
step runs, without editing the model:

- kernel swaps (``passes/swaps.py``, one table row each): named, disableable passes put a
  ``deepinfer`` op (a fused Triton kernel on NVIDIA) in place of e.g. ``moe.routed_experts``
  while a step is traced, so the op appears in the captured graph and in its dumps;
- sharding (``sharding/``): expert parallelism puts dispatch -> local experts -> combine in
  place of ``moe.expert_parallel`` (one process: every expert is local).

A place is named ``<module>.<function>`` (``moe.routed_experts``). ``swapped({...})`` installs
replacements for the duration of a ``with`` block; blocks nest, the inner one wins. Each
wrapper keeps the original as ``.reference``, which replacements call when they need the math
itself (a kernel op's CPU reference must not dispatch back to the kernel).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_PLACES: dict[str, Callable[..., Any]] = {}
_ACTIVE: dict[str, Callable[..., Any]] = {}


def swappable(fn: F) -> F:
    """Mark ``fn`` as a place others may replace. Costs one dict lookup per call (traced away
    when compiled: Dynamo guards on the lookup's result)."""
    name = f"{fn.__module__.rsplit('.', 1)[-1]}.{fn.__name__}"

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        impl = _ACTIVE.get(name)
        return fn(*args, **kwargs) if impl is None else impl(*args, **kwargs)

    call.reference = fn  # type: ignore[attr-defined]
    call.place = name  # type: ignore[attr-defined]
    _PLACES[name] = call
    return call  # type: ignore[return-value]


def places() -> tuple[str, ...]:
    """Every place a replacement may target."""
    return tuple(sorted(_PLACES))


def reference(place: str) -> Callable[..., Any]:
    """The model's own function at ``place`` (what runs there when nothing replaces it)."""
    return _PLACES[place].reference  # type: ignore[attr-defined]


def active() -> dict[str, Callable[..., Any]]:
    """The replacements in force now (for reports and tests)."""
    return dict(_ACTIVE)


@contextlib.contextmanager
def swapped(impls: Mapping[str, Callable[..., Any]]) -> Iterator[None]:
    """Replace the named places inside the block. An unknown name is an error listing the
    known ones: a typo would otherwise silently leave the reference in place."""
    unknown = sorted(set(impls) - set(_PLACES))
    if unknown:
        raise ValueError(f"unknown swap place(s) {unknown}; known: {list(places())}")
    saved = dict(_ACTIVE)
    _ACTIVE.update(impls)
    try:
        yield
    finally:
        _ACTIVE.clear()
        _ACTIVE.update(saved)


@contextlib.contextmanager
def references_only() -> Iterator[None]:
    """No replacement in force inside the block: what traces the model's own math (the fusion
    passes' patterns) sees the references even when called inside a ``swapped`` step."""
    saved = dict(_ACTIVE)
    _ACTIVE.clear()
    try:
        yield
    finally:
        _ACTIVE.clear()
        _ACTIVE.update(saved)
