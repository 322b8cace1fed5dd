"""Fusion passes built on Inductor's pattern matcher, usable outside Inductor too.

Why this matcher rather than ``torch.fx.subgraph_rewriter``: patterns are traced from the model's
own functions to ATen with the same decomposition table the compiler applies to the captured
graph, so a pattern and the graph it must find are in one form by construction; scalars (eps,
clamp limits) become wildcards whose values are carried into the replacement; and each match is
re-traced with the matched shapes and dtypes, so a pattern traced once in bf16 also finds fp16
and a pattern traced on 2-D inputs finds 3-D ones. ``subgraph_rewriter`` matches literals
exactly and would need a pattern per eps value.

The graph form passes see: ATen after functionalisation and Inductor's decompositions
(``aten_decompositions()``); ``compiler.py`` produces exactly that on its eager (aot) path, and it
is what Inductor's post-grad custom pass receives on the Inductor path.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from functools import cached_property
from typing import Any

import torch
import torch.fx
from torch._inductor.decomposition import select_decomp_table
from torch._inductor.pattern_matcher import Match, PatternMatcherPass, fwd_only, register_replacement
from torch._subclasses.fake_tensor import unset_fake_temporarily

from ..graphs.swap import references_only
from .manager import GraphPass


def aten_decompositions() -> dict[Any, Callable[..., Any]]:
    """The decomposition table applied to captured graphs and to traced patterns alike."""
    return select_decomp_table()


class PatternFusionPass(GraphPass):
    """A pass made of search -> replacement pairs. Subclasses add them in ``register_patterns``;
    tracing the patterns costs a little, so it happens on first use, not at import."""

    @abstractmethod
    def register_patterns(self, add: Callable[..., None]) -> None:
        """Call ``add(search_fn, replace_fn, example_inputs, scalars=..., extra_check=...)`` per
        variant. Register larger variants (more casts absorbed) first: at a node where two
        variants match, the first registered wins."""

    @cached_property
    def _matcher(self) -> PatternMatcherPass:
        pm = PatternMatcherPass(pass_name=self.name)

        def add(
            search_fn: Callable[..., Any],
            replace_fn: Callable[..., Any],
            example_inputs: Sequence[Any],
            scalars: dict[str, float] | None = None,
            extra_check: Callable[[Match], bool] | None = None,
        ) -> None:
            kwargs: dict[str, Any] = {"scalar_workaround": dict(scalars or {})}
            if extra_check is not None:
                kwargs["extra_check"] = extra_check
            register_replacement(search_fn, replace_fn, list(example_inputs), fwd_only, pm, **kwargs)

        # We may be called inside a compile, with its fake mode and tracing context active; the
        # patterns must be traced with the real example tensors, outside both (as Inductor's own
        # lazily registered patterns are), and from the references, whatever a step has swapped in.
        with torch._guards.tracing(None), unset_fake_temporarily(), references_only():
            self.register_patterns(add)
        return pm

    def __call__(self, gm: torch.fx.GraphModule) -> int:
        n = self._matcher.apply(gm.graph)
        if n:
            gm.graph.eliminate_dead_code()
            gm.recompile()
        return n
