"""``deepinfer::skinny_linear``: a dense projection ``x @ w.T`` with few rows and a large weight.

At decode a projection has one row per request (<= 64 in the buckets we serve) against a weight
of tens of MiB, so its time is the time to stream the weight once; cuBLAS picks split-K tiles
that stay well below HBM bandwidth there. The op is ``graphs/norm.py::project`` on a 2-D ``x``
``[M, K]`` and ``w`` ``[N, K]`` (out, in) -> ``[M, N]``, in x's dtype or fp32 (``out_fp32``);
the reference calls that function, so the two cannot drift. The Triton kernel
(``kernels/triton/linear.py``) is batch-invariant: row m's result does not depend on M or on
the other rows.

``deepinfer::skinny_linear_blocks`` is ``graphs/norm.py::project_blocks`` (a block-diagonal
weight stored as its stacked blocks: the grouped output projection ``wo_a``) on the same
kernel, each column tile reading its block's slice of x: at decode the batched matmul it
replaces is a cuBLAS launch that PDL cannot chain to.

``deepinfer::skinny_linear_fp8`` is ``graphs/norm.py::project_fp8``: the same kernel streaming a
block-FP8 weight as stored (a byte an element) and dequantising each tile in registers
(``dense_format="fp8"``).

``deepinfer::skinny_linear_group`` (``skinny_linear_fp8_group``) takes several weights (fp8
weights of one scale block) that project one input, in one launch (``passes/grouping.py``).

``decode_sized`` (``fp8_decode_sized``) is the domain the kernels are built for; the
``skinny_linear_kernel`` (``skinny_linear_fp8_kernel``) swap (``passes/swap_calls.py``) routes
only such calls through the op and leaves the rest to the reference's GEMM.
"""

from __future__ import annotations

import math

import torch

from ..graphs.norm import project, project_blocks, project_fp8
from ..io.quant import fp8_block_of
from .declare import declare_op

# Rows up to which a call counts as decode-sized. Measured on the H200 at P8 widths
# (bench/results/skinny_linear_p8.json): the kernel matches or beats cuBLAS by 1-14 % at 1 and
# 8 rows, and loses 30-40 % at 64 rows, where cuBLAS's tiles reuse the weight better.
MAX_ROWS = 16
# The same for a block-FP8 weight held as stored: there the alternative above MAX_ROWS is not
# cuBLAS on the stored weight but the reference dequantising the whole weight in the graph first
# (a byte read and two written per element, then two read again), so the kernel serves every
# decode bucket (docs/decisions.md, "fp8 projections up to 64 rows").
FP8_MAX_ROWS = 64
# Both weight dims must be multiples of this (full k steps and aligned rows for the kernel).
ALIGN = 16
# Weights one ``skinny_linear_group`` call takes (a V4 CSA layer's fp32 projections of x are five).
MAX_GROUP = 6


def decode_sized(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``project(x, w, ...)`` suits the kernel: 1..MAX_ROWS flattened rows, bf16
    operands, a 2-D weight with both dims multiples of ALIGN. Shapes and dtypes only, so under
    torch.compile this is decided once at trace time, with no host sync."""
    rows = math.prod(x.shape[:-1])
    return (
        0 < rows <= MAX_ROWS
        and x.dtype == w.dtype == torch.bfloat16
        and w.dim() == 2
        and w.shape[0] % ALIGN == 0
        and w.shape[1] % ALIGN == 0
    )


def fp8_decode_sized(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> bool:
    """``decode_sized`` for ``project_fp8(x, w, scale, ...)``: a bf16 x of 1..FP8_MAX_ROWS rows, a
    float8_e4m3fn weight with aligned dims and fp32 scales of a block whose power-of-two part is a
    k tile (>= 16). Shapes and dtypes only (decided once per trace)."""
    rows = math.prod(x.shape[:-1])
    if not (0 < rows <= FP8_MAX_ROWS and x.dtype == torch.bfloat16 and w.dtype == torch.float8_e4m3fn and w.dim() == 2):
        return False
    block = fp8_block_of(w.shape, scale.shape)
    return (
        scale.dtype == torch.float32 and w.shape[0] % ALIGN == 0 and w.shape[1] % ALIGN == 0 and (block & -block) >= 16
    )


def _rows_fake(x: torch.Tensor, w: torch.Tensor, out_fp32: bool, **_: object) -> torch.Tensor:
    """``[M, N]`` for x ``[M, K]`` and w ``[N, K]``, in x's dtype or fp32."""
    return x.new_empty(x.shape[0], w.shape[0], dtype=torch.float32 if out_fp32 else x.dtype)


# x ``[M, K]``, w ``[N, K]`` -> ``x @ w.T`` ``[M, N]`` in x's dtype, or fp32 (``out_fp32``).
skinny_linear = declare_op("skinny_linear", project, _rows_fake)
# The same for a float8_e4m3fn w ``[N, K]`` with fp32 block scales (``project_fp8``).
skinny_linear_fp8 = declare_op("skinny_linear_fp8", project_fp8, _rows_fake)


def _skinny_linear_group(x: torch.Tensor, ws: list[torch.Tensor], out_fp32: bool) -> list[torch.Tensor]:
    """``[skinny_linear(x, w, out_fp32) for w in ws]``: projections of one input, which a
    kernel may stream as one weight (``passes/grouping.py`` forms the groups)."""
    return [project.reference(x, w, out_fp32) for w in ws]  # type: ignore[attr-defined]


skinny_linear_group = declare_op(
    "skinny_linear_group",
    _skinny_linear_group,
    lambda x, ws, out_fp32: [_rows_fake(x, w, out_fp32) for w in ws],
)


def _skinny_linear_fp8_group(
    x: torch.Tensor, ws: list[torch.Tensor], scales: list[torch.Tensor], out_fp32: bool
) -> list[torch.Tensor]:
    """``[skinny_linear_fp8(x, w, s, out_fp32) for w, s in zip(ws, scales)]``: the fp8 form of
    ``skinny_linear_group`` (weights of one scale block)."""
    return [project_fp8.reference(x, w, s, out_fp32) for w, s in zip(ws, scales)]  # type: ignore[attr-defined]


skinny_linear_fp8_group = declare_op(
    "skinny_linear_fp8_group",
    _skinny_linear_fp8_group,
    lambda x, ws, scales, out_fp32: [_rows_fake(x, w, out_fp32) for w in ws],
)

# x ``[M, G*K]`` times the block-diagonal weight of w's ``G`` row blocks (w ``[G*R, K]``) ->
# ``[M, G*R]`` in x's dtype: ``graphs/norm.py::project_blocks`` (the grouped ``wo_a``).
skinny_linear_blocks = declare_op(
    "skinny_linear_blocks", project_blocks, lambda x, w, **_: x.new_empty(x.shape[0], w.shape[0])
)
