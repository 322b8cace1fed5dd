"""A launched step's results: its chunks' prompt logprobs (``prompt_logprobs``), the host copies
queued behind the step on its stream (``copy_back``), and its handle, what the loop reads once
``StepHandle.wait`` has waited for the device: each chunk's token, logprobs, verified drafts and
the drafts proposed for its next step."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .sampler import logprobs
from .scheduler import SchedulerOutputs
from .step_arena import VerifyChunk


@dataclass
class StepHandle:
    """A launched step. ``token(i)`` and friends are valid after ``wait``."""

    sched: SchedulerOutputs
    where: list[tuple[int, int] | None]  # per chunk: (part, row) of its sampled token, None if it samples nothing
    parts: list[
        tuple[torch.Tensor, ...]
    ]  # per part (decode, prefill): host copies of tokens [, logprob, top ids, top lps]
    prompt_lp: dict[
        int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    ]  # chunk -> (target, lp, top ids, top lps)
    done: torch.cuda.Event | None
    verify: dict[int, tuple[VerifyChunk, int]] = field(
        default_factory=dict
    )  # chunk -> (its rows, its row in the verify part)
    part_drafts: list[tuple | None] = field(default_factory=list)  # per part: host copies of its drafts and confidences
    fed: set[int] = field(default_factory=set)  # chunks whose token the loop gave its grammar already
    gap: tuple | None = None  # CUDA timing events: model parts done -> masks copied (StepGraphs.step)
    release: Callable[[], None] | None = None  # gives the step's host mask buffers back, once done
    _tokens: list[list[int]] | None = None
    _accepted: list[int] | None = None
    _drafts: list[tuple | None] | None = None  # per part: each row's drafts and confidences (None: no model drafter)

    def wait(self) -> None:
        if self._tokens is not None:
            return
        if self.done is not None:
            self.done.synchronize()
        if self.release is not None:
            self.release()
            self.release = None
        self._tokens = [p[0].tolist() for p in self.parts]
        if self.verify:
            self._accepted = self.parts[VERIFY][1].tolist()
        self._drafts = [
            None if d is None else (d[0].tolist(), None if d[1] is None else d[1].tolist()) for d in self.part_drafts
        ]

    def mask_wait(self) -> float:
        """Device seconds from the end of this step's model parts to its masks' arrival (the mask
        work the forward did not hide, plus the copy); 0 without masks or off CUDA. After ``wait``."""
        return 0.0 if self.gap is None else self.gap[0].elapsed_time(self.gap[1]) / 1e3

    def drafts(self, i: int) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """The drafts the model's drafter proposed after chunk i for its request's next step, and
        their confidences (DSpark; empty for MTP-1; both empty without a model drafter)."""
        part, row = self.where[i]
        got = self._drafts[part] if part < len(self._drafts) else None
        if got is None:
            return (), ()
        return tuple(got[0][row]), (() if got[1] is None else tuple(got[1][row]))

    def verified(self, i: int) -> tuple[list[int], int]:
        """Verify chunk i's emitted tokens (accepted drafts, then the bonus) and its accepted count."""
        part, row = self.where[i]
        n = self._accepted[row]
        return self._tokens[part][row][: n + 1], n

    def token(self, i: int) -> int:
        """Chunk i's sampled token; -1 where its logits were not finite."""
        part, row = self.where[i]
        return self._tokens[part][row]

    def logprobs(self, i: int, k: int, at: int = 0) -> dict[int, float]:
        """Chunk i's sampled token's logprob and the top ``k`` (a verify chunk's: its row ``at``'s)."""
        part, row = self.where[i]
        if part == VERIFY:
            tokens, _, lp, ids, top = self.parts[VERIFY]
            r = row * tokens.shape[1] + at
            entry = {int(t): float(v) for t, v in zip(ids[r, :k].tolist(), top[r, :k].tolist())}
            entry[int(tokens[row, at])] = float(lp[r])
            return entry
        _, lp, ids, top = self.parts[part]
        entry = {int(t): float(v) for t, v in zip(ids[row, :k].tolist(), top[row, :k].tolist())}
        entry[self.token(i)] = float(lp[row])
        return entry


VERIFY = 2  # the verify part's index in a step's parts (decode, prefill, verify)


def prompt_logprobs(
    sched: SchedulerOutputs, logits: torch.Tensor | None, first_row: Sequence[int], device: torch.device
) -> dict:
    """Prompt logprobs of the chunks that ask for them: chunk i's rows start at
    ``first_row[i]`` of ``logits``; each row predicts the next prompt token (targets on ``device``)."""
    prompt_lp = {}
    for i, ch in enumerate(sched.chunks):
        p = ch.seq.params
        if p.prompt_logprobs is None or ch.from_device:
            continue
        n = min(ch.length, ch.seq.prompt_len - 1 - ch.start)
        if n <= 0:
            continue
        target = torch.tensor(ch.seq.prompt_ids[ch.start + 1 : ch.start + 1 + n], device=device)
        rows_lp = logits[first_row[i] : first_row[i] + n]
        prompt_lp[i] = (target, *logprobs(rows_lp, target, p.prompt_logprobs))
    return prompt_lp


def copy_back(
    sched: SchedulerOutputs,
    where: list,
    outs: list,
    prompt_lp: dict,
    verify: dict | None = None,
    *,
    async_copy: bool,
    device: torch.device,
) -> StepHandle:
    """Host copies of every part's results, queued behind the step (``async_copy``: on the
    current CUDA stream of ``device``, non-blocking; the handle's ``done`` event follows them)."""

    def host(t: torch.Tensor | None) -> torch.Tensor | None:
        # a copy even on the CPU: a captured step's outputs are its graph's, rewritten by its next replay
        return None if t is None else t.to("cpu", non_blocking=async_copy, copy=True)

    parts = [
        tuple(host(t) for t in out[:4]) if out is not None else (torch.empty(0, dtype=torch.long),)
        for out in outs[:VERIFY]
    ]
    if len(outs) > VERIFY:
        v = outs[VERIFY]
        parts.append(
            tuple(host(t) for t in (v.tokens, v.accepted, v.logprob, v.top_ids, v.top_logprobs) if t is not None)
        )
    drafts = [None if out is None or out.drafts is None else (host(out.drafts), host(out.confidence)) for out in outs]
    lp = {i: tuple(host(x) for x in v) for i, v in prompt_lp.items()}
    done = None
    if async_copy:
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(device))
    return StepHandle(sched, where, parts, lp, done, verify or {}, part_drafts=drafts)
