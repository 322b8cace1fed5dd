"""Context parallelism: a long prefill chunk split over the ranks of a CP group.

Balanced (zigzag) split: each chunk of L tokens is cut into ``2 * cp`` pieces and rank r takes
pieces r and ``2cp - 1 - r``, so every rank holds early and late positions and the causal
attention work is even. A rank computes everything per token (embeddings, mHC, projections,
queries, attention of its own queries, MoE) on its share only. The cache side of attention
(window ring, compressor pooling, index keys) needs every token of the chunk: the attention
input rows of the whole CP group are all-gathered (``graphs.batch.context_gather``) and every
rank runs the cache side on the whole chunk identically. So the state stays replicated and
exact at the seams between pieces, and later chunks and decode steps read it on any CP rank.

In the engine (``LLM(mesh="cp2,...")``) the ranks of a CP group serve the same requests; a step
is split when some chunk has at least ``2 * cp`` tokens (``split_step``), else (decode) every CP
rank runs it whole; the logits are gathered back so every CP rank samples alike. CP runs
eagerly for now (the split is built on the host per step), with the kernel swaps of the
accelerator in force unless eager math was asked for (``LLM(eager=True)``).
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from ..graphs.batch import Batch, ContextSplit, Queries


def zigzag_rows(length: int, rank: int, size: int) -> list[int]:
    """The offsets within a chunk of ``length`` tokens that ``rank`` of ``size`` owns, in order."""
    n = 2 * size
    bounds = [(i * length) // n for i in range(n + 1)]
    first, second = rank, n - 1 - rank
    return [*range(bounds[first], bounds[first + 1]), *range(bounds[second], bounds[second + 1])]


def split_batch(full: Batch, rank: int, size: int) -> Batch:
    """This rank's share of ``full`` (a host-built batch with its ``chunks``), as a batch whose
    ``split`` describes the whole chunks. ``size`` 1 gives every row (a valid split)."""
    if not full.chunks:
        raise ValueError("split_batch needs a host-built batch (make_batch), which records its chunks")
    owner = torch.empty(full.token_ids.shape[0], dtype=torch.long)
    local_index = torch.empty_like(owner)
    counts = [0] * size
    mine: list[int] = []
    for ch in full.chunks:
        for r in range(size):
            rows = [ch.offset + j for j in zigzag_rows(ch.length, r, size)]
            owner[rows] = r
            local_index[rows] = torch.arange(counts[r], counts[r] + len(rows))
            counts[r] += len(rows)
            if r == rank:
                mine += rows
    width = max(counts)
    source = owner * width + local_index
    rows = torch.tensor(mine, dtype=torch.long)
    queries = tuple(
        _queries(g.index.cpu(), full.positions.cpu(), owner, local_index, rank, len(mine)) for g in full.groups
    )
    dev = full.token_ids.device
    split = ContextSplit(
        full, tuple(Queries(q.index.to(dev), q.positions.to(dev)) for q in queries), source.to(dev), rows.to(dev), width
    )
    return Batch(full.token_ids[rows.to(dev)], full.positions[rows.to(dev)], (), (), split)


def split_step(full: Batch, rank: int, size: int) -> Batch:
    """The engine's rule: split a step only when some chunk has at least ``2 * size`` tokens (then
    every rank gets rows of it, and so takes part in every gather); a step of short chunks
    (decode) runs whole on every rank of the CP group, which then all compute the same rows."""
    if any(ch.length >= 2 * size for ch in full.chunks):
        return split_batch(full, rank, size)
    return full


def _queries(
    index: torch.Tensor,
    positions: torch.Tensor,
    owner: torch.Tensor,
    local_index: torch.Tensor,
    rank: int,
    n_local: int,
) -> Queries:
    """A group's rows that ``rank`` owns, ``[C, Lq]`` local rows (padding -> ``n_local``) with
    their positions (padding -1)."""
    n_full = owner.shape[0]
    valid = index < n_full
    ours = valid & (owner[index.clamp(max=n_full - 1)] == rank)
    lq = int(ours.sum(1).max()) if ours.numel() else 0
    out_index = torch.full((index.shape[0], lq), n_local, dtype=torch.long)
    out_pos = torch.full((index.shape[0], lq), -1, dtype=torch.long)
    for c in range(index.shape[0]):
        full_rows = index[c][ours[c]]
        out_index[c, : full_rows.numel()] = local_index[full_rows]
        out_pos[c, : full_rows.numel()] = positions[full_rows]
    return Queries(out_index, out_pos)


def gather_over(group: dist.ProcessGroup | None) -> Callable[[torch.Tensor, ContextSplit], torch.Tensor]:
    """The all-gather that replaces ``batch.context_gather`` on a CP group: each rank's rows,
    padded to the split's width, gathered in rank order, then put in the chunks' order."""
    return partial(_all_gather_rows, group=group)


def _all_gather_rows(x: torch.Tensor, split: ContextSplit, group: dist.ProcessGroup | None) -> torch.Tensor:
    size = dist.get_world_size(group)
    padded = torch.cat([x, x.new_zeros((split.width - x.shape[0], *x.shape[1:]))]).contiguous()
    out = x.new_empty((size * split.width, *x.shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    return out[split.source]


def cp_swaps(group: dist.ProcessGroup | None) -> dict[str, Callable]:
    """``graphs.swap.swapped`` replacements that make a CP group's ranks share their rows."""
    return {"batch.context_gather": gather_over(group)}
