"""KV compressor: pools every ``ratio`` tokens into one entry with a channelwise softmax gate.

CSA layers (ratio 4) overlap windows: each token projects two series A and B, and entry w
pools the A halves of window w-1 with the B halves of window w (8 slots, stride 4). HCA layers
pool disjoint windows. The indexer of a CSA layer runs the same compressor at its own width.
An entry exists once its window is complete; its RoPE position is the window's first token.
"""

from __future__ import annotations

from typing import Callable

import torch

from .norm import linear_fp32, rms_norm
from .rope import apply_rope, cos_sin


def new_latents(
    p: dict, st: dict, x: torch.Tensor, start: int, ratio: int, overlap: bool, eps: float
) -> tuple[int, torch.Tensor | None]:
    """Feed the chunk ``x`` ``[T, D]`` (positions ``start..start+T-1``) to the compressor.
    Returns ``(w0, latents)``: the normed, not yet rotated latents ``[n_new, dim]`` of the
    windows that complete in this chunk (``w0`` is the first one's index), or ``None``.
    Without ``wgate`` (V4.1 ratio 1) every token is its own window."""
    t = x.shape[0]
    end = start + t
    dev = x.device
    pos = torch.arange(start, end, device=dev)
    kv = linear_fp32(x, p["wkv"])
    gate = linear_fp32(x, p["wgate"]) if "wgate" in p else torch.zeros_like(kv)
    if "ape" in p:
        gate = gate + p["ape"].float()[torch.remainder(pos, ratio)]

    # Rows of the open window (and, with overlap, of the window before it) come from the ring.
    ring = st["rows_kv"].shape[0]
    first = start - start % ratio - (ratio if overlap else 0)
    hist = torch.arange(first, start, device=dev)
    valid = (hist >= 0)[:, None]
    slot = torch.remainder(hist, ring)
    rows_kv = torch.cat([torch.where(valid, st["rows_kv"][slot], 0.0), kv])
    rows_gate = torch.cat([torch.where(valid, st["rows_gate"][slot], float("-inf")), gate])
    keep = min(ring, end - first)
    keep_slots = torch.remainder(torch.arange(end - keep, end, device=dev), ring)
    st["rows_kv"][keep_slots] = rows_kv[-keep:]
    st["rows_gate"][keep_slots] = rows_gate[-keep:]

    w0, n_new = start // ratio, end // ratio - start // ratio
    if n_new <= 0:
        return w0, None
    dim = p["norm"].shape[0]
    n_win = n_new + (1 if overlap else 0)
    kv_w = rows_kv[: n_win * ratio].unflatten(0, (n_win, ratio))
    gate_w = rows_gate[: n_win * ratio].unflatten(0, (n_win, ratio))
    if overlap:  # slots: A halves of the previous window, then B halves of this one
        kv_w = torch.cat([kv_w[:-1, :, :dim], kv_w[1:, :, dim:]], dim=1)
        gate_w = torch.cat([gate_w[:-1, :, :dim], gate_w[1:, :, dim:]], dim=1)
    pooled = (kv_w * torch.softmax(gate_w, dim=1)).sum(1)
    return w0, rms_norm(pooled, p["norm"], eps)


def store_entries(entries: torch.Tensor, w0: int, values: torch.Tensor) -> None:
    """Write new entries ``w0 ..`` into a slot's entry buffer, with a clear error when full."""
    if w0 + values.shape[0] > entries.shape[0]:
        raise ValueError(f"compressed cache holds {entries.shape[0]} entries; entry {w0 + values.shape[0] - 1} does not fit")
    entries[w0 : w0 + values.shape[0]] = values.to(entries.dtype)


def entry_rope(latents: torch.Tensor, w0: int, ratio: int, freq: torch.Tensor) -> torch.Tensor:
    """An entry's RoPE position is its window's first token."""
    pos = torch.arange(w0, w0 + latents.shape[0], device=latents.device) * ratio
    return apply_rope(latents, *cos_sin(pos, freq))


def compress(
    p: dict,
    st: dict,
    x: torch.Tensor,
    start: int,
    ratio: int,
    overlap: bool,
    freq: torch.Tensor,
    eps: float,
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """V4: pool the chunk, rotate and fake-quantise (``finish``) the new entries, store them,
    and return every entry complete so far, ``[(start + T) // ratio, dim]``."""
    w0, latents = new_latents(p, st, x, start, ratio, overlap, eps)
    if latents is not None:
        pooled = entry_rope(latents, w0, ratio, freq)
        store_entries(st["entries"], w0, finish(pooled) if finish is not None else pooled)
    return st["entries"][: (start + x.shape[0]) // ratio]


def visible_entries(q_pos: torch.Tensor, n_entries: int, ratio: int) -> torch.Tensor:
    """Query t may use entry w once w's window is complete: ``w < (t + 1) // ratio``."""
    w = torch.arange(n_entries, device=q_pos.device)
    return w[None, :] < torch.div(q_pos + 1, ratio, rounding_mode="floor")[:, None]
