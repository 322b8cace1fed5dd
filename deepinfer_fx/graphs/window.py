"""The sliding-window part of attention: a ring of the last ``sliding_window`` kv rows."""

from __future__ import annotations

import torch


def window_keys(ring: torch.Tensor, kv: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys for a chunk at ``start``: the ring (positions before the chunk) then the chunk's
    own kv, with each key's absolute position (negative = empty slot). Writes the chunk's last
    rows into the ring, so the state is ready for the next chunk."""
    w = ring.shape[0]
    t = kv.shape[0]
    slots = torch.arange(w, device=kv.device)
    held = (start - 1) - torch.remainder(start - 1 - slots, w)
    positions = torch.cat([held, torch.arange(start, start + t, device=kv.device)])
    keys = torch.cat([ring.to(kv.dtype), kv])
    n = min(t, w)
    ring[torch.remainder(torch.arange(start + t - n, start + t, device=kv.device), w)] = kv[-n:].to(ring.dtype)
    return keys, positions


def window_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """0 where query t may see key p (``t - window < p <= t``, p a real position), else -inf."""
    d = q_pos[:, None] - k_pos[None, :]
    ok = (k_pos[None, :] >= 0) & (d >= 0) & (d < window)
    return torch.zeros(ok.shape, device=q_pos.device).masked_fill(~ok, float("-inf"))
