"""The sliding-window part of attention: a ring of the last ``sliding_window`` kv rows."""

from __future__ import annotations

import torch

from .batch import Group
from .state import write_rows


def ring_positions(last: torch.Tensor, w: int) -> torch.Tensor:
    """``[..., w]`` absolute position held by each ring slot once ``last`` was written (slot i
    holds the newest position p <= last with p % w == i; negative = never written)."""
    slots = torch.arange(w, device=last.device)
    return last[..., None] - torch.remainder(last[..., None] - slots, w)


def window_keys(
    ring: torch.Tensor, kv: torch.Tensor, g: Group, window: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys for a group's chunks: each chunk's ring (positions before the chunk) then its own kv
    ``[C, L, d]``, ``[C, R + L, d]``, with each key's absolute position ``[C, R + L]`` (negative
    = empty slot). Writes each chunk's last ``R`` rows into its ring, ready for the next chunk.
    Chunks that fit the ring's spare rows (decode; a verify chunk of ``k + 1`` rows in a ring of
    ``window + k``) get ``[C, R, d]``: the ring read after the write (``reads_after_write``).
    Ring rows below the group's ``floor`` count as empty (they hold another sequence's rows).
    ``window``: the rows the queries see (None: the ring's width, a ring with no spare rows)."""
    w = ring.shape[1]
    if reads_after_write(ring, kv, w if window is None else window):
        write_window(ring, kv, g)
        return ring[g.slots], _floored(ring_positions(g.ends - 1, w), g)
    held = _floored(ring_positions(g.starts - 1, w), g)
    before = ring[g.slots]  # read before the write below
    write_window(ring, kv, g)
    return torch.cat([before.to(kv.dtype), kv], 1), torch.cat([held, g.positions], 1)


def _floored(held: torch.Tensor, g: Group) -> torch.Tensor:
    return held if g.floor is None else torch.where(held >= g.floor[:, None], held, -1)


def reads_after_write(ring: torch.Tensor, kv: torch.Tensor, window: int) -> bool:
    """Chunks of at most ``ring - window + 1`` rows (decode; verify chunks in a ring with spare
    rows) write their rows first and read their whole window from the ring: the rows a chunk
    starting at p overwrites hold positions before ``p - window + 1``, outside every one of its
    queries' windows. Read-after-write lets Inductor scatter into the ring in place; a read
    before the write made it copy the whole ring twice per layer (out-of-place index_put, then
    copy_ back): ~15 us a layer on an H200 at a 64-request P8 decode, 28.6 us a layer for a
    V4.1-width verify step (tests/compile/test_window_in_place.py)."""
    return kv.shape[1] <= ring.shape[1] - window + 1 and kv.dtype == ring.dtype


def write_window(ring: torch.Tensor, kv: torch.Tensor, g: Group) -> None:
    """Each chunk's last ``W`` rows of ``kv`` ``[C, L, d]`` into its ring slots."""
    w = ring.shape[1]
    pos = g.positions
    write_rows(ring, g.slots, torch.remainder(pos, w), kv, g.valid & (pos >= g.ends[:, None] - w))


def window_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``[..., T, N]``: 0 where query t may see key p (``t - window < p <= t``, p a real
    position), else -inf. Rows past a chunk's end sit after every real query, so causality
    alone hides them."""
    d = q_pos[..., :, None] - k_pos[..., None, :]
    ok = (k_pos[..., None, :] >= 0) & (d >= 0) & (d < window)
    return torch.zeros(ok.shape, device=q_pos.device).masked_fill(~ok, float("-inf"))
