"""Structured output's token bitmasks for a step's constrained rows, filled on the host from each
request's grammar state (``structured.MaskFiller``; a verify chunk's rows: ``GrammarState.draft_masks``).
A request whose grammar allows no token gets ``error`` set (``DEAD_GRAMMAR``); the loop ends it."""

from __future__ import annotations

import time
from functools import partial
from typing import Callable, Sequence

import torch

from ..settings import usable_cores
from .structured import GrammarState, MaskFiller, mask_words

DEAD_GRAMMAR = (
    "SamplingParams.so_args: the grammar allows no token of this model's vocabulary at output position {n} "
    "(a pattern the tokenizer cannot spell?)"
)


class GrammarMasks:
    """The token bitmasks of a model's vocabulary (``words`` int32 words a row; ``pinned``: in
    pinned host memory, for an asynchronous copy); ``host_s``: host seconds spent filling them
    (``LoopStats.host_mask``)."""

    def __init__(self, vocab_size: int, pinned: bool) -> None:
        self.words = mask_words(vocab_size)
        self.pinned = pinned
        self.host_s = 0.0
        self._filler: MaskFiller | None = None  # made with the first constrained step (xgrammar loads then)

    def rows(self, chunks: Sequence) -> torch.Tensor | None:
        """The token bitmasks of ``chunks``' rows in order (None: no constrained row among them).
        A request whose grammar allows no token gets ``error`` set here; the loop ends it when
        this step's token comes back."""
        states: list[GrammarState | None] = [ch.seq.grammar if ch.sample else None for ch in chunks]
        if not any(states):
            return None
        t0 = time.perf_counter()
        failed = [i for i, ch in enumerate(chunks) if states[i] is not None and ch.seq.error is not None]
        for ch, st in zip(chunks, states):
            # a matcher must have accepted every token sampled so far, or its mask is stale
            if st is not None and ch.seq.error is None and st.accepted != ch.seq.num_sampled_scheduled - 1:
                raise RuntimeError(
                    f"request {ch.seq.id}: its grammar is {ch.seq.num_sampled_scheduled - 1 - st.accepted} "
                    "token(s) behind; the loop must feed a constrained request's tokens before its next step"
                )
        if self._filler is None:
            self._filler = MaskFiller(usable_cores())
        mask, dead = self._filler.fill(states, self.words, pinned=self.pinned, skip=failed)
        for i in dead:
            chunks[i].seq.error = DEAD_GRAMMAR.format(n=len(chunks[i].seq.output_ids))
        self.host_s += time.perf_counter() - t0
        return mask

    def lend(self) -> Callable[[], None] | None:
        """What gives this step's host mask buffers back for reuse, called once the step is done
        (``StepHandle.wait``): its asynchronous copies read them until then. None: it used none."""
        lent = [] if self._filler is None else self._filler.take_lent()
        return None if not lent else partial(self._filler.give_back, lent)

    def verify_rows(self, chunks: Sequence, length: int) -> torch.Tensor | None:
        """The token bitmasks of verify ``chunks`` (rows of ``length`` each; None: no grammar among
        them): a constrained chunk's row j holds its grammar's mask after its first j drafts, up to
        the first draft the grammar refuses (``GrammarState.draft_masks``); other rows allow all."""
        if not any(ch.seq.grammar is not None for ch in chunks):
            return None
        t0 = time.perf_counter()
        mask = torch.full((len(chunks) * length, self.words), -1, dtype=torch.int32)
        for c, ch in enumerate(chunks):
            st = ch.seq.grammar
            if st is None or ch.seq.error is not None:
                continue
            st.draft_masks(ch.drafts, mask, c * length)
            if not mask[c * length].ne(0).any():  # the grammar allows no token here
                ch.seq.error = DEAD_GRAMMAR.format(n=len(ch.seq.output_ids))
                mask[c * length].zero_()
                mask[c * length, 0] = 1  # token 0 alone keeps the step defined; the loop ends the request
        self.host_s += time.perf_counter() - t0
        return mask.pin_memory() if self.pinned else mask
