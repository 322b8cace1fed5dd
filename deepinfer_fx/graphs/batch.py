"""A step's input: chunks of several sequences packed into one token dimension.

Dense work (projections, mHC, MoE) runs on all packed tokens at once. The parts that read a
sequence's own cache (window, compressor, indexer, attention core) run on *groups*: chunks of
one length laid out ``[C, L]``, every per-chunk quantity a tensor (slot, start, length). So the
same functions serve an eager step, a compiled one and a CUDA-graph replay; the compiled
steps pad a group to a bucket with chunks of length 0 on the state's scratch slot, and rows
past a chunk's length are never written anywhere but the scratch slot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from .swap import swappable


@dataclass(frozen=True)
class Chunk:
    """Host-side description of one chunk (eager callers that need Python ints)."""

    slot: int  # the sequence's state slot
    start: int  # absolute position of the chunk's first token
    offset: int  # index of the first token in the packed batch
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)


@dataclass(frozen=True)
class Group:
    """Chunks laid out ``[C, L]``. ``index[c, j]``: the packed row of token j of chunk c; rows at
    or past ``lens[c]`` are padding: row N (a padding row the caller appends) in eager batches,
    the bucket's own padding rows in compiled steps (``valid`` tells them apart either way)."""

    index: torch.Tensor  # [C, L] long
    slots: torch.Tensor  # [C] long
    starts: torch.Tensor  # [C] long
    lens: torch.Tensor  # [C] long
    # Static: ``index`` is ``arange(C * L).view(C, L)`` and the batch has no other rows (every
    # compiled step; an eager batch of equal-length chunks). Gathers are then views and the
    # attention output needs no scatter: at a 4096-token P8 prefill those copies of the
    # [T, 64, 512] query and output move ~1 GB per layer (estimated from the shapes).
    packed: bool = False
    # ``[C]``: keys before this position are not the chunk's sequence's (V4.1 compact prefill's
    # replayed decoder layers never wrote their rings below the replay start); None: position 0
    floor: torch.Tensor | None = None

    @classmethod
    def one(cls, start: int, length: int, slot: int = 0, device=None) -> "Group":
        """One chunk of ``length`` tokens at ``start`` in ``slot``, its rows packed from 0."""
        meta = torch.tensor([slot, start, length], device=device)
        return cls(torch.arange(length, device=device)[None], *meta[:, None].unbind(0))

    @property
    def positions(self) -> torch.Tensor:
        """``[C, L]`` absolute position of every (chunk, row), past the chunk's end too."""
        return self.starts[:, None] + torch.arange(self.index.shape[1], device=self.index.device)

    @property
    def valid(self) -> torch.Tensor:
        """``[C, L]`` bool: the row is one of the chunk's tokens."""
        return torch.arange(self.index.shape[1], device=self.index.device) < self.lens[:, None]

    @property
    def ends(self) -> torch.Tensor:
        return self.starts + self.lens


@dataclass(frozen=True)
class Queries:
    """The query side of a group when it is not the whole group (context parallelism): a
    rank's rows ``[C, Lq]`` of each chunk (padding -> row N) and their absolute positions
    (padding: -1, which sees no key)."""

    index: torch.Tensor  # [C, Lq] long
    positions: torch.Tensor  # [C, Lq] long
    # Static: ``index`` is ``arange(C * Lq).view(C, Lq)`` and the batch has no other rows (a
    # compiled step's static split, ``sharding/cp.split_bucket``): gathers are views, as ``Group.packed``
    packed: bool = False


@dataclass(frozen=True)
class Batch:
    token_ids: torch.Tensor  # [N] packed
    positions: torch.Tensor  # [N] absolute position of each token
    groups: tuple[Group, ...]
    chunks: tuple[Chunk, ...] = ()  # host-side view; empty inside compiled steps
    split: ContextSplit | QuerySubset | None = None  # a context-parallel rank's share, or a subset of the queries
    # Image spans (V4.1 vision, eager steps only): ``embeds`` ``[N, D]`` replaces the token
    # embeddings of every row; ``image_rows`` ``[N]`` bool marks the span rows, which route with
    # ``bias_vl`` and are DEAD for Engram. None: a text-only batch (every compiled step).
    embeds: torch.Tensor | None = None
    image_rows: torch.Tensor | None = None

    @property
    def keys(self) -> Batch:
        """The batch whose chunks the cache side (window, compressor, indexer keys) runs on."""
        return self if self.split is None else self.split.full

    @property
    def queries(self) -> tuple[Group | Queries, ...]:
        """Per key-side group, the rows of this batch that query it."""
        return self.groups if self.split is None else self.split.queries

    @property
    def real_rows(self) -> torch.Tensor:
        """``[N]`` bool: rows that are some chunk's token, not a compiled bucket's padding."""
        n = self.token_ids.shape[0]
        real = torch.zeros(n + 1, dtype=torch.bool, device=self.token_ids.device)
        for g in self.queries:
            token = g.valid if isinstance(g, Group) else g.positions >= 0
            real[torch.where(token, g.index, n).reshape(-1)] = True  # padding lands on row N, cut off
        return real[:n]


@dataclass(frozen=True)
class ContextSplit:
    """A context-parallel rank's share of whole chunks (``sharding/cp.py`` builds it). The
    batch's own rows are this rank's tokens; ``full`` is the whole chunks, on which every rank
    of the CP group runs the cache side identically (so the state stays replicated and correct
    at the seams between the ranks' pieces); ``queries[i]`` are this rank's rows of
    ``full.groups[i]``. ``source[j]``: where full row j sits in the group's gathered rows (each
    rank's rows padded to ``width``); ``rows[i]``: the full row of local row i."""

    full: Batch
    queries: tuple[Queries, ...]
    source: torch.Tensor  # [N_full] long
    rows: torch.Tensor  # [N_local] long
    width: int


@dataclass(frozen=True)
class QuerySubset:
    """Some rows of each of ``full``'s chunks as the query side (V4.1 compact prefill's first
    decoder layer, ``graphs/yoco.py``): the cache side runs on every row of ``full``, and the
    caller hands attention those rows' inputs (``keys_x``); ``queries[i]`` index this batch's rows."""

    full: Batch
    queries: tuple[Queries, ...]


@swappable
def context_gather(x: torch.Tensor, split: ContextSplit) -> torch.Tensor:
    """This rank's rows ``x`` ``[N_local, ...]`` -> the whole chunks' rows ``[N_full, ...]``.
    In one process (a CP group of one) that is a reordering; ``sharding/cp.py`` swaps in the
    all-gather over the CP group."""
    pad = x.new_zeros((split.width - x.shape[0], *x.shape[1:]))
    return torch.cat([x, pad])[split.source]


def owned_rows(x: torch.Tensor, split: ContextSplit, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` ``[R]`` of the whole chunks (``split.full``'s packed rows) from this rank's
    ``x`` ``[N_local, ...]``, each taken from the rank that owns it: every rank picks its own
    candidate for each row and one ``context_gather`` of ``R`` rows keeps the owner's, so every
    rank of the group gets the same ``[R, ...]`` (a head over them samples alike)."""
    src = split.source[rows]
    # another rank's row may index past this rank's rows: any row of ours will do, it is not kept
    mine = x[(src % split.width).clamp(max=x.shape[0] - 1)]
    n = rows.shape[0]
    owners = torch.div(src, split.width, rounding_mode="floor") * n + torch.arange(n, device=rows.device)
    return context_gather(mine, ContextSplit(split.full, (), owners, rows, n))


def gather_rows(x: torch.Tensor, g: Group | Queries) -> torch.Tensor:
    """Packed ``x`` ``[N, ...]`` -> ``[C, L, ...]`` (padding rows are zeros; a packed group's
    padding rows are the batch's own, and the result is a view wherever x's strides allow)."""
    if g.packed:
        return x.reshape(*g.index.shape, *x.shape[1:])
    pad = torch.zeros((1, *x.shape[1:]), dtype=x.dtype, device=x.device)
    return torch.cat([x, pad])[g.index]


def rows_to_packed(parts: Sequence[tuple[Group | Queries, torch.Tensor]], n: int) -> torch.Tensor:
    """Per-group results ``y`` ``[C, L, ...]`` -> packed ``[n, ...]`` (rows no group covers are
    zeros). One packed group's result is reshaped, not copied."""
    if len(parts) == 1 and parts[0][0].packed:
        y = parts[0][1]
        return y.reshape(n, *y.shape[2:])
    y0 = parts[0][1]
    out = torch.zeros((n + 1, *y0.shape[2:]), dtype=y0.dtype, device=y0.device)
    for g, y in parts:
        scatter_rows(out, g, y)
    return out[:-1]


def scatter_rows(out: torch.Tensor, g: Group | Queries, y: torch.Tensor) -> None:
    """Write ``y`` ``[C, L, ...]`` back to the packed rows of ``out`` ``[N + 1, ...]``; padding rows
    all land on the extra last row, which the caller drops."""
    out[g.index] = y.to(out.dtype)


def group_chunks(chunks: Sequence[Chunk], device=None) -> tuple[Group, ...]:
    """Eager grouping: chunks of equal length share a group (all decode rows form one)."""
    by_len: dict[int, list[Chunk]] = {}
    for ch in chunks:
        by_len.setdefault(ch.length, []).append(ch)
    groups = []
    for length, chs in sorted(by_len.items()):
        index = torch.tensor([[ch.offset + j for j in range(length)] for ch in chs], dtype=torch.long)
        meta = torch.tensor([[ch.slot, ch.start, ch.length] for ch in chs], dtype=torch.long)
        groups.append(Group(index.to(device), *(m.to(device) for m in meta.unbind(1))))
    if len(groups) == 1 and torch.equal(index.reshape(-1), torch.arange(index.numel())):
        # every chunk one length, in packed order, and every row of the batch in this group
        groups[0] = dataclasses.replace(groups[0], packed=True)
    return tuple(groups)


def make_batch(
    token_lists: Sequence[Sequence[int] | torch.Tensor], slots: Sequence[int], starts: Sequence[int], device=None
) -> Batch:
    """Pack one chunk per sequence: ``token_lists[i]`` continues slot ``slots[i]`` at ``starts[i]``."""
    if not (len(token_lists) == len(slots) == len(starts)) or not token_lists:
        raise ValueError("make_batch needs one slot and one start per token list, and at least one list")
    if len(set(slots)) != len(slots):
        raise ValueError(f"a batch holds at most one chunk per state slot; got slots {list(slots)}")
    ids, pos, chunks, offset = [], [], [], 0
    for toks, slot, start in zip(token_lists, slots, starts):
        t = torch.as_tensor(toks, dtype=torch.long).reshape(-1)
        if t.numel() == 0:
            raise ValueError(f"slot {slot}: a chunk needs at least one token")
        ids.append(t)
        pos.append(torch.arange(start, start + t.numel()))
        chunks.append(Chunk(int(slot), int(start), offset, t.numel()))
        offset += t.numel()
    return Batch(torch.cat(ids).to(device), torch.cat(pos).to(device), group_chunks(chunks, device), tuple(chunks))
