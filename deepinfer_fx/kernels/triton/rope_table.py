"""RoPE cos / sin tables as one Triton kernel: the CUDA implementation of ``deepinfer::rope_table``.

The reference (``graphs/rope.py::cos_sin``) runs as separate ATen kernels on CUDA (position
cast, outer product, cos, sin, copies): ~4 launches a call, 17 calls a prefill step. Here one
program computes a block of positions x all pairs and writes both tables, so a call is one
launch. The values are the reference's: the position is converted to fp32 first, multiplied by
the fp32 frequency in one rounding, and ``tl.cos`` / ``tl.sin`` lower to libdevice's
``__nv_cosf`` / ``__nv_sinf`` (full range reduction, no ``.approx``), as ATen's CUDA cos does.
The launch configuration depends on shapes only, so the launcher can run inside a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import ops_rope  # noqa: F401  (declares deepinfer::rope_table before we register for it)
from .pdl import pdl_args, wait_previous

# Table elements a program writes: 16 rows of 32 pairs, 4 values (one 16-byte store) a thread.
# Each value inlines a libdevice cos and sin, so more a thread only grows the code.
_TILE = 512
_NUM_WARPS = 4


@triton.jit
def _rope_table_kernel(
    pos_ptr,
    freq_ptr,
    cos_ptr,
    sin_ptr,
    n,
    # F is a compile-time constant (a model has one or two): power-of-two widths need no
    # column masks and their stores vectorise.
    F: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_F: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_previous(PDL)
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_F)
    row_ok = rows < n
    col_ok = cols < F
    pos = tl.load(pos_ptr + rows, mask=row_ok, other=0).to(tl.float32)
    freq = tl.load(freq_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    angles = pos[:, None] * freq[None, :]
    offs = rows[:, None] * F + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    tl.store(cos_ptr + offs, tl.cos(angles), mask=mask)
    tl.store(sin_ptr + offs, tl.sin(angles), mask=mask)


def launch_config(n: int, f: int) -> dict[str, int]:
    """The kernel's block constants and warps, from the shape alone."""
    block_f = triton.next_power_of_2(f)
    rows = max(1, min(_TILE // block_f, triton.next_power_of_2(n)))
    return {"ROWS": rows, "BLOCK_F": block_f, "num_warps": max(1, min(_NUM_WARPS, rows * block_f // 128))}


def rope_table_triton(positions: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos`` and ``sin`` ``[*positions.shape, len(freq)]`` of ``positions.float() * freq``."""
    if freq.dim() != 1 or not freq.is_floating_point() or freq.device != positions.device:
        raise ValueError(
            f"rope_table: freq must be a 1-D float tensor on {positions.device}, "
            f"got {freq.dtype} {tuple(freq.shape)} on {freq.device}"
        )
    f = freq.shape[0]
    shape = (*positions.shape, f)
    cos = torch.empty(shape, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    n = positions.numel()
    if n == 0 or f == 0:
        return cos, sin
    cfg = launch_config(n, f)
    # enable_fp_fusion=False: the angle must be rounded once as a product, like ATen's mul.
    _rope_table_kernel[(triton.cdiv(n, cfg["ROWS"]),)](
        positions.reshape(-1),
        freq.contiguous(),
        cos,
        sin,
        n,
        F=f,
        enable_fp_fusion=False,
        **cfg,
        **pdl_args(cos.device),
    )
    return cos, sin


torch.library.register_kernel("deepinfer::rope_table", "cuda", rope_table_triton)
