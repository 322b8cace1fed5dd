"""``deepinfer::rope_table``: the RoPE cos / sin tables of a step as real buffers.

Inductor inlines pointwise producers into their consumers, so a table built inside a compiled
step is recomputed by every kernel that reads it: the rotation of a ``[T, 64, 512]`` prefill
query re-evaluates the YaRN frequencies and ``cos`` / ``sin`` for each of its 2^27 elements
(~0.7 ms a layer on an H200 at 4096 tokens). An op's outputs are always materialised, so the
swap ``rope_table_op`` routes prefill-sized tables through this op and the rotation kernels
read ``[T, rope_dim / 2]`` values instead. The reference is ``graphs/rope.py::cos_sin``.

No ``from __future__ import annotations``: ``custom_op`` infers the schema from the annotations.
"""

import torch

from ..graphs.rope import cos_sin
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
