"""KV compressor: pools every ``ratio`` tokens into one entry with a channelwise softmax gate.

CSA layers (ratio 4) overlap windows: each token projects two series A and B, and entry w
pools the A halves of window w-1 with the B halves of window w (8 slots, stride 4). HCA layers
pool disjoint windows. The indexer of a CSA layer runs the same compressor at its own width.
An entry exists once its window is complete; its RoPE position is the window's first token.

Everything is per group of chunks ``[C, L]`` with tensor starts and lengths: a chunk of L
tokens completes at most ``L // ratio + 1`` windows, at rows fixed by ``start % ratio``, so the
pooling has a static shape; windows that do not complete are written to the scratch slot.
The pooling after the projections (ring update, window gather, gate softmax, RMSNorm) is the
swap place ``compressor.pool_windows``, so a fused kernel can stand in for it.
"""

from __future__ import annotations

from typing import Callable

import torch

from .batch import Group
from .norm import linear_fp32, rms_norm
from .pointwise import softmax
from .reduce import sum_over
from .rope import apply_rope, cos_sin
from .state import write_rows
from .swap import swappable


def new_latents(
    p: dict, st: dict, x: torch.Tensor, g: Group, ratio: int, overlap: bool, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Feed the group's chunks ``x`` ``[C, L, D]`` to the compressor (the row ring is updated).
    Returns, for the ``n = L // ratio + 1`` windows each chunk could complete: their indices
    ``w`` ``[C, n]``, whether they complete ``[C, n]``, and their normed, not yet rotated latents
    ``[C, n, dim]`` (zeros where they do not complete). Without ``wgate`` (V4.1 ratio 1) every
    token is its own window."""
    kv = linear_fp32(x, p["wkv"])
    gate = None
    if "wgate" in p:
        gate = linear_fp32(x, p["wgate"])
        if "ape" in p:
            gate = gate + p["ape"].float()[torch.remainder(g.positions, ratio)]
    return pool_windows(
        kv, gate, st["rows_kv"], st["rows_gate"], g.slots, g.starts, g.lens, p["norm"], ratio, overlap, eps
    )


@swappable
def pool_windows(
    kv: torch.Tensor,
    gate: torch.Tensor | None,
    rows_kv: torch.Tensor,
    rows_gate: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    norm: torch.Tensor,
    ratio: int,
    overlap: bool,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pooling after the projections: the chunks' projected rows ``kv`` / ``gate``
    ``[C, L, width]`` (fp32; no gate: flat gates) go into the row ring ``rows_kv`` / ``rows_gate``
    ``[slots + 1, ring, width]`` of each chunk's slot (position p at ``p % ring``; a window
    pools ``span`` rows, ``ratio`` or ``2 * ratio`` where windows overlap, and the rest of the
    ring is a speculating engine's spare rows), after the windows have read the rows from
    before the chunk. Returns ``new_latents``' ``(w, complete, latents)``. A swap place:
    on NVIDIA two launches do all of it (``kernels/triton/compressor.py``: pooling over channel
    blocks, then the norm)."""
    if gate is None:
        gate = torch.zeros_like(kv)
    L = kv.shape[1]
    pos = starts[:, None] + torch.arange(L, device=kv.device)
    valid = torch.arange(L, device=kv.device) < lens[:, None]
    ring, span = rows_kv.shape[1], ratio * (2 if overlap else 1)
    before_kv, before_gate = rows_kv[slots], rows_gate[slots]  # read before the write
    write = valid & (pos >= (starts + lens)[:, None] - ring)
    write_rows(rows_kv, slots, torch.remainder(pos, ring), kv, write)
    write_rows(rows_gate, slots, torch.remainder(pos, ring), gate, write)

    # The rows of each chunk that would close a window, and the rows each window pools: from
    # the chunk itself at or after its start, from the ring before it, nothing before position 0.
    start = starts[:, None]
    n = L // ratio + 1
    close = (ratio - 1 - torch.remainder(start, ratio)) + ratio * torch.arange(n, device=kv.device)  # [C, n]
    complete = close < lens[:, None]
    w = torch.div(start + close, ratio, rounding_mode="floor")
    r = (w * ratio - (ratio if overlap else 0))[..., None] + torch.arange(span, device=kv.device)  # [C, n, span]
    src = torch.where(r >= start[..., None], ring + r - start[..., None], torch.remainder(r, ring))
    src = src.clamp(max=ring + L - 1)
    c_idx = torch.arange(kv.shape[0], device=kv.device)[:, None, None]
    use = ((r >= 0) & complete[..., None])[..., None]
    pooled_kv = torch.where(use, torch.cat([before_kv, kv], 1)[c_idx, src], 0.0)
    # windows that do not complete pool zeros with flat gates: finite, and never stored
    fill = torch.where(complete, float("-inf"), 0.0)[..., None, None]
    pooled_gate = torch.where(use, torch.cat([before_gate, gate], 1)[c_idx, src], fill)

    dim = norm.shape[0]
    if overlap:  # slots: A halves of the previous window, then B halves of this one
        pooled_kv = torch.cat([pooled_kv[..., :ratio, :dim], pooled_kv[..., ratio:, dim:]], dim=-2)
        pooled_gate = torch.cat([pooled_gate[..., :ratio, :dim], pooled_gate[..., ratio:, dim:]], dim=-2)
    pooled = sum_over(pooled_kv * softmax(pooled_gate, -2), -2)
    return w, complete, rms_norm(pooled, norm, eps)


def store_entries(
    entries: torch.Tensor, g: Group, w: torch.Tensor, complete: torch.Tensor, values: torch.Tensor
) -> None:
    """Write the completed windows' entries ``values`` ``[C, n, dim]`` at ``w`` of each chunk's slot."""
    write_rows(entries, g.slots, w, values, complete)


def entry_rope(latents: torch.Tensor, w: torch.Tensor, ratio: int, freq: torch.Tensor) -> torch.Tensor:
    """An entry's RoPE position is its window's first token."""
    return apply_rope(latents, *cos_sin(w * ratio, freq))


def compress(
    p: dict,
    st: dict,
    x: torch.Tensor,
    g: Group,
    ratio: int,
    overlap: bool,
    freq: torch.Tensor,
    eps: float,
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    gather: bool = True,
) -> torch.Tensor:
    """V4: pool the chunks, rotate and fake-quantise (``finish``) the new entries, store them,
    and return each chunk's whole entry buffer ``[C, max_entries, dim]`` (``visible_entries``
    says which ones a query may use), or with ``gather=False`` the state's pool of them
    ``[slots + 1, max_entries, dim]``, to be read by ``g.slots``."""
    w, complete, latents = new_latents(p, st, x, g, ratio, overlap, eps)
    pooled = entry_rope(latents, w, ratio, freq)
    store_entries(st["entries"], g, w, complete, finish(pooled) if finish is not None else pooled)
    return st["entries"][g.slots] if gather else st["entries"]


def visible_entries(q_pos: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """``[..., T, n_entries]``: query t may use entry w once w's window is complete,
    ``w < (t + 1) // ratio``."""
    w = torch.arange(n_entries, device=q_pos.device)
    return w < torch.div(q_pos + 1, ratio, rounding_mode="floor")[..., None]
