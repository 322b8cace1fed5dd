"""Continuous batching with chunked prefill under a token budget.

Each step mixes decode tokens of running requests (one each) with prefill chunks, running
requests first, then newly admitted ones, until ``max_num_batched_tokens`` is spent.
Admission reserves a request's whole footprint (prompt + max_tokens) in the cache pool, so a
running request never runs out of room and nothing is preempted; when the pool is full new
requests wait. The host may schedule a request's next decode before the previous step's token
is back: that token stays on the device and the runner feeds it in (see ``runner.py``).
With speculative decoding (a ``Speculator``), a request past its prompt instead waits for its
previous step's results, asks the drafter for drafts and gets a verify chunk of its last token
and the drafts (``spec_decode.py``); with no drafts it gets a plain decode row. With confidence
scheduling (``spec_schedule.py``) the speculator first plans how many drafts each ready request verifies.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from .cache import CachePool
from .request import Sequence, Status
from .spec_decode import Speculator


class EngineType(enum.Enum):
    NORMAL = "normal"  # prefill and decode
    PROMPT = "prompt"  # prefill only: sample the first token, export each request's state
    COMPLETION = "completion"  # import exported states and decode


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int  # first position of the chunk
    length: int
    sample: bool  # the chunk's last row produces a token
    from_device: bool  # a decode row whose input token is the device's last sample
    drafts: tuple[int, ...] = ()  # a verify chunk: the request's last token, then these drafts


@dataclass(frozen=True)
class SchedulerOutputs:
    chunks: tuple[ScheduledChunk, ...]
    is_prompt: bool  # any prefill chunk in this step
    num_batched_tokens: int
    seqlens_q: tuple[int, ...]
    to_clone: tuple[tuple[int, int], ...]  # (src slot, dst slot) copies before the step
    to_zero: tuple[int, ...]  # slots to clear before the step (newly admitted requests)
    to_import: tuple[Sequence, ...]  # COMPLETION: requests whose exported state loads into their slot


class Scheduler:
    def __init__(
        self,
        pool: CachePool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        engine_type: EngineType,
        speculator: Speculator | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
        self.pool = pool
        self.max_num_seqs = min(max_num_seqs, pool.slots)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.engine_type = engine_type
        self.speculator = speculator
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting) or any(not s.finished for s in self.running)

    def abort(self, seq_id: int) -> Sequence | None:
        for seq in list(self.waiting):
            if seq.id == seq_id:
                self.waiting.remove(seq)
                return seq
        for seq in self.running:
            if seq.id == seq_id and not seq.finished:
                return seq
        return None

    def waits_for_results(self) -> bool:
        """Whether a speculating request's next step needs a step's results that are not read yet."""
        spec = self.speculator
        return spec is not None and any(s.inflight and s.prefill_done and not s.finished for s in self.running)

    def release(self, seq: Sequence) -> None:
        """Give a finished request's slot back once no launched step still uses it."""
        if seq.slot is not None and seq.inflight == 0:
            self.pool.free(seq.slot)
            seq.slot = None
            self.running.remove(seq)

    def _max_samples(self, seq: Sequence) -> int:
        return 1 if self.engine_type is EngineType.PROMPT else seq.params.max_tokens

    def _chunk_for(self, seq: Sequence, budget: int) -> ScheduledChunk | None:
        if not seq.prefill_done:
            n = min(seq.prompt_len - seq.num_scheduled, budget)
            if n <= 0:
                return None
            return ScheduledChunk(seq, seq.num_scheduled, n, seq.num_scheduled + n == seq.prompt_len, False)
        if seq.num_sampled_scheduled >= self._max_samples(seq) or budget < 1:
            return None
        if self.speculator is not None:
            if seq.inflight:  # the drafter reads the tokens so far
                return None
            drafts = self.speculator.drafts(seq, min(self._max_samples(seq) - len(seq.output_ids) - 1, budget - 1))
            if drafts:
                return ScheduledChunk(seq, seq.num_scheduled, 1 + len(drafts), True, False, drafts)
        return ScheduledChunk(seq, seq.num_scheduled, 1, True, True)

    def _commit(self, chunk: ScheduledChunk, now: float) -> None:
        seq = chunk.seq
        seq.num_scheduled += chunk.length
        seq.num_sampled_scheduled += int(chunk.sample)
        seq.inflight += 1
        if seq.first_scheduled is None:
            seq.first_scheduled = now

    def schedule(self, now: float) -> SchedulerOutputs | None:
        budget = self.max_num_batched_tokens
        if self.speculator is not None and self.speculator.config.varlen:  # confidence scheduling weighs them together
            ready = [
                s
                for s in self.running
                if not s.finished
                and s.prefill_done
                and not s.inflight
                and s.model_drafts
                and s.num_sampled_scheduled < self._max_samples(s)
            ]
            self.speculator.plan(ready, [self._max_samples(s) - len(s.output_ids) - 1 for s in ready])
        chunks: list[ScheduledChunk] = []
        to_zero: list[int] = []
        to_import: list[Sequence] = []
        for seq in self.running:
            if seq.finished:
                continue
            chunk = self._chunk_for(seq, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.length
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            slot = self.pool.allocate()
            if slot is None:
                break
            if not self.pool.reserve(slot, seq.prompt_len + self._max_samples(seq)):
                self.pool.free(slot)
                break
            self.waiting.popleft()
            seq.slot, seq.status = slot, Status.RUNNING
            self.running.append(seq)
            if seq.imported:
                to_import.append(seq)
                seq.num_scheduled = seq.prompt_len
            else:
                to_zero.append(slot)
            chunk = self._chunk_for(seq, budget)
            if chunk is not None:
                chunks.append(chunk)
                budget -= chunk.length
        if not chunks:
            return None
        for chunk in chunks:
            self._commit(chunk, now)
        return SchedulerOutputs(
            chunks=tuple(chunks),
            is_prompt=any(not c.from_device for c in chunks),
            num_batched_tokens=sum(c.length for c in chunks),
            seqlens_q=tuple(c.length for c in chunks),
            to_clone=(),
            to_zero=tuple(to_zero),
            to_import=tuple(to_import),
        )
