"""RoPE ops for prefill-sized calls: ``deepinfer::rope_table`` and ``deepinfer::rope``.

``rope_table``: the cos / sin tables of a step as real buffers.

Inductor inlines pointwise producers into their consumers, so a table built inside a compiled
step is recomputed by every kernel that reads it: the rotation of a ``[T, 64, 512]`` prefill
query re-evaluates the YaRN frequencies and ``cos`` / ``sin`` for each of its 2^27 elements
(~0.7 ms a layer on an H200 at 4096 tokens). An op's outputs are always materialised, so the
swap ``rope_table_op`` routes prefill-sized tables through this op and the rotation kernels
read ``[T, rope_dim / 2]`` values instead. The reference is ``graphs/rope.py::cos_sin``.

``rope``: the rotation itself, ``graphs/rope.py::apply_rope``. Inductor's code for its
interleaved pairs (slice, stack, flatten, cat) moves the ``[T, 64, 512]`` prefill query and
attention output at ~1.5 TB/s on an H200; the Triton kernel (``kernels/triton/rope.py``)
streams whole rows instead. The swap ``rope_kernel`` routes only prefill-sized calls here.

No ``from __future__ import annotations``: ``custom_op`` infers the schema from the annotations.
"""

import torch

from ..graphs.rope import apply_rope, cos_sin
from .ops import NAMESPACE


@torch.library.custom_op(f"{NAMESPACE}::rope_table", mutates_args=())
def rope_table(positions: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos`` and ``sin`` ``[*positions.shape, len(freq)]`` of ``positions * freq``."""
    cos, sin = cos_sin.reference(positions, freq)
    return cos.contiguous(), sin.contiguous()


@rope_table.register_fake
def _rope_table_fake(positions: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*positions.shape, freq.shape[0])
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


@torch.library.custom_op(f"{NAMESPACE}::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``apply_rope(x, cos, sin, inverse)`` for x ``[*P, ..., d]`` and cos / sin ``[*P, rd/2]``
    with exactly x's leading dims (broadcast over the middle ones only): a new contiguous
    tensor in x's dtype."""
    return apply_rope.reference(x, cos, sin, inverse)  # type: ignore[attr-defined]


@rope.register_fake
def _rope_fake(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> torch.Tensor:
    return x.new_empty(x.shape)
