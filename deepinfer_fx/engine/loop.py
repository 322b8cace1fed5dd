"""The host loop. With overlap on, the host schedules and launches step N+1 before it reads
step N's results, so the device never waits for the host between steps; results (tokens,
logprobs) are processed one step late: stop strings, EOS, max_tokens, exports. With overlap off
the same steps run one at a time. ``LoopStats`` splits the host's time into launching,
waiting and reading, so that the host's own cost per step can be read off.

Speculative decoding: a speculating request's next step needs its previous step's tokens (the
drafter reads them), so while one waits the loop reads the step in flight before scheduling
the next.

Structured output: a constrained request's next token mask needs its last token, so when the
previous step sampled for a constrained request, the launch of the next step (scheduled, laid
out, its model part already running on the device) waits for the previous one and feeds its
tokens to the matchers (``_feed``) before it fills the masks, and only then launches the
sampler; the rest of the previous step (text, stops, EOS) is read while the device runs, as in
any turn."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from ..sharding.lockstep import LockStep
from .detok import Decode, find_stop, next_text, rest_text
from .request import Sequence, Status
from .runner import ModelRunner
from .scheduler import EngineType, Scheduler
from .state_io import StateTransfer
from .step_handle import StepHandle

NON_FINITE = "the model's logits for this request were not finite (NaN or inf): check the weights and inputs"


@dataclass
class LoopStats:
    prefill_tokens: int = 0
    decode_tokens: int = 0
    steps: int = 0
    wall: float = 0.0
    prefill_time: float = 0.0  # wall time of steps that carried prefill work
    decode_time: float = 0.0
    host_launch: float = 0.0  # host seconds scheduling, laying out and launching steps
    host_wait: float = 0.0  # host seconds waiting for a step's results (the device is ahead)
    host_read: float = 0.0  # host seconds turning results into outputs (tokens, text, stops)
    host_mask: float = 0.0  # of host_launch: filling structured output's token masks
    synced: int = 0  # launches that waited for the previous step's tokens (structured output)
    mask_wait: float = 0.0  # device seconds samplers waited for their masks after the forward (CUDA)

    @property
    def host_us_per_step(self) -> float:
        """Host work per step (launch + read, not the wait), in microseconds."""
        return 1e6 * (self.host_launch + self.host_read) / max(self.steps, 1)

    def since(self, before: "LoopStats") -> "LoopStats":
        return LoopStats(*(getattr(self, f) - getattr(before, f) for f in self.__dataclass_fields__))


@dataclass
class EngineLoop:
    scheduler: Scheduler
    runner: ModelRunner
    detokenize: Decode | None
    eos_ids: tuple[int, ...]
    overlap: bool
    transfer: StateTransfer | None = None  # PROMPT / COMPLETION engines: request states out and in
    lockstep: LockStep | None = None  # a multi-rank mesh: every rank's loop turns together
    events: list[tuple[str, int]] = field(default_factory=list)  # ("schedule"|"launch"|"read", step)
    stats: LoopStats = field(default_factory=LoopStats)
    _prev: tuple[int, StepHandle, float] | None = None
    _step: int = 0
    _fed_wait: float = 0.0  # this turn's wait inside the launch for the previous step (_feed)
    _progress: dict[int, Sequence] = field(default_factory=dict)  # this turn's requests that moved, by id

    def busy(self) -> bool:
        """Work left here (on a multi-rank mesh: on any rank, so that the loops stop together)."""
        mine = self.scheduler.has_work() or self._prev is not None
        return mine if self.lockstep is None else self.lockstep.any(mine)

    def step(self) -> list[Sequence]:
        """One turn: schedule and launch the next step, then read the previous one's results.
        Returns the requests that made progress (new tokens, or finished) in this turn."""
        t0 = now = time.perf_counter()
        self._progress = {}
        if self._prev is not None and self.scheduler.waits_for_results():
            self._process(*self._prev)
            self._prev = None
            t0 = now = time.perf_counter()
        feed = None
        if self._prev is not None and _needs_tokens(self._prev[1]):
            prev_handle = self._prev[1]

            def feed() -> None:
                self._feed(prev_handle)

        mask_before = self.runner.grammar_masks.host_s
        sched = self.scheduler.schedule(now)
        if self.lockstep is not None and self.lockstep.any(sched is not None) and sched is None:
            self.runner.idle()  # another rank steps: its all-to-alls need this rank too
        cur = None
        if sched is not None:
            self.events.append(("schedule", self._step))
            importer = None if self.transfer is None else self.transfer.load
            cur = (self._step, self.runner.launch(sched, importer, feed), now)
            self.events.append(("launch", self._step))
            self._step += 1
            self.stats.host_launch += time.perf_counter() - now - self._fed_wait  # the wait is host_wait's
            self._fed_wait = 0.0
            self.stats.host_mask += self.runner.grammar_masks.host_s - mask_before
            if not self.overlap:
                self._process(*cur)
                cur = None
        if self._prev is not None:
            self._process(*self._prev)
        elif sched is None and self.scheduler.has_work():
            raise RuntimeError("scheduler made no progress: a waiting request can never be admitted")
        self._prev = cur
        self.stats.wall += time.perf_counter() - t0
        return list(self._progress.values())

    def run(self) -> LoopStats:
        while self.busy():
            self.step()
        return self.stats

    def _feed(self, handle: StepHandle) -> None:
        """Wait for a launched step and hand each constrained request's token to its matcher, so
        that the next step's masks can be filled before the step is read in full."""
        t_wait = time.perf_counter()
        handle.wait()
        self._fed_wait = time.perf_counter() - t_wait
        self.stats.host_wait += self._fed_wait
        self.stats.synced += 1
        for i, ch in enumerate(handle.sched.chunks):
            seq = ch.seq
            if ch.sample and not ch.drafts and seq.grammar is not None and not seq.finished and seq.error is None:
                self._accept(seq, handle.token(i))
                handle.fed.add(i)

    @staticmethod
    def _accept(seq: Sequence, tok: int) -> None:
        if tok < 0:
            seq.error = NON_FINITE
        elif not seq.grammar.accept(tok):  # the mask allowed only tokens the grammar accepts: an engine defect
            seq.error = f"SamplingParams.so_args: the grammar rejected sampled token {tok} at output position {len(seq.output_ids)}"

    def _process(self, step: int, handle: StepHandle, launched: float) -> None:
        t_wait = time.perf_counter()
        handle.wait()
        self.events.append(("read", step))
        now = time.perf_counter()
        self.stats.host_wait += now - t_wait
        self.stats.mask_wait += handle.mask_wait()
        s = handle.sched
        prefill = sum(c.length for c in s.chunks if not c.from_device and not c.drafts)
        self.stats.prefill_tokens += prefill
        self.stats.decode_tokens += sum(1 for c in s.chunks if c.from_device)  # verify chunks add what they emit
        self.stats.steps += 1
        if prefill:
            self.stats.prefill_time += now - launched
        else:
            self.stats.decode_time += now - launched
        for i, ch in enumerate(s.chunks):
            seq = ch.seq
            seq.inflight -= 1
            if i in handle.prompt_lp and not seq.finished:
                self._prompt_logprobs(seq, ch.start, handle.prompt_lp[i])
            if ch.drafts and not seq.finished:
                self._verified(seq, ch, handle, i, now)
            elif ch.sample and not seq.finished:
                self._append(seq, handle.token(i), handle, i, now)
            if ch.sample and not seq.finished:
                seq.model_drafts, seq.model_conf = handle.drafts(i)  # the model drafter's proposals for the next step
            if seq.finished:
                self.scheduler.release(seq)
        self.stats.host_read += time.perf_counter() - now

    def _prompt_logprobs(self, seq: Sequence, start: int, lp) -> None:
        target, tok_lp, top_ids, top_lp = lp
        if start == 0:
            seq.prompt_logprobs.append(None)  # nothing predicts the first prompt token
        for j in range(target.shape[0]):
            entry = {int(t): float(v) for t, v in zip(top_ids[j].tolist(), top_lp[j].tolist())}
            entry[int(target[j])] = float(tok_lp[j])
            seq.prompt_logprobs.append(entry)

    def _verified(self, seq: Sequence, ch, handle: StepHandle, i: int, now: float) -> None:
        """A verify chunk's tokens, appended one by one (a stop ends it early); then the request's
        positions move to what was accepted: that is the whole rollback of its rejected drafts (the
        state's rings keep room for them, ``graphs/state.py``)."""
        tokens, n = handle.verified(i)
        self.scheduler.speculator.stats.record(len(ch.drafts), n)
        seq.num_draft_tokens += len(ch.drafts)
        seq.num_accepted_tokens += n
        for j, tok in enumerate(tokens):
            self.stats.decode_tokens += 1
            self._append(seq, tok, handle, i, now, at=j)
            if seq.finished:
                return
        seq.num_scheduled = ch.start + n + 1
        seq.num_sampled_scheduled += n

    def _append(self, seq: Sequence, tok: int, handle: StepHandle, i: int, now: float, at: int = 0) -> None:
        """Append chunk i's token ``tok`` (a verify chunk's row ``at``) to ``seq`` and finish it where it stops."""
        self._progress[seq.id] = seq
        if seq.error is None and seq.grammar is not None and i not in handle.fed:
            self._accept(seq, tok)
        elif tok < 0:
            seq.error = NON_FINITE
        if seq.error is not None:  # also set at launch: a grammar that allows no token (grammar_masks.DEAD_GRAMMAR)
            self.finish(seq, "error", None, now)
            return
        p = seq.params
        seq.output_ids.append(tok)
        if seq.first_token is None:
            seq.first_token = now
        if p.logprobs is not None:
            seq.logprobs.append(handle.logprobs(i, p.logprobs, at))
        reason = stop = None
        if (not p.ignore_eos and tok in self.eos_ids) or tok in p.stop_token_ids:
            reason, stop = "stop", (tok if tok in p.stop_token_ids else None)
        elif seq.grammar is not None and seq.grammar.terminated:  # the grammar took EOS (ignore_eos or not)
            reason = "stop"
        if self.detokenize is not None and reason is None:
            searched = len(seq.text)
            seq.text += next_text(self.detokenize, seq.output_ids, seq.text_state)
            hit = find_stop(seq.text, p.stop, searched)
            if hit is not None:
                at, s = hit
                seq.text, reason, stop = seq.text[:at], "stop", s
        if reason is None and len(seq.output_ids) >= (
            1 if self.scheduler.engine_type is EngineType.PROMPT else p.max_tokens
        ):
            reason = "length"
        if reason is not None:
            if not isinstance(stop, str):  # a stop string already cut the text; else show every token's text
                self._flush_text(seq, seq.output_ids if reason == "length" else seq.output_ids[:-1])
            self.finish(seq, reason, stop, now)

    def _flush_text(self, seq: Sequence, ids: list[int]) -> None:
        if self.detokenize is not None:
            seq.text += rest_text(self.detokenize, ids, seq.text_state)

    def finish(self, seq: Sequence, reason: str, stop: int | str | None, now: float | None = None) -> None:
        if seq.finished:
            return
        if reason == "abort":
            self._flush_text(seq, seq.output_ids)
        if (
            self.transfer is not None
            and self.scheduler.engine_type is EngineType.PROMPT
            and reason not in ("abort", "error")
        ):
            self.transfer.export(seq)
        seq.status, seq.finish_reason, seq.stop_reason = Status.FINISHED, reason, stop
        seq.finished_at = now if now is not None else time.perf_counter()
        self._progress[seq.id] = seq
        self.scheduler.release(seq)


def _needs_tokens(handle: StepHandle) -> bool:
    """Whether the next step's masks need this step's tokens: it sampled for a constrained request."""
    return any(ch.sample and ch.seq.grammar is not None and not ch.seq.finished for ch in handle.sched.chunks)
