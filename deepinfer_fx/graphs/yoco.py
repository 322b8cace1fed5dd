"""V4.1 compact prefill ("YoCo", spec §8.2): the decoder replays only each prompt's last rows.

The encoder runs on every row. At the first decoder layer (the last KV source) every row
computes what the global cache needs: the attention site's collapse and norm, the window kv and
the ratio-1 latent with its index keys (attention's cache side, ``QuerySubset``). The rest of
that layer (queries, selection, attention core, MoE) and every later layer run only on the kept
rows: per chunk, the rows at or after ``keep_from`` (the prompt's length minus KEEP), gathered
into a dense sub-batch ``[C, rows]`` per group. The later layers' rings were never written below
``keep_from`` for this prompt, so their window attention stops there (the kept groups' ``floor``).
Not bit-exact with the full decoder: a kept row's window after the first decoder layer lacks the
rows before the replay start (exact once KEEP >= W + (decoder layers - 1) * (W - 1)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..config import ModelConfig
from .batch import Batch, Group, Queries, QuerySubset


@dataclass(frozen=True)
class Replay:
    """What a forward replays through the decoder, one entry per group of the batch."""

    keep_from: tuple[torch.Tensor, ...]  # [C]: the first position of each chunk's prompt the decoder replays
    rows: tuple[int, ...]  # static kept rows per chunk (>= every chunk's kept count; compiled: the bucket's)


@dataclass(frozen=True)
class Kept:
    """The kept rows of a batch: as the query side of the full batch (the first decoder layer)
    and as a batch of their own (the later layers), ``rows[i]`` the full packed row of kept row i
    (padding rows: 0, a real row whose results nothing reads)."""

    queries: Batch
    batch: Batch
    rows: torch.Tensor  # [N_kept] long


def first_kept(starts: torch.Tensor, lens: torch.Tensor, keep_from: torch.Tensor) -> torch.Tensor:
    """Each chunk's first position the decoder replays: ``keep_from`` within ``[start, start + len]``
    (a chunk wholly before it keeps nothing: its end)."""
    return torch.minimum(torch.maximum(starts, keep_from), starts + lens)


def kept_rows(batch: Batch, replay: Replay) -> Kept:
    """Lay out each chunk's rows at or after its ``keep_from`` as ``[C, rows]`` per group, packed
    group after group; kept row j of chunk c is the chunk's row ``len - kept + j``."""
    groups, queries, rows, offset = [], [], [], 0
    for g, keep_from, width in zip(batch.groups, replay.keep_from, replay.rows):
        first = first_kept(g.starts, g.lens, keep_from)
        n_kept = g.ends - first
        j = torch.arange(width, device=g.index.device)
        col = (first - g.starts)[:, None] + j
        valid = j < n_kept[:, None]
        src = g.index.gather(1, col.clamp(max=g.index.shape[1] - 1))
        rows.append(torch.where(valid & (src < batch.token_ids.shape[0]), src, 0).reshape(-1))
        index = offset + torch.arange(g.slots.shape[0] * width, device=g.index.device).view(-1, width)
        groups.append(Group(index, g.slots, first, n_kept, packed=len(batch.groups) == 1, floor=keep_from))
        queries.append(Queries(index, torch.where(valid, first[:, None] + j, -1)))
        offset += index.numel()
    full_rows = torch.cat(rows)
    ids = batch.token_ids[full_rows]
    positions = torch.cat([g.positions.reshape(-1) for g in groups])
    return Kept(
        Batch(ids, positions, (), (), QuerySubset(batch, tuple(queries))),
        Batch(ids, positions, tuple(groups)),
        full_rows,
    )


def min_keep_tokens(c: ModelConfig, max_draft: int = 0) -> int:
    """The smallest KEEP that compact prefill accepts: the window (the rows the first decode
    step reads in every decoder ring) plus the longest rollback (a draft of ``max_draft``
    tokens and its bonus token, which speculative decoding may roll back). DSpark's context
    windows are ``sliding_window`` rows too, so this bound also keeps every prompt row the
    first draft reads (``engine/steps.dspark_drafts``)."""
    return c.sliding_window + (max_draft + 1 if max_draft > 0 else 0)


def replay_for(batch: Batch, prompt_lens: Sequence[int], keep: int, exact: Sequence[bool] = ()) -> Replay:
    """The eager replay of a host-built batch: chunk i belongs to a prompt of ``prompt_lens[i]``
    tokens and keeps its last ``keep`` (every row where ``exact[i]``: prompt logprobs)."""
    if len(prompt_lens) != len(batch.chunks):
        raise ValueError(
            f"replay_for needs one prompt length per chunk: {len(prompt_lens)} for {len(batch.chunks)} chunks"
        )
    exact = list(exact) or [False] * len(prompt_lens)
    pivot = {ch.offset: (0 if ex else max(0, n - keep)) for ch, n, ex in zip(batch.chunks, prompt_lens, exact)}
    by_offset = {ch.offset: ch for ch in batch.chunks}
    keep_from, widths = [], []
    for g in batch.groups:  # a group's chunk c starts at packed row index[c, 0]
        chunks = [by_offset[int(o)] for o in g.index[:, 0].tolist()]
        pivots = [pivot[ch.offset] for ch in chunks]
        keep_from.append(torch.tensor(pivots, dtype=torch.long, device=g.index.device))
        widths.append(max([ch.start + ch.length - max(ch.start, p) for ch, p in zip(chunks, pivots)] + [1]))
    return Replay(tuple(keep_from), tuple(widths))
