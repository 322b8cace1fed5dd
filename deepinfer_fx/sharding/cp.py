"""Context parallelism: a long prefill chunk split over the ranks of a CP group.

Balanced (zigzag) split: each chunk of L tokens is cut into ``2 * cp`` pieces and rank r takes
pieces r and ``2cp - 1 - r``, so every rank holds early and late positions and the causal
attention work is even. A rank computes everything per token (embeddings, mHC, projections,
queries, attention of its own queries, MoE) on its share only. The cache side of attention
(window ring, compressor pooling, index keys) needs every token of the chunk: the attention
input rows of the whole CP group are all-gathered (``graphs.batch.context_gather``) and every
rank runs the cache side on the whole chunk identically. So the state stays replicated and
exact at the seams between pieces, and later chunks and decode steps read it on any CP rank.

In the engine (``LLM(mesh="cp2,...")``) the ranks of a CP group serve the same requests; decode
steps run whole on every CP rank, and the logits a prefill step samples come from the rank
owning each row (``graphs.batch.owned_rows``), so every CP rank samples alike. Two splits:

- compiled steps (``split_bucket``): static, from the bucket's shape alone: each chunk's padded
  length L (a multiple of ``2 * cp``, ``ContextRank.length``) cut into ``2 * cp`` equal pieces,
  whatever the chunk's real length; rows past it stay padding. One graph serves every step of a
  bucket, and the all-gather is a functional collective, which Dynamo traces;
- eager steps (``split_step``): built on the host per step from the chunks' real lengths, only
  for steps with a chunk of at least ``2 * cp`` tokens (no padding rows).
"""

from __future__ import annotations

from dataclasses import dataclass
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


def split_bucket(full: Batch, rank: int, size: int) -> Batch:
    """This rank's static share of a compiled step's bucket ``full`` (one packed group ``[C,
    L]``, L a multiple of ``2 * size``): pieces ``rank`` and ``2 * size - 1 - rank`` of every
    chunk's L rows, real or padding, built on the device from the shape alone (no host sync).
    Its rows past a chunk's length are queries at position -1: they see no key, send no EP
    pairs (``Batch.real_rows``) and the cache side (on ``full``) writes them to the scratch slot."""
    (g,) = full.groups
    n_chunks, length = g.index.shape
    n = 2 * size
    if length % n:
        raise ValueError(f"a static split over {size} ranks needs chunks padded to a multiple of {n}, not {length}")
    piece, dev = length // n, g.index.device
    offsets = torch.arange(length, device=dev).view(n, piece)
    within = torch.cat([offsets[rank], offsets[n - 1 - rank]])  # [2P] this rank's offsets in a chunk
    rows = g.index[:, within].reshape(-1)
    width = n_chunks * 2 * piece  # every rank holds as many rows: no padding to gather
    local = torch.arange(width, device=dev).view(n_chunks, 2, piece)
    # full row (c, piece k, i) is row c * 2P + i (first piece) or c * 2P + P + i of rank min(k, n - 1 - k)
    source = torch.stack([local[:, int(k >= size)] + min(k, n - 1 - k) * width for k in range(n)], 1)
    positions = g.starts[:, None] + within
    queries = Queries(
        local.view(n_chunks, 2 * piece), torch.where(within < g.lens[:, None], positions, -1), packed=True
    )
    split = ContextSplit(full, (queries,), source.reshape(-1), rows, width)
    return Batch(full.token_ids[rows], positions.reshape(-1), (), (), split)


@dataclass(frozen=True)
class ContextRank:
    """This rank's place in its CP group: how the chunks of its steps are shared."""

    rank: int
    size: int

    def step(self, full: Batch) -> Batch:
        """An eager step's share (``split_step``)."""
        return split_step(full, self.rank, self.size)

    def bucket(self, full: Batch) -> Batch:
        """A compiled step's share of its bucket (``split_bucket``)."""
        return split_bucket(full, self.rank, self.size)

    def length(self, n: int) -> int:
        """A chunk length the static split cuts evenly: ``n`` rounded up to a multiple of ``2 * size``."""
        return -(-n // (2 * self.size)) * 2 * self.size


def gather_over(group: dist.ProcessGroup) -> Callable[[torch.Tensor, ContextSplit], torch.Tensor]:
    """The all-gather that replaces ``batch.context_gather`` on a CP group: each rank's rows,
    padded to the split's width, gathered in rank order, then put in the chunks' order. The
    functional collective's ops (in torch 2.11 and 2.13 alike), so a compiled step traces them
    into its graph (no graph break); the group is passed by name and size, plain constants."""
    return partial(_all_gather_rows, name=group.group_name, size=group.size())


def _all_gather_rows(x: torch.Tensor, split: ContextSplit, name: str, size: int) -> torch.Tensor:
    pad = split.width - x.shape[0]
    padded = torch.cat([x, x.new_zeros((pad, *x.shape[1:]))]) if pad else x
    gathered = torch.ops._c10d_functional.all_gather_into_tensor(padded.contiguous(), size, name)
    return torch.ops._c10d_functional.wait_tensor(gathered)[split.source]


def cp_swaps(group: dist.ProcessGroup) -> dict[str, Callable]:
    """``graphs.swap.swapped`` replacements that make a CP group's ranks share their rows."""
    return {"batch.context_gather": gather_over(group)}
