"""RoPE ops: ``deepinfer::rope_table`` and ``deepinfer::rope_`` for prefill-sized calls, and
``deepinfer::rms_norm_rope`` for every size.

``rope_table``: the cos / sin tables of a step as real buffers.

Inductor inlines pointwise producers into their consumers, so a table built inside a compiled
step is recomputed by every kernel that reads it: the rotation of a ``[T, 64, 512]`` prefill
query re-evaluates the YaRN frequencies and ``cos`` / ``sin`` for each of its 2^27 elements
(~0.7 ms a layer on an H200 at 4096 tokens). An op's outputs are always materialised, so the
swap ``rope_table_op`` routes prefill-sized tables through this op and the rotation kernels
read ``[T, rope_dim / 2]`` values instead. The reference is ``graphs/rope.py::cos_sin``.

``rope_``: the rotation itself, ``graphs/rope.py::apply_rope``, done in place on the rotated
tail of each row. Only the last ``rope_dim`` of ``d`` channels change, so a functional rotation
moves 512 channels a row to change 64 of them: at 4096 tokens the ``[T, 64, 512]`` query and
attention output are 268 MB each, ~125 us a call at HBM speed (~2 ms a P8 prefill), while the
tail alone is an eighth of that. The swap ``rope_kernel`` clones x and rotates the clone in
place: Inductor drops the clone where x has no other reader (the query and the attention
output never do), so the compiled step touches the tail only, and keeps it where x is read
again, so the swap stays a functional rewrite. Inductor's own code for the interleaved pairs
(slice, stack, flatten, cat) moved the same tensors at ~1.5 TB/s on an H200.

``rms_norm_rope``: ``graphs/rope.py::norm_rope``, the RMSNorm of each row then the rotation of
its tail. Compiled as written at a small decode it was three launches a call (the norm kernel,
Inductor's rotation of the tail, the concatenation of the halves), twice a layer (the query
heads, the K = V latent).
"""

from __future__ import annotations

import torch

from ..graphs.rope import apply_rope, cos_sin, norm_rope
from .declare import declare_op

# The norm kernel holds rows up to this many channels whole in registers; only those it rotates.
NORM_ROPE_MAX_WIDTH = 16384


def norm_rope_unserved(
    x_shape: torch.Size, weight_shape: torch.Size | None, table_shape: torch.Size, sin_shape: torch.Size
) -> str | None:
    """Why the norm kernel cannot norm and rotate rows of ``x_shape`` (``rms_norm_rope``), or
    None: it takes a weight of the row's width, tables with exactly x's leading dims, and rows
    of an even width it holds whole."""
    d, lead = x_shape[-1], table_shape[:-1]
    if weight_shape is not None and tuple(weight_shape) != (d,):
        return f"a norm weight {list(weight_shape)} for rows of {d}: the norm kernel takes one of the row's width"
    if tuple(x_shape[: len(lead)]) != tuple(lead) or sin_shape != table_shape:
        return f"rope tables {list(table_shape)} for x {list(x_shape)}: the kernel needs tables with x's leading dims"
    if d % 2 or d > NORM_ROPE_MAX_WIDTH or not 0 < 2 * table_shape[-1] <= d:
        return f"rows of {d} channels rotating {2 * table_shape[-1]}: the kernel rotates even rows of up to {NORM_ROPE_MAX_WIDTH}"
    return None


def _rope_table(positions: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos`` and ``sin`` ``[*positions.shape, len(freq)]`` of ``positions * freq``."""
    return cos_sin.reference(positions, freq)  # type: ignore[attr-defined]


def _table_fake(positions: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (*positions.shape, freq.shape[0])
    return positions.new_empty(shape, dtype=torch.float32), positions.new_empty(shape, dtype=torch.float32)


rope_table = declare_op("rope_table", _rope_table, _table_fake, fresh=True)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool) -> None:
    """x ``[*P, ..., d]`` becomes ``apply_rope(x, cos, sin, inverse)``: its last ``2 * cos.shape[-1]``
    channels rotate in place; cos / sin ``[*P, rd/2]`` have exactly x's leading dims (broadcast
    over the middle ones only)."""
    rd = 2 * cos.shape[-1]
    x[..., -rd:] = apply_rope.reference(x[..., -rd:], cos, sin, inverse)  # type: ignore[attr-defined]


rope_ = declare_op("rope_", _rope, mutates_args=("x",))


def _rms_norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``apply_rope(rms_norm(x, weight, eps), cos, sin)`` with ``torch.empty_like(x)``'s layout;
    cos / sin ``[*P, rd/2]`` have exactly x's leading dims (broadcast over the middle ones)."""
    return torch.empty_like(x).copy_(norm_rope.reference(x, weight, eps, cos, sin))  # type: ignore[attr-defined]


rms_norm_rope = declare_op("rms_norm_rope", _rms_norm_rope, lambda x, **_: torch.empty_like(x))
