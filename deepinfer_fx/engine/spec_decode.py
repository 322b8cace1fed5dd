"""Speculative decoding's engine side: who speculates, drafts per step, and rollback.

A speculating request (every request: one asking for logprobs gets every verify row's and keeps
the emitted tokens'; one with a grammar gets a token mask per verify row, ``GrammarMasks.verify_rows``)
runs verify steps instead of decode steps once its prompt is done:
its last token and up to k drafts at positions ``start .. start + m`` go through one target
forward (``StepGraphs.verify``); the device accepts a prefix of the drafts and writes the bonus
token to ``next_token[slot]``. A step with no drafts (nothing to look up) is a plain decode row.

Rollback (spec §8.4). The forward wrote state for every row, rejected ones included: window
ring rows (a draft at p + j overwrites position p + j - W, which later queries still need),
compressor row rings (open groups, overlap halves), Engram history. Entries and index keys
are not at risk: they are stored by position and a query reads only entries whose window
closed at or before it, which a later real step writes again before anyone reads them. So
before a verify step the runner snapshots the verify slots' fixed-size state (everything but
``cache.GROWING_KEYS``); for the requests whose drafts were rejected it restores the snapshot
and runs their accepted prefixes again as prompt chunks that sample nothing, all in one step.
Its cost (``docs/decisions.md``): one copy of each verify slot's fixed state per verify step,
and a prefill step of ``1 + accepted`` rows per rejecting request after a rejection. That re-run
waits for the next launch and runs first in it (``Reruns``): on a mesh it is a step every rank
takes together (its MoE is an all-to-all), agreed with the launch's other parts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .cache import GROWING_KEYS, CachePool, iter_tensors
from .drafters import NgramDrafter
from .request import Sequence
from .spec_config import SpeculativeConfig
from .spec_schedule import plan_lengths
from .step_arena import PrefillChunk, VerifyChunk

if TYPE_CHECKING:
    from .graph_runner import StepGraphs


@dataclass
class SpecStats:
    """Engine-wide counters: verify steps, drafts proposed, and accepted drafts per position."""

    verify_steps: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_at: list[int] = field(default_factory=list)  # [j]: verify steps whose draft j+1 was accepted
    proposed_at: list[int] = field(default_factory=list)  # [j]: verify steps that proposed a draft j+1

    def record(self, proposed: int, accepted: int) -> None:
        self.verify_steps += 1
        self.draft_tokens += proposed
        self.accepted_tokens += accepted
        for counts, n in ((self.proposed_at, proposed), (self.accepted_at, accepted)):
            counts.extend([0] * (proposed - len(counts)))
            for j in range(n):
                counts[j] += 1

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the bonus)."""
        return 1 + self.accepted_tokens / self.verify_steps if self.verify_steps else 0.0

    def summary(self) -> str:
        if not self.verify_steps:
            return "speculation: no verify steps (no drafts found)"
        rate = [f"{a / p:.2f}" for a, p in zip(self.accepted_at, self.proposed_at)]
        return (
            f"speculation: {self.verify_steps} verify steps, {self.accepted_tokens}/{self.draft_tokens} drafts accepted "
            f"({self.accepted_tokens / max(self.draft_tokens, 1):.1%}), mean accepted length "
            f"{self.mean_accepted_length:.2f}, acceptance per draft position [{', '.join(rate)}]"
        )


class Speculator:
    def __init__(self, config: SpeculativeConfig, step_time: Callable[[list[int]], float | None] | None = None) -> None:
        """``step_time``: with ``config.varlen``, the step-time estimate the confidence scheduler
        weighs lengths with (``ModelRunner.step_time``)."""
        self.config = config
        self.drafter = None
        if config.method == "ngram":
            self.drafter = NgramDrafter(
                config.num_speculative_tokens, config.prompt_lookup_min, config.prompt_lookup_max
            )
        self.stats = SpecStats()
        self.step_time = step_time
        self.lengths: dict[int, int] = {}  # varlen: this step's planned draft count per request id

    def plan(self, seqs: Seq[Sequence], limits: Seq[int]) -> None:
        """Confidence scheduling (``spec_schedule.plan_lengths``) of the requests about to verify,
        each at most ``limits[i]`` drafts; a no-op without ``varlen``."""
        self.lengths = {}
        if not self.config.varlen or not seqs:
            return
        conf = [list(s.model_conf[: max(n, 0)]) for s, n in zip(seqs, limits)]
        self.lengths = {s.id: n for s, n in zip(seqs, plan_lengths(conf, self.step_time))}

    def drafts(self, seq: Sequence, limit: int) -> tuple[int, ...]:
        """Drafts for ``seq``'s next step (its tokens so far all read back), at most ``limit``:
        prompt lookup's, or those the model's drafter (MTP-1, DSpark) proposed in ``seq``'s last step."""
        if self.drafter is None:
            return seq.model_drafts[: max(min(limit, self.lengths.get(seq.id, limit)), 0)]
        return tuple(self.drafter.propose(seq.prompt_ids + seq.output_ids, limit))


def snapshot(pool: CachePool, slots: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Copies of ``slots``' fixed-size state, which a verify step's rejected rows may overwrite:
    one gather per state tensor for all the step's verify slots (not one copy per slot). The
    drafters' state (``mtp.*``, ``dspark.*``) is not among them: it holds verified positions only."""
    index = torch.tensor(slots, device=pool.state["layers"][0]["window"].device)
    return index, {
        p: t[index]
        for p, t in iter_tensors(pool.state)
        if not p.endswith(GROWING_KEYS) and not p.startswith(("mtp.", "dspark."))
    }


def restore(pool: CachePool, saved: tuple[torch.Tensor, dict[str, torch.Tensor]], rows: list[int]) -> None:
    """Put back the saved state of the snapshot's ``rows`` (positions in its slot list)."""
    index, tensors = saved
    pick = torch.tensor(rows, device=index.device)
    for p, t in iter_tensors(pool.state):
        if p in tensors:
            t[index[pick]] = tensors[p][pick]


class Reruns:
    """Rollback re-runs waiting for the next launch (``ModelRunner._launch_steps`` runs them before
    its other parts, which may hold the same requests): each one's token and accepted drafts as a
    prompt chunk that samples nothing. Deferred, not run at once, because the loop reads a step at
    different points of a turn on different ranks, while a mesh's steps must line up."""

    def __init__(self) -> None:
        self.queued: list[tuple[Sequence, PrefillChunk]] = []

    def add(self, seq: Sequence, chunk: VerifyChunk, accepted: int) -> None:
        self.queued.append((seq, PrefillChunk(chunk.slot, chunk.start, chunk.ids[: accepted + 1])))

    def due(self) -> list[PrefillChunk]:
        """The queued re-runs (emptying the queue) of requests still in their slots: an aborted
        request's slot may be another's by now."""
        due = [ch for seq, ch in self.queued if not seq.finished and seq.slot == ch.slot]
        self.queued = []
        return due

    @staticmethod
    def run(steps: StepGraphs, chunks: list[PrefillChunk], n: int = 0, length: int = 0) -> None:
        """Launch re-runs ``chunks`` as one greedy prefill step without the drafter (it saw those
        rows), padded to ``n`` chunks of ``length`` (a mesh's agreement: none of its own, padding alone)."""
        if chunks or n:
            steps.step((), chunks, "greedy", min_chunks=n, min_length=length, draft=False)
