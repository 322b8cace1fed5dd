"""Speculative decoding's engine side: who speculates, drafts per step, and rollback.

A speculating request (every request: one asking for logprobs gets every verify row's and keeps
the emitted tokens'; one with a grammar gets a token mask per verify row, ``GrammarMasks.verify_rows``)
runs verify steps instead of decode steps once its prompt is done:
its last token and up to k drafts at positions ``start .. start + m`` go through one target
forward (``StepGraphs.verify``); the device accepts a prefix of the drafts and writes the bonus
token to ``next_token[slot]``. A step with no drafts (nothing to look up) is a plain decode row.

Rollback (spec §8.4). The forward wrote state for every row, rejected ones included. What it
wrote is keyed by position: window rings, compressor row rings and the Engram history hold
``num_speculative_tokens`` spare rows (``graphs/state.py``), so a draft at ``p + j`` overwrites
position ``p + j - ring``, older than anything a committed query reads; entries and index keys
are read only once their window closed at or before the query, and a later real step writes
them again first; the drafters' windows hold verified positions only. So rolling a rejection
back is the host moving the request's position to what was accepted; the next step writes over
the rejected rows. (Until session 35 the verify slots' state was snapshotted before every verify
step and a rejection re-ran the accepted rows as a prefill step: ``docs/decisions.md``.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field

from .drafters import NgramDrafter
from .request import Sequence
from .spec_config import SpeculativeConfig
from .spec_schedule import plan_lengths


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
