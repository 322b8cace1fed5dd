"""Graph passes: what a pass is, the registry, and the pipeline each accelerator runs.

A pass rewrites an FX graph in place and says how many rewrites it did. It has a name (the
handle users switch it off by), the accelerators it serves, and a uuid derived from its source
code, so that editing a pass changes the compile cache key of every graph it touched.

Passes are switched off by name through the API (``disabled=``) or the environment
(``DEEPINFER_DISABLE_PASSES=a,b``); the two are unioned. A name no registered pass has is an
error that lists the known names, because a typo would otherwise silently leave a pass on.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from ..settings import setting

import torch
import torch.fx

ACCELERATORS: tuple[str, ...] = ("cpu", "nvidia", "ascend")


def accelerator_of(device: torch.device) -> str:
    """The accelerator whose passes serve ``device``."""
    return {"cuda": "nvidia", "npu": "ascend"}.get(device.type, "cpu")


ENV_DISABLE = "DEEPINFER_DISABLE_PASSES"

# Modules whose import registers the built-in passes, in pipeline order. Imported lazily so that
# pass modules can import this one without a cycle.
_BUILTIN_PASS_MODULES: tuple[str, ...] = (
    "deepinfer_fx.passes.fusion",
    "deepinfer_fx.passes.swaps",
    "deepinfer_fx.passes.grouping",
)


class GraphPass(ABC):
    """One named rewrite of an ATen-level FX graph (the form ``compiler.py`` hands to passes)."""

    name: ClassVar[str]
    accelerators: ClassVar[frozenset[str]]

    @abstractmethod
    def __call__(self, gm: torch.fx.GraphModule) -> int:
        """Rewrite ``gm`` in place; return the number of rewrites (0: graph unchanged)."""

    def swap(self) -> dict[str, Callable[..., object]]:
        """Model functions (``graphs/swap.py`` places) this pass replaces while a step is traced;
        most passes rewrite the traced graph instead and swap nothing."""
        return {}

    def sources(self) -> tuple[object, ...]:
        """Functions or modules outside the pass class whose code decides what it does (e.g.
        the model function a pattern is traced from); their source enters the uuid too."""
        return ()

    def declines(self) -> tuple[str, ...]:
        """Why the pass left calls to the reference since it was last asked (a kernel swap whose
        kernel cannot serve a shape, ``kernel_swap.py``); asking clears them. Most passes decline nothing."""
        return ()

    @property
    def declared_in(self) -> str:
        """The module that declares the pass, which places it in the pipeline (``registered_passes``)."""
        return type(self).__module__

    @cached_property
    def _uuid(self) -> str:
        h = hashlib.sha256(self.name.encode())
        # Every class of the pass's own hierarchy below GraphPass: a shared base class (the
        # pattern-matching helper) changes behaviour as much as the subclass does.
        for cls in type(self).__mro__:
            if cls is GraphPass or not issubclass(cls, GraphPass):
                continue
            h.update(inspect.getsource(cls).encode())
        for obj in self.sources():
            h.update(inspect.getsource(obj).encode())  # type: ignore[arg-type]
        return h.hexdigest()

    def uuid(self) -> str:
        """Stable across processes; changes when the pass's code (or its ``sources``) changes."""
        return self._uuid

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} for {sorted(self.accelerators)}>"


_REGISTRY: dict[str, GraphPass] = {}


def register_pass(cls: type[GraphPass]) -> type[GraphPass]:
    """Class decorator: instantiate the pass and add it to the registry (registration order is
    pipeline order)."""
    add_pass(cls())
    return cls


def add_pass(inst: GraphPass) -> None:
    """Add a pass instance to the registry (``register_pass``; the kernel swaps' table rows)."""
    bad = set(inst.accelerators) - set(ACCELERATORS)
    if bad:
        raise ValueError(f"pass {inst.name!r} names unknown accelerators {sorted(bad)}; known: {list(ACCELERATORS)}")
    old = _REGISTRY.get(inst.name)
    if old is not None and (old.declared_in, type(old).__qualname__) != (inst.declared_in, type(inst).__qualname__):
        raise ValueError(f"two passes are named {inst.name!r}: {_origin(old)} and {_origin(inst)}")
    _REGISTRY[inst.name] = inst  # re-registering the same pass (a module reload) replaces it


def _origin(p: GraphPass) -> str:
    return f"{type(p).__qualname__} of {p.declared_in}"


def registered_passes() -> dict[str, GraphPass]:
    """Every registered pass by name, built-ins included, in pipeline order: built-in modules in
    ``_BUILTIN_PASS_MODULES`` order (whichever a caller happened to import first), then any
    other module's passes; registration order within a module."""
    for module in _BUILTIN_PASS_MODULES:
        importlib.import_module(module)
    rank = {m: i for i, m in enumerate(_BUILTIN_PASS_MODULES)}
    ordered = sorted(_REGISTRY.items(), key=lambda kv: rank.get(kv[1].declared_in, len(rank)))  # stable
    return dict(ordered)


def parse_pass_list(value: str) -> frozenset[str]:
    """``"a, b,,c"`` -> {"a", "b", "c"} (the spelling of the env variable and the CLI flag)."""
    return frozenset(part.strip() for part in value.split(",") if part.strip())


def resolve_disabled(disabled: Iterable[str] = (), environ: Mapping[str, str] | None = None) -> frozenset[str]:
    """The union of the API's ``disabled`` and ``DEEPINFER_DISABLE_PASSES``, checked against the
    registry. A known pass that does not serve the chosen accelerator may be named: disabling
    it is a no-op, not a mistake."""
    names = frozenset(disabled) | parse_pass_list(setting(ENV_DISABLE, environ))
    known = registered_passes()
    unknown = sorted(names - set(known))
    if unknown:
        raise ValueError(
            f"unknown graph pass name(s) {unknown} (from disabled= or {ENV_DISABLE}); known passes: {sorted(known)}"
        )
    return names


@dataclass(frozen=True)
class PassRecord:
    """What one pass did to one graph, and why it left calls of it alone (``GraphPass.declines``)."""

    name: str
    uuid: str
    rewrites: int
    declined: tuple[str, ...] = ()


@dataclass(frozen=True)
class Pipeline:
    """The passes one accelerator runs, in order, after the disabled ones are taken out."""

    accelerator: str
    passes: tuple[GraphPass, ...]
    disabled: frozenset[str]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.passes)

    def swaps(self) -> dict[str, Callable[..., object]]:
        """The replacements of every enabled swap pass, for ``graphs.swap.swapped``."""
        out: dict[str, Callable[..., object]] = {}
        for p in self.passes:
            out.update(p.swap())
        return out

    def uuid(self) -> str:
        """The cache-key contribution: accelerator plus each enabled pass's name and uuid, in
        order (switching a pass off changes the key as much as editing it)."""
        h = hashlib.sha256(self.accelerator.encode())
        for p in self.passes:
            h.update(f"\0{p.name}\0{p.uuid()}".encode())
        return h.hexdigest()

    def run(
        self, gm: torch.fx.GraphModule, after_pass: Callable[[GraphPass, PassRecord], None] | None = None
    ) -> list[PassRecord]:
        """Run every pass on ``gm`` in place; ``after_pass`` sees the graph after each one, with
        what the pass did (dumps)."""
        records = []
        for p in self.passes:
            n = p(gm)
            if n:
                gm.graph.lint()  # a broken rewrite fails here, named, not deep inside a backend
                gm.recompile()
            records.append(PassRecord(p.name, p.uuid(), n, p.declines()))
            if after_pass is not None:
                after_pass(p, records[-1])
        return records


def build_pipeline(
    accelerator: str, disabled: Iterable[str] = (), environ: Mapping[str, str] | None = None
) -> Pipeline:
    """The pipeline for ``accelerator`` (cpu, nvidia or ascend) without the disabled passes."""
    if accelerator not in ACCELERATORS:
        raise ValueError(f"unknown accelerator {accelerator!r}; known: {list(ACCELERATORS)}")
    off = resolve_disabled(disabled, environ)
    passes = tuple(p for p in registered_passes().values() if accelerator in p.accelerators and p.name not in off)
    return Pipeline(accelerator, passes, off)
