"""The host loop. With overlap on, the host schedules and launches step N+1 before it reads
step N's results, so the device never waits for the host between steps; results (tokens,
logprobs) are processed one step late: stop strings, EOS, max_tokens, exports. With overlap off
the same steps run one at a time."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..sharding.lockstep import LockStep
from .request import Sequence, Status
from .runner import ModelRunner, StepHandle
from .scheduler import EngineType, Scheduler


@dataclass
class LoopStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    wall: float = 0.0
    prefill_time: float = 0.0  # wall time of steps that carried prefill work
    decode_time: float = 0.0

    def since(self, before: "LoopStats") -> "LoopStats":
        return LoopStats(*(getattr(self, f) - getattr(before, f) for f in self.__dataclass_fields__))


@dataclass
class EngineLoop:
    scheduler: Scheduler
    runner: ModelRunner
    detokenize: Callable[[list[int]], str] | None
    eos_ids: tuple[int, ...]
    overlap: bool
    export: Callable[[Sequence], None] | None = None  # PROMPT engine: write a finished request's state
    on_finish: Callable[[Sequence], None] | None = None
    lockstep: LockStep | None = None  # a multi-rank mesh: every rank's loop turns together
    events: list[tuple[str, int]] = field(default_factory=list)  # ("schedule"|"launch"|"read", step)
    stats: LoopStats = field(default_factory=LoopStats)
    _prev: tuple[int, StepHandle, float] | None = None
    _step: int = 0

    def busy(self) -> bool:
        """Work left here (on a multi-rank mesh: on any rank, so that the loops stop together)."""
        mine = self.scheduler.has_work() or self._prev is not None
        return mine if self.lockstep is None else self.lockstep.any(mine)

    def step(self) -> None:
        """One turn: schedule and launch the next step, then read the previous one's results."""
        t0 = now = time.perf_counter()
        sched = self.scheduler.schedule(now)
        if self.lockstep is not None and self.lockstep.any(sched is not None) and sched is None:
            self.runner.idle()  # another rank steps: its all-to-alls need this rank too
        cur = None
        if sched is not None:
            self.events.append(("schedule", self._step))
            cur = (self._step, self.runner.launch(sched), now)
            self.events.append(("launch", self._step))
            self._step += 1
            if not self.overlap:
                self._process(*cur)
                cur = None
        if self._prev is not None:
            self._process(*self._prev)
        elif sched is None and self.scheduler.has_work():
            raise RuntimeError("scheduler made no progress: a waiting request can never be admitted")
        self._prev = cur
        self.stats.wall += time.perf_counter() - t0

    def run(self) -> LoopStats:
        while self.busy():
            self.step()
        return self.stats

    def _process(self, step: int, handle: StepHandle, launched: float) -> None:
        handle.wait()
        self.events.append(("read", step))
        now = time.perf_counter()
        s = handle.sched
        prefill = sum(c.length for c in s.chunks if not c.from_device)
        self.stats.prefill_tokens += prefill
        self.stats.decode_tokens += s.num_batched_tokens - prefill
        self.stats.steps += 1
        if prefill:
            self.stats.prefill_time += now - launched
        else:
            self.stats.decode_time += now - launched
        r = 0
        for i, ch in enumerate(s.chunks):
            seq = ch.seq
            seq.inflight -= 1
            if i in handle.prompt_lp and not seq.finished:
                self._prompt_logprobs(seq, ch.start, handle.prompt_lp[i])
            if ch.sample:
                if not seq.finished:
                    self._append(seq, handle, r, now)
                r += 1
            if seq.finished:
                self.scheduler.release(seq)

    def _prompt_logprobs(self, seq: Sequence, start: int, lp) -> None:
        target, tok_lp, top_ids, top_lp = lp
        if start == 0:
            seq.prompt_logprobs.append(None)  # nothing predicts the first prompt token
        for j in range(target.shape[0]):
            entry = {int(t): float(v) for t, v in zip(top_ids[j].tolist(), top_lp[j].tolist())}
            entry[int(target[j])] = float(tok_lp[j])
            seq.prompt_logprobs.append(entry)

    def _append(self, seq: Sequence, handle: StepHandle, r: int, now: float) -> None:
        tok = int(handle.tokens[r])
        p = seq.params
        seq.output_ids.append(tok)
        if seq.first_token is None:
            seq.first_token = now
        if p.logprobs is not None:
            entry = {int(t): float(v) for t, v in zip(handle.top_ids[r, : p.logprobs].tolist(), handle.top_logprobs[r, : p.logprobs].tolist())}
            entry[tok] = float(handle.logprob[r])
            seq.logprobs.append(entry)
        reason = stop = None
        if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
            reason, stop = "stop", (tok if tok in p.stop_token_ids else None)
        text_ids = seq.output_ids[:-1] if reason else seq.output_ids
        if self.detokenize is not None:
            seq.text = self.detokenize(text_ids)
            hits = [(seq.text.find(s), s) for s in p.stop if s in seq.text]
            if hits and reason is None:
                at, s = min(hits)
                seq.text, reason, stop = seq.text[:at], "stop", s
        if reason is None and len(seq.output_ids) >= (1 if self.scheduler.engine_type is EngineType.PROMPT else p.max_tokens):
            reason = "length"
        if reason is not None:
            self.finish(seq, reason, stop, now)

    def finish(self, seq: Sequence, reason: str, stop: int | str | None, now: float | None = None) -> None:
        if seq.finished:
            return
        if self.export is not None and reason != "abort":
            self.export(seq)
        seq.status, seq.finish_reason, seq.stop_reason = Status.FINISHED, reason, stop
        seq.finished_at = now if now is not None else time.perf_counter()
        if self.on_finish is not None:
            self.on_finish(seq)
        self.scheduler.release(seq)


def export_dir_for(root: Path, seq: Sequence) -> Path:
    return root / f"request-{seq.id:06d}"
