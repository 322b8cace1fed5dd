"""The vision tower compiled: a block's two halves around its per-image attention
(``vit.BlockParts``) through ``torch.compile``, one graph each for every image size and every
block (the patch count is dynamic; the weights are inputs, so the 32 blocks share the graph).

The per-image attention stays outside, as ``scaled_dot_product_attention`` calls (flash on the
GPU): the loop over a batch's images would otherwise trace once per image count and size.
The engine compiles the tower where it compiles its steps (``engine/runner.py``)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .requests import encode_requests
from .vit import BlockParts, attention_inputs, block_rest

BACKENDS = ("inductor", "aot_eager")


def _dynamic_rows(fn: Callable, backend: str) -> Callable:
    compiled = torch.compile(fn, backend=backend)

    def call(p: dict, v, *tensors: torch.Tensor):
        for t in tensors:  # rows are patches: one graph for every patch count
            torch._dynamo.maybe_mark_dynamic(t, 0)
        return compiled(p, v, *tensors)

    call.__name__ = f"compiled_{fn.__name__}"
    return call


@functools.cache
def compiled_parts(backend: str) -> BlockParts:
    """``vit.BlockParts`` compiled with ``backend`` (``inductor`` or ``aot_eager``), built once per backend."""
    if backend not in BACKENDS:
        raise ValueError(f"the vision tower compiles with one of {BACKENDS}, got {backend!r}")
    return BlockParts(_dynamic_rows(attention_inputs, backend), _dynamic_rows(block_rest, backend))


def request_encoder(compiled: bool, inductor: bool, batch_invariant: bool) -> Callable[..., None]:
    """The engine's ``encode_requests``: the blocks compiled where the steps are (``inductor``:
    with Inductor, else aot_eager); with batch-invariant inference eager and one image per pass,
    so that an image's features are the same bits whatever else is encoded with it."""
    if batch_invariant:
        return functools.partial(encode_requests, alone=True)
    if not compiled:
        return encode_requests
    return functools.partial(encode_requests, parts=compiled_parts("inductor" if inductor else "aot_eager"))
