"""``deepinfer::ring_mqa`` on CUDA: decode attention that reads its keys where they lie.

The flash-decoding kernels of ``attention.py`` in their RING mode: a query's first ``W`` keys are
its chunk's row of the window ring pool, the rest are rows of its chunk's entry pool (all of
them, or those a row list names: the indexer's top-k), and the window's mask comes from the
query's position in the kernel. The gathered keys ``[C, W + K, d]``, their bias and the kernels
that built them per layer are gone; the arithmetic (tiles, splits, merge order) is
``sparse_mqa``'s over the same keys, so the two agree bit for bit.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .. import ops  # noqa: F401  (declares deepinfer::ring_mqa before the registration below)
from .attention import KeySource, launch_mqa
from .buffers import out_buffer


def ring_mqa_triton(
    q: torch.Tensor,
    ring: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    entries: Optional[torch.Tensor],
    entry_rows: Optional[torch.Tensor],
    entry_bias: Optional[torch.Tensor],
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    window: int | None = None,
    out: Optional[torch.Tensor] = None,
    **tiling: Any,
) -> torch.Tensor:
    """``graphs/attention.py::mqa_ring``: q ``[C, 1, H, d]``, ring ``[S, W, d]``, slots and
    pos ``[C]``, entries ``[S, E, d]`` (or None), entry_rows ``[C, K]`` (or None: all E),
    entry_bias ``[C, 1, K]``, sink ``[H]``, cos / sin ``[C, 1, rd/2]``, ``window`` the
    positions a query sees (None: the ring's width ``W``); ``tiling`` as ``attention.launch_mqa``."""
    c, t, h, d = q.shape
    _, w, _ = ring.shape
    k = 0 if entries is None else (entry_rows.shape[1] if entry_rows is not None else entries.shape[1])
    half = cos.shape[-1]
    bad = (
        t != 1
        or ring.shape[2] != d
        or list(slots.shape) != [c]
        or list(pos.shape) != [c]
        or list(sink.shape) != [h]
        or list(cos.shape) != [c, 1, half]
        or sin.shape != cos.shape
        or not 0 < 2 * half <= d
        or (window is not None and not 0 < window <= w)
    )
    if entries is not None:
        bad = bad or (
            entries.shape[0] != ring.shape[0]
            or entries.shape[2] != d
            or entries.dtype != ring.dtype
            or entry_bias is None
            or list(entry_bias.shape) != [c, 1, k]
            or (entry_rows is not None and entry_rows.shape[0] != c)
        )
    if bad:
        shapes = ", ".join(
            f"{n} {None if x is None else (tuple(x.shape), x.dtype)}"
            for n, x in (
                ("q", q),
                ("ring", ring),
                ("slots", slots),
                ("pos", pos),
                ("entries", entries),
                ("entry_rows", entry_rows),
                ("entry_bias", entry_bias),
                ("sink", sink),
                ("cos", cos),
                ("sin", sin),
            )
        )
        raise ValueError(f"ring_mqa: mismatched inputs ({shapes}); one query a chunk, pools of one dtype and depth")
    out = out_buffer(out, q.shape, q.dtype, q.device, "ring_mqa")
    if c == 0:
        return out
    ring = ring if ring.stride(-1) == 1 else ring.contiguous()
    pool = ring if entries is None else (entries if entries.stride(-1) == 1 else entries.contiguous())
    rows = pool if entry_rows is None else entry_rows
    bias = torch.empty(c, 0, device=q.device) if entry_bias is None else entry_bias.reshape(c, k)
    src = KeySource(
        ring,
        pool,
        rows,
        slots,
        pos,
        (ring.stride(0), ring.stride(1), pool.stride(0), pool.stride(1), rows.stride(0), rows.stride(-1)),
        w=w,
        window=w if window is None else window,
        ring=True,
        rows=entry_rows is not None,
    )
    launch_mqa(
        q.reshape(c, h, d),
        1,
        w + k,
        src,
        bias,
        sink,
        cos.reshape(c, half),
        sin.reshape(c, half),
        out.view(c, h, d),
        **tiling,
    )
    return out


def _ring_mqa_cuda(q, ring, slots, pos, entries, entry_rows, entry_bias, sink, cos, sin, window) -> torch.Tensor:
    return ring_mqa_triton(q, ring, slots, pos, entries, entry_rows, entry_bias, sink, cos, sin, window)


torch.library.register_kernel("deepinfer::ring_mqa", "cuda", _ring_mqa_cuda)
