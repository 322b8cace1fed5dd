"""Turns ``SchedulerOutputs`` into one model step on the device.

Inputs are built on the host and copied in one go; decode rows take their input token from
``next_token[slot]``, the device buffer every step's sampler writes, so a step can be launched
before the host has seen the previous step's tokens. Sampled tokens (and logprobs) are copied
back on a side stream; ``StepHandle.wait`` is the only place the host waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ..api import Model
from ..graphs.batch import Batch, Chunk, group_chunks
from ..graphs.model import forward_batch
from .cache import CachePool
from .sampler import SamplingTensors, logprobs, sample
from .scheduler import SchedulerOutputs


@dataclass
class StepHandle:
    """A launched step. Host copies of its results become valid after ``wait``."""

    sched: SchedulerOutputs
    tokens: torch.Tensor  # [R] sampled token per sampling chunk
    logprob: torch.Tensor | None  # [R]
    top_ids: torch.Tensor | None  # [R, k]
    top_logprobs: torch.Tensor | None  # [R, k]
    prompt_lp: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]  # chunk idx -> (target, lp, top ids, top lps)
    done: torch.cuda.Event | None

    def wait(self) -> None:
        if self.done is not None:
            self.done.synchronize()


class ModelRunner:
    def __init__(self, model: Model, pool: CachePool) -> None:
        self.model = model
        self.pool = pool
        self.device = model.device
        self.next_token = torch.zeros(pool.slots, dtype=torch.long, device=self.device)
        cuda = self.device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(self.device) if cuda else None
        self.pin = cuda
        self.importer: Callable | None = None  # COMPLETION engine: loads an exported state into a slot

    def set_next_token(self, slot: int, token: int) -> None:
        self.next_token[slot] = token

    def _host(self, values: list[int]) -> torch.Tensor:
        t = torch.tensor(values, dtype=torch.long)
        return (t.pin_memory() if self.pin else t).to(self.device, non_blocking=True)

    @torch.no_grad()
    def launch(self, sched: SchedulerOutputs) -> StepHandle:
        c, params = self.model
        for slot in sched.to_zero:
            self.pool.zero(slot)
        for src, dst in sched.to_clone:
            self.pool.clone(src, dst)
        for seq in sched.to_import:
            self.importer(seq)

        ids, pos, dev_rows, dev_slots, chunks = [], [], [], [], []
        sample_rows, sample_slots, sample_params, seeds, sample_pos = [], [], [], [], []
        offset = 0
        for ch in sched.chunks:
            seq = ch.seq
            if ch.from_device:
                ids.append(0)
                dev_rows.append(offset)
                dev_slots.append(seq.slot)
            else:
                ids.extend(seq.prompt_ids[ch.start : ch.start + ch.length])
            pos.extend(range(ch.start, ch.start + ch.length))
            chunks.append(Chunk(seq.slot, ch.start, offset, ch.length))
            if ch.sample:
                sample_rows.append(offset + ch.length - 1)
                sample_slots.append(seq.slot)
                sample_params.append(seq.params)
                seeds.append(seq.seed)
                sample_pos.append(ch.start + ch.length)
            offset += ch.length

        token_ids = self._host(ids)
        if dev_rows:
            token_ids[self._host(dev_rows)] = self.next_token[self._host(dev_slots)]
        batch = Batch(token_ids, self._host(pos), group_chunks(chunks, self.device), tuple(chunks))
        logits, _ = forward_batch(params, self.pool.state, c, batch)

        rows = self._host(sample_rows)
        last = logits[rows]
        st = SamplingTensors.from_params(sample_params, seeds, sample_pos, self.device)
        tokens = sample(last, st)
        self.next_token[self._host(sample_slots)] = tokens

        k = max((p.logprobs or 0) for p in sample_params) if any(p.logprobs is not None for p in sample_params) else None
        lp = tid = tlp = None
        if k is not None:
            lp, tid, tlp = logprobs(last, tokens, k)
        prompt_lp = {}
        for i, ch in enumerate(sched.chunks):
            p = ch.seq.params
            if p.prompt_logprobs is None or ch.from_device:
                continue
            # rows predicting the next prompt token inside the prompt
            n = min(ch.length, ch.seq.prompt_len - 1 - ch.start)
            if n <= 0:
                continue
            target = self._host(ch.seq.prompt_ids[ch.start + 1 : ch.start + 1 + n])
            rows_lp = logits[chunks[i].offset : chunks[i].offset + n]
            prompt_lp[i] = (target, *logprobs(rows_lp, target, p.prompt_logprobs))
        return self._copy_back(sched, tokens, lp, tid, tlp, prompt_lp)

    def _copy_back(self, sched, tokens, lp, tid, tlp, prompt_lp) -> StepHandle:
        if self.copy_stream is None:
            return StepHandle(sched, tokens, lp, tid, tlp, prompt_lp, None)
        main = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(main)
        with torch.cuda.stream(self.copy_stream):
            def cpu(t):
                if t is None:
                    return None
                t.record_stream(self.copy_stream)
                return t.to("cpu", non_blocking=True)

            out = StepHandle(
                sched, cpu(tokens), cpu(lp), cpu(tid), cpu(tlp),
                {i: tuple(cpu(x) for x in v) for i, v in prompt_lp.items()}, torch.cuda.Event(),
            )
            out.done.record(self.copy_stream)
        return out
