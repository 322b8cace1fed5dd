"""The compressed entries a layer's queries attend beside their window: V4's own (every
visible one on HCA layers, the indexer's top-k on CSA; V4.1's come from ``csa2.py``), and a
decode query's chosen entries compacted to k (both generations)."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from . import fake_quant as fq
from .batch import Group
from .compressor import compress, visible_entries
from .indexer import select_entries


def v4_entries(
    p, st, c: ModelConfig, xg, g: Group, xq, q_rq, q_pos, ratio: int, freq, gather: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """V4: the layer's own compressed entries (pooled from the group's chunks ``xg``; the whole
    pool without ``gather``); all visible ones (HCA) or the indexer's top-k for the queries
    ``xq`` / ``q_rq`` at ``q_pos`` (CSA)."""
    overlap = ratio == c.csa_ratio
    entries = compress(
        p["compressor"],
        st["comp"],
        xg,
        g,
        ratio,
        overlap,
        freq,
        c.rms_norm_eps,
        lambda e: fq.compressed_entry(c, e, fq.is_packed(st["comp"]["entries"]), xg.dtype),
        gather=gather,
    )
    if overlap:
        return entries, select_entries(p["indexer"], st["index"], c, xg, g, xq, q_rq, q_pos, freq)
    return entries, visible_entries(q_pos, entries.shape[1], ratio)


def selected_entries(entries: torch.Tensor, chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks of one query (decode): entries ``[C, E, d]`` and their top-k choice ``[C, 1, E]`` (at
    most ``k`` per row) -> the chosen entries in ascending order ``[C, k, d]`` and which of the k
    are real ``[C, 1, k]``. Attention then reads k entries instead of the whole buffer, which at
    a 32k-token state is 8192 per chunk (V4 CSA; V4.1's ratio-1 layers: 32768): at a 256-request
    P8 decode the keys copied for them took ~1 ms and their attention ~2 ms per CSA layer on an
    H200 (19.9 -> 12.0 ms a step at 4k context). Same keys, so the same softmax."""
    idx, real = selected_rows(chosen, k)
    return entries.gather(1, idx[..., None].expand(-1, -1, entries.shape[-1])), real


def selected_rows(chosen: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``selected_entries``' row numbers ``[C, k]`` (ascending; past the last chosen, row 0) and
    which of them are real ``[C, 1, k]``."""
    c = chosen.shape[0]
    # how many entries are chosen up to each one: the j-th chosen entry is the first whose count
    # reaches j (a search, not a scatter: Inductor fuses it with the gather on a GPU)
    count = chosen[:, 0].cumsum(-1)
    rank = torch.arange(1, k + 1, device=chosen.device).expand(c, k).contiguous()
    real = rank <= count[:, -1:]
    return torch.where(real, torch.searchsorted(count, rank), 0), real[:, None, :]
