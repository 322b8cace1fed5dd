"""Turns ``SchedulerOutputs`` into one model step on the device.

Inputs are built on the host and copied in one go; decode rows take their input token from
``next_token[slot]``, the device buffer every step's sampler writes, so a step can be launched
before the host has seen the previous step's tokens. Sampled tokens (and logprobs) are copied
back on a side stream; ``StepHandle.wait`` is the only place the host waits for the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence as Seq

import torch

from ..api import Model
from ..graphs.batch import Batch, Chunk, context_gather, group_chunks
from ..graphs.model import forward_batch
from ..graphs.swap import swapped
from ..kernels.triton import register_nvidia_kernels
from ..passes.manager import build_pipeline
from ..sharding.lockstep import LockStep
from ..sharding.parallel import idle_step
from .cache import CachePool
from .graph_runner import StepGraphs
from .sampler import SamplingTensors, logprobs, sample
from .scheduler import SchedulerOutputs
from .steps import decode_step


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


def eager_kernel_swaps(accelerator: str | None, device: torch.device, disabled: Seq[str] = ()) -> dict[str, Callable]:
    """The kernel swaps of ``device``'s pipeline (minus ``disabled`` and
    ``DEEPINFER_DISABLE_PASSES``) for eager steps: each op runs its accelerator kernel (its
    reference on the CPU); the pattern-rewrite passes need a compiled graph and do not apply."""
    accelerator = accelerator or {"cuda": "nvidia", "npu": "ascend"}.get(device.type, "cpu")
    if accelerator == "nvidia" and not register_nvidia_kernels():
        return {}  # no Triton: the references run, as they would in any eager step
    return build_pipeline(accelerator, [n.strip() for n in disabled if n.strip()]).swaps()


class ModelRunner:
    def __init__(
        self, model: Model, pool: CachePool, compiled: dict | None = None, swaps: dict | None = None,
        split: Callable[[Batch], Batch] | None = None, lockstep: LockStep | None = None,
    ) -> None:
        """``compiled``: None runs the model functions eagerly; a dict (``StepGraphs`` options:
        graphs, inductor, dump_dir, disabled, accelerator, max_requests, max_tokens) runs the
        compiled steps. ``swaps``: ``graphs.swap`` replacements in force around every forward
        (a multi-rank mesh: the expert-parallel MoE, ``sharding.parallel.ep_swaps``). ``split``:
        context parallelism, a step's batch -> this rank's share (``sharding.cp.split_batch``).
        ``lockstep``: a multi-rank mesh with compiled steps, whose ranks agree on each turn's
        graphs (``_plan``)."""
        if compiled is not None and split is not None:
            raise ValueError("context parallelism steps eagerly for now (its split is built on the host per step)")
        self.model = model
        self.split = split
        self.lockstep = lockstep
        self._rows_all = False  # whether the last compiled prefill graph computed every row
        self.swaps = dict(swaps or {})
        self.pool = pool
        self.device = model.device
        # one entry per slot plus the scratch slot that padded decode rows read
        self.next_token = torch.zeros(pool.slots + 1, dtype=torch.long, device=self.device)
        self.steps = None if compiled is None else StepGraphs(model, pool.state, self.next_token, **compiled)
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
        for slot in sched.to_zero:
            self.pool.zero(slot)
        for src, dst in sched.to_clone:
            self.pool.clone(src, dst)
        for seq in sched.to_import:
            self.importer(seq)

        with swapped(self.swaps):
            logits, first_row = self._forward(sched) if self.steps is None else self._forward_compiled(sched)
        sample_rows, sample_slots, sample_params, seeds, sample_pos = [], [], [], [], []
        for i, ch in enumerate(sched.chunks):
            if ch.sample:
                seq = ch.seq
                sample_rows.append(first_row[i] + (ch.length - 1 if self._all_rows(sched, i) else 0))
                sample_slots.append(seq.slot)
                sample_params.append(seq.params)
                seeds.append(seq.seed)
                sample_pos.append(ch.start + ch.length)

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
            rows_lp = logits[first_row[i] : first_row[i] + n]
            prompt_lp[i] = (target, *logprobs(rows_lp, target, p.prompt_logprobs))
        return self._copy_back(sched, tokens, lp, tid, tlp, prompt_lp)

    @torch.no_grad()
    def idle(self) -> None:
        """What a rank with nothing to launch runs while other ranks step, so that its EP group's
        all-to-alls complete: eagerly one forward of a padding request (the scratch slot,
        nothing kept); compiled, the turn's agreed graphs on padding alone."""
        with swapped(self.swaps):
            if self.steps is not None:
                self._forward_compiled(None)
                return
            c, params = self.model
            decode_step(params, self.pool.state, c, self.next_token, *idle_step(self.pool.state, self.device))

    def _all_rows(self, sched: SchedulerOutputs, i: int) -> bool:
        """Whether chunk i's logits cover every row (else only its last row was computed)."""
        return self.steps is None or (not sched.chunks[i].from_device and self._rows_all)

    @staticmethod
    def _wants_prompt_lp(sched: SchedulerOutputs) -> bool:
        return any(ch.seq.params.prompt_logprobs is not None for ch in sched.chunks if not ch.from_device)

    def _forward(self, sched: SchedulerOutputs) -> tuple[torch.Tensor, list[int]]:
        """Eager: one packed forward; returns logits of every row and each chunk's first row."""
        c, params = self.model
        ids, pos, dev_rows, dev_slots, chunks = [], [], [], [], []
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
            offset += ch.length
        token_ids = self._host(ids)
        if dev_rows:
            token_ids[self._host(dev_rows)] = self.next_token[self._host(dev_slots)]
        batch = Batch(token_ids, self._host(pos), group_chunks(chunks, self.device), tuple(chunks))
        if self.split is not None:  # context parallelism: this rank's share of the chunks
            batch = self.split(batch)
        logits, _ = forward_batch(params, self.pool.state, c, batch)
        if batch.split is not None:  # every CP rank samples from every row, alike
            logits = context_gather(logits, batch.split)
        return logits, [ch.offset for ch in chunks]

    def _forward_compiled(self, sched: SchedulerOutputs | None) -> tuple[torch.Tensor, list[int]]:
        """Compiled: decode rows through the decode graph, prompt chunks through the prefill graph,
        at the sizes this turn's plan agreed (``sched`` None: an idle rank's padding alone)."""
        all_chunks = [] if sched is None else sched.chunks
        dec = [i for i, ch in enumerate(all_chunks) if ch.from_device]
        pre = [i for i, ch in enumerate(all_chunks) if not ch.from_device]
        chunks = [(ch.seq.slot, ch.start, ch.seq.prompt_ids[ch.start : ch.start + ch.length]) for ch in (all_chunks[i] for i in pre)]
        n_dec, n_pre, length, rows_all = self._plan(
            [len(dec), len(chunks), max([len(ids) for _, _, ids in chunks] + [0]), int(sched is not None and self._wants_prompt_lp(sched))]
        )
        self._rows_all = bool(rows_all)
        parts, first_row, base = [], [0] * len(all_chunks), 0
        if n_dec:
            out = self.steps.decode([all_chunks[i].seq.slot for i in dec], [all_chunks[i].start for i in dec], min_requests=n_dec)
            parts.append(out)
            for j, i in enumerate(dec):
                first_row[i] = j
            base = len(dec)
        if n_pre:
            out, first = self.steps.prefill(chunks, all_rows=self._rows_all, min_chunks=n_pre, min_length=length)
            parts.append(out)
            for j, i in enumerate(pre):
                first_row[i] = base + first[j]
        if not parts:
            return torch.empty(0, device=self.device), first_row
        return (parts[0] if len(parts) == 1 else torch.cat(parts)), first_row

    def _plan(self, mine: list[int]) -> list[int]:
        """This turn's graphs: decode requests, prefill chunks, prefill length, every row or
        not. On a multi-rank mesh the max over ranks, so every rank runs the same graphs at the
        same sizes and the EP all-to-alls inside them pair up."""
        return mine if self.lockstep is None else self.lockstep.agree(mine)

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
