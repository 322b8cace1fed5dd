"""``deepinfer::compressor_pool``: the KV compressor's pooling after its projections.

The op is ``graphs/compressor.py::pool_windows``: the chunks' projected rows go into the
per-slot row ring (``rows_kv`` / ``rows_gate``, mutated in place, after the windows have read
the rows from before the chunk), and every window a chunk could complete is pooled with a
channelwise softmax over its gate rows and RMS-normed. It returns the window ids, the
completion flags and the latents. The reference is the graphs function itself; the Triton
kernel (``kernels/triton/compressor.py``) registers for CUDA on top.

Declaring the ring as mutated lets torch.compile functionalise the call (an
``auto_functionalized`` node in the ATen graph) and Inductor write the ring in place again.
"""

from __future__ import annotations

import torch

from ..graphs.compressor import pool_windows
from .declare import declare_op

# The kernel's norm holds a pooled latent row whole in registers up to this many channels
# (V4's head_dim is 512, its index_head_dim 128).
MAX_DIM = 8192


def compressor_unserved(dim: int) -> str | None:
    """Why the compressor kernel cannot pool latents of ``dim`` channels, or None."""
    return None if dim <= MAX_DIM else f"{dim}-channel latents: the compressor kernel norms at most {MAX_DIM}"


def _pool_fake(
    kv: torch.Tensor, norm: torch.Tensor, ratio: int, **_: object
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    c, n = kv.shape[0], kv.shape[1] // ratio + 1
    return (
        kv.new_empty((c, n), dtype=torch.long),
        kv.new_empty((c, n), dtype=torch.bool),
        kv.new_empty((c, n, norm.shape[0]), dtype=torch.float32),
    )


# kv / gate ``[C, L, width]`` fp32 (no gate: flat gates) -> window ids ``[C, n]`` long, completion
# ``[C, n]`` bool and fp32 latents ``[C, n, dim]``, ``n = L // ratio + 1``.
compressor_pool = declare_op("compressor_pool", pool_windows, _pool_fake, mutates_args=("rows_kv", "rows_gate"))
