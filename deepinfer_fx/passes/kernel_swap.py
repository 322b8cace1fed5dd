"""Kernel swaps: passes that put a ``deepinfer`` op in place of a whole model function.

Some regions are too large or too shape-dependent for a pattern match on the ATen graph (the
sort-by-expert grouped GEMMs, the unrolled Sinkhorn loop, the masked attention core), yet each
is one function in ``graphs/``. Those functions are swap places (``graphs/swap.py``); a swap
names a place and the op that replaces it, in one ``SwapRow`` of the table in ``swaps.py``, and
the step runner installs the replacement of every enabled swap while it traces and runs a
compiled step (``Pipeline.swaps``). The op then stands in the captured graph as one node, which
the accelerator's kernel executes.

Every row is a pass of its own (one ``KernelSwap``): it has a name, the accelerators it serves
and a uuid, and can be switched off by name (the function's reference math is traced instead).
On the graph itself a swap pass only counts the op nodes it put there: its rewrites in the
start-up report and the dumps. The cpu pipeline runs the swaps too, so the plumbing is tested
where everyone can run it (the ops' CPU kernels are the references).

A call whose shapes the op's kernel cannot serve (``SwapRow.unserved``: an mHC stream count that
is no power of two, a router wider than its tile, ...) is declined: the reference runs there,
and the reason is noted once, while the step is traced, and comes back in the pass's record of
that graph (``PassRecord.declined``, the dumps, ``DeepinferBackend.declines``) and as a warning.
The predicates live beside the ops (``kernels/ops*.py``), where the kernels' own launchers use
them too, so a call of the op on such shapes runs its reference as well.
"""

from __future__ import annotations

import hashlib
import inspect
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from ..graphs.swap import places, reference
from .manager import GraphPass, add_pass

SERVED: frozenset[str] = frozenset({"cpu", "nvidia"})  # Ascend has no kernels for these yet


@dataclass(frozen=True)
class SwapRow:
    """One kernel swap: the pass ``name`` puts ``replacement`` (default: the op ``op`` itself,
    called with the place's arguments) at the ``graphs/swap.py`` place ``place``."""

    name: str  # the pass name: DEEPINFER_DISABLE_PASSES, the dumps, the start-up report
    place: str  # a graphs/swap.py place, e.g. "moe.routed_experts"
    op: str  # the deepinfer op that replaces it; its nodes count as the pass's rewrites
    replacement: Callable[..., Any] | None = None  # the place's signature, calling the op
    # Why the op's kernel cannot serve a call with the place's arguments, or None (it can). Reads
    # static shapes, dtypes and Python values only, so a trace decides it once. None: serves all.
    unserved: Callable[..., str | None] | None = None
    more_ops: tuple[str, ...] = ()  # other ops the replacement calls (counted as rewrites too)
    sources: tuple[object, ...] = ()  # more code that decides what the swap does (enters the uuid)
    accelerators: frozenset[str] = SERVED


# Reasons each swap declined calls for, by pass name, in the order first seen; drained into the
# record of the graph being compiled (KernelSwap.declines).
_DECLINED: dict[str, dict[str, None]] = {}


@torch._dynamo.assume_constant_result  # run while Dynamo traces (once), not in the compiled step
def _note_declined(swap: str, why: str) -> bool:
    if why not in _DECLINED.setdefault(swap, {}):
        _DECLINED[swap][why] = None
        warnings.warn(f"kernel swap {swap!r} declines a call: {why}; the reference runs there")
    return True


class KernelSwap(GraphPass):
    """The pass of one ``SwapRow``, declared in the module ``declared_in`` (its pipeline rank)."""

    def __init__(self, row: SwapRow, declared_in: str) -> None:
        self.row = row
        self.name = row.name  # type: ignore[misc]
        self.accelerators = row.accelerators  # type: ignore[misc]
        self.place = row.place
        self._declared_in = declared_in

    @property
    def declared_in(self) -> str:
        return self._declared_in

    def swap(self) -> dict[str, Callable[..., Any]]:
        row = self.row
        impl = row.replacement or getattr(torch.ops.deepinfer, row.op)
        unserved = row.unserved
        if unserved is None:  # serves every call: nothing to check
            return {row.place: impl}
        ref, name = reference(row.place), row.name

        def checked(*args: Any, **kwargs: Any) -> Any:
            why = unserved(*args, **kwargs)
            if why is None:
                return impl(*args, **kwargs)
            _note_declined(name, why)
            return ref(*args, **kwargs)

        return {row.place: checked}

    def declines(self) -> tuple[str, ...]:
        return tuple(_DECLINED.pop(self.name, ()))

    def sources(self) -> tuple[object, ...]:
        row = self.row
        return (*(f for f in (row.replacement, row.unserved) if inspect.isfunction(f)), *row.sources)

    def uuid(self) -> str:
        """The code's (this class, the row's functions and sources) with the row's place and ops."""
        key = "\0".join((super().uuid(), self.row.place, self.row.op, *self.row.more_ops))
        return hashlib.sha256(key.encode()).hexdigest()

    def targets(self) -> tuple[Any, ...]:
        """The op overloads whose nodes count as this pass's rewrites."""
        return tuple(getattr(torch.ops.deepinfer, op).default for op in (self.row.op, *self.row.more_ops))

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        # An op that writes an argument (the compressor's ring, RoPE in place) is wrapped by
        # functionalisation in an auto_functionalized node whose first argument is the op.
        targets = self.targets()
        wrappers = (torch.ops.higher_order.auto_functionalized, torch.ops.higher_order.auto_functionalized_v2)
        return sum(
            1
            for n in gm.graph.nodes
            if n.op == "call_function" and (n.target in targets or (n.target in wrappers and n.args[0] in targets))
        )


def register_swaps(rows: Iterable[SwapRow], declared_in: str) -> None:
    """Register one ``KernelSwap`` per row, in order, as passes of the module ``declared_in``
    (pass ``__name__``). A place no ``@swappable`` function has, or a name twice, is an error."""
    rows = tuple(rows)
    names = [row.name for row in rows]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"kernel swaps named twice in {declared_in}: {twice}")
    for row in rows:
        if row.place not in places():
            raise ValueError(f"kernel swap {row.name!r} names unknown place {row.place!r}; known: {list(places())}")
        add_pass(KernelSwap(row, declared_in))
