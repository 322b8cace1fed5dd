"""A step's input: chunks of several sequences packed into one token dimension.

Dense work (projections, mHC, MoE) runs on all packed tokens at once; the parts that read a
sequence's own cache (window, compressor, indexer, attention core) run per chunk on that
sequence's state slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Chunk:
    slot: int  # the sequence's state slot
    start: int  # absolute position of the chunk's first token
    offset: int  # index of the first token in the packed batch
    length: int

    @property
    def rows(self) -> slice:
        return slice(self.offset, self.offset + self.length)


@dataclass(frozen=True)
class Batch:
    token_ids: torch.Tensor  # [N] packed
    positions: torch.Tensor  # [N] absolute position of each token
    chunks: tuple[Chunk, ...]


def make_batch(token_lists: Sequence[Sequence[int] | torch.Tensor], slots: Sequence[int], starts: Sequence[int], device=None) -> Batch:
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
    return Batch(torch.cat(ids).to(device), torch.cat(pos).to(device), tuple(chunks))
