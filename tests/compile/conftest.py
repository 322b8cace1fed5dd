"""Compile tests start from a clean Dynamo and never read a compiled graph from a cache: a cache
hit skips the graph passes, which would make "the pass fired" tests pass or fail by accident."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def fresh_compile() -> Iterator[None]:
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()
