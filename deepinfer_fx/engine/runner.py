"""Turns ``SchedulerOutputs`` into one step on the device.

The host lays the step out once (``StepGraphs.step``: decode rows, prompt chunks, each sampled
row's controls) and the device does the rest: the model, the sampler, and the write of every
sampled token to ``next_token[slot]``, the buffer decode rows read their input from, so step
N+1 can be launched before the host has seen step N's tokens. Results come back with one
device-to-host copy per part, queued behind the step on its stream (the next step, which may
replay the same graph over the same output buffers, is queued after the copies);
``StepHandle.wait`` is the only place the host waits for the device. Verify chunks
(speculative decoding) run as a third part after decode and prefill; the slot state each one
may overwrite is saved first, and ``rollback`` restores it after a rejected draft.

Structured output: a step with constrained rows carries one token bitmask per sampled row,
filled here from each request's matcher (``structured.MaskFiller``) once the step's model
parts are launched and the loop has fed every matcher its request's last token
(``before_masks``, ``loop.py``); only the samplers wait for the masks.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence as Seq

import torch

from ..api import Model
from ..graphs.batch import Batch, Chunk, context_gather, group_chunks
from ..graphs.model import forward_batch
from ..graphs.swap import swapped
from ..passes.batch_invariant import batch_invariant_swaps
from ..kernels.triton import register_nvidia_kernels
from ..passes.manager import build_pipeline
from ..settings import usable_cores
from ..sharding.lockstep import LockStep
from ..sharding.parallel import idle_step
from .cache import CachePool
from .graph_runner import StepGraphs
from .step_arena import DecodeRow, PrefillChunk, VerifyChunk
from .options import StepOptions
from .request import Sequence
from .sampler import MODES, logprobs
from .sampling import MAX_LOGPROBS
from .scheduler import SchedulerOutputs
from .spec_decode import restore, snapshot
from .step_inputs import Layout, SampledRow, fill
from .steps import StepOut, decode_logits, sample_rows
from .structured import GrammarState, MaskFiller, mask_words
from ..vision.requests import batch_embeddings, encode_requests

DEAD_GRAMMAR = (
    "SamplingParams.so_args: the grammar allows no token of this model's vocabulary at output position {n} "
    "(a pattern the tokenizer cannot spell?)"
)


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
    )  # chunk -> (its rows, its row of ``saved``)
    saved: tuple | None = None  # the verify slots' state before the step (``spec_decode.snapshot``)
    part_drafts: list[tuple | None] = field(default_factory=list)  # per part: host copies of its drafts and confidences
    fed: set[int] = field(default_factory=set)  # chunks whose token the loop gave its grammar already
    gap: tuple | None = None  # CUDA timing events: model parts done -> masks copied (StepGraphs.step)
    _tokens: list[list[int]] | None = None
    _accepted: list[int] | None = None
    _drafts: list[tuple | None] | None = None  # per part: each row's drafts and confidences (None: no model drafter)

    def wait(self) -> None:
        if self._tokens is not None:
            return
        if self.done is not None:
            self.done.synchronize()
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


def eager_kernel_swaps(accelerator: str | None, device: torch.device, disabled: Seq[str] = ()) -> dict[str, Callable]:
    """The kernel swaps of ``device``'s pipeline (minus ``disabled`` and
    ``DEEPINFER_DISABLE_PASSES``) for eager steps: each op runs its accelerator kernel (its
    reference on the CPU); the pattern-rewrite passes need a compiled graph and do not apply."""
    accelerator = accelerator or {"cuda": "nvidia", "npu": "ascend"}.get(device.type, "cpu")
    if accelerator == "nvidia" and not register_nvidia_kernels():
        return {}  # no Triton: the references run, as they would in any eager step
    return build_pipeline(accelerator, [n.strip() for n in disabled if n.strip()]).swaps()


def step_mode(seqs: Seq[Sequence]) -> str:
    """The cheapest sampler mode that serves every sampled row of a step."""
    return MODES[max((MODES.index(s.sampler_mode) for s in seqs), default=0)]


class ModelRunner:
    def __init__(
        self,
        model: Model,
        pool: CachePool,
        options: StepOptions,
        swaps: dict | None = None,
        split: Callable[[Batch], Batch] | None = None,
        lockstep: LockStep | None = None,
        max_drafts: int = 0,
        model_drafts: int = 0,
        varlen: bool = False,
    ) -> None:
        """``options``: how steps run (compiled or eager, graphs, passes, buckets). ``swaps``:
        ``graphs.swap`` replacements in force around every forward (a multi-rank mesh: the
        expert-parallel MoE, ``sharding.parallel.ep_swaps``). ``split``: context parallelism,
        a step's batch -> this rank's share (``sharding.cp.split_batch``), which steps eagerly
        on a host-built batch. ``lockstep``: a multi-rank mesh, whose ranks agree on each
        turn's step sizes (``_plan``) so that the all-to-alls inside them pair up. ``max_drafts``:
        the longest draft of speculative decoding (0: off), which sizes the verify buckets.
        ``model_drafts``: the drafts the model's drafter proposes after every step (speculative
        decoding's ``mtp`` and ``dspark`` methods); ``varlen``: confidence-scheduled verification
        (verify buckets of every length, step parts timed: ``step_time``)."""
        if options.compiled and split is not None:
            raise ValueError("context parallelism steps eagerly for now (its split is built on the host per step)")
        self.model = model
        self.split = split
        self.lockstep = lockstep
        # batch-invariant forms win over every replacement but the sharding's, eager or compiled
        invariant = batch_invariant_swaps(sharded=swaps or {}) if options.batch_invariant else {}
        self.swaps = {**(swaps or {}), **invariant}
        self.pool = pool
        self.device = model.device
        # one entry per slot plus the scratch slot that padded rows read and write
        self.next_token = torch.zeros(pool.slots + 1, dtype=torch.long, device=self.device)
        self.steps = StepGraphs(
            model,
            pool.state,
            self.next_token,
            max_requests=options.max_requests,
            max_tokens=options.max_tokens,
            accelerator=options.accelerator,
            graphs=options.cuda_graphs,
            inductor=options.inductor,
            dump_dir=options.dump_dir,
            disabled=options.disabled_passes,
            compile=options.compiled,
            max_drafts=max_drafts,
            keep=options.keep,
            over=invariant,
            n_drafts=model_drafts,
            varlen=varlen,
        )
        self.keep = options.keep
        self.logprobs_k = min(MAX_LOGPROBS, model.config.vocab_size)
        self.async_copy = self.device.type == "cuda"
        self.mask_words = mask_words(model.config.vocab_size)
        self.mask_s = 0.0  # host seconds filling structured output's token masks (LoopStats.host_mask)
        self._filler: MaskFiller | None = None  # made with the first constrained step (xgrammar loads then)

    @torch.no_grad()
    def warm_up(self, keys: Seq[tuple], progress: Callable[[str], None] | None = None) -> float:
        """Compile and capture the steps of ``keys`` with this runner's swaps in force (the EP
        dispatch on a mesh: a step traced without it would be the one-rank MoE); every rank of a
        mesh warms up the same keys in the same order, so the all-to-alls inside pair up."""
        with swapped(self.swaps):
            return self.steps.warm_up(keys, progress)

    @torch.no_grad()
    def launch(
        self,
        sched: SchedulerOutputs,
        importer: Callable[[Sequence], None] | None = None,
        before_masks: Callable[[], None] | None = None,
    ) -> StepHandle:
        """Launch ``sched``'s step. ``before_masks``: called before the token masks of
        constrained rows are filled, once the step's model parts are launched (the loop feeds
        the previous step's tokens to the matchers there, so that the forward runs meanwhile)."""
        for slot in sched.to_zero:
            self.pool.zero(slot)
        for src, dst in sched.to_clone:
            self.pool.clone(src, dst)
        for seq in sched.to_import:
            importer(seq)
        sampled = [ch.seq for ch in sched.chunks if ch.sample]
        mode = step_mode(sampled)
        k = self.logprobs_k if any(s.params.logprobs is not None for s in sampled) else None
        with swapped(self.swaps):
            if self.split is not None or any(ch.seq.images is not None and not ch.from_device for ch in sched.chunks):
                return self._launch_host(sched, mode, k, before_masks)
            outs, where, first_row, stride, verify = self._launch_steps(sched, mode, k, before_masks)
            gap = self.steps.gap
        prompt_lp = self._prompt_logprobs(
            sched, outs[1].logits if outs[1] is not None else None, [r * stride for r in first_row]
        )
        handle = self._copy_back(sched, where, outs, prompt_lp, verify)
        handle.gap = gap
        return handle

    def _prompt_logprobs(self, sched: SchedulerOutputs, logits: torch.Tensor | None, first_row: Seq[int]) -> dict:
        """Prompt logprobs of the chunks that ask for them: chunk i's rows start at
        ``first_row[i]`` of ``logits``; each row predicts the next prompt token."""
        prompt_lp = {}
        for i, ch in enumerate(sched.chunks):
            p = ch.seq.params
            if p.prompt_logprobs is None or ch.from_device:
                continue
            n = min(ch.length, ch.seq.prompt_len - 1 - ch.start)
            if n <= 0:
                continue
            target = torch.tensor(ch.seq.prompt_ids[ch.start + 1 : ch.start + 1 + n], device=self.device)
            rows_lp = logits[first_row[i] : first_row[i] + n]
            prompt_lp[i] = (target, *logprobs(rows_lp, target, p.prompt_logprobs))
        return prompt_lp

    def _launch_steps(
        self, sched: SchedulerOutputs | None, mode: str, k: int | None, before_masks: Callable[[], None] | None = None
    ):
        """The decode rows and prompt chunks of ``sched`` (None: an idle rank's padding alone)
        through the step functions, at the sizes this turn's plan agreed."""
        chunks = [] if sched is None else sched.chunks
        dec, pre, ver, where, first_row = [], [], [], [], []
        for ch in chunks:
            seq = ch.seq
            if ch.drafts:
                where.append((VERIFY, len(ver)))
                first_row.append(len(ver))
                ver.append(VerifyChunk(seq.slot, ch.start, (seq.output_ids[-1], *ch.drafts), seq.controls))
            elif ch.from_device:
                where.append((0, len(dec)))
                first_row.append(len(dec))
                dec.append(DecodeRow(seq.slot, ch.start, seq.controls))
            else:
                where.append((1, len(pre)) if ch.sample else None)
                first_row.append(len(pre))
                ids = seq.prompt_ids[ch.start : ch.start + ch.length]
                # compact prefill: the decoder replays the prompt's last KEEP rows; prompt logprobs need every row
                exact = self.keep is None or seq.params.prompt_logprobs is not None
                keep_from = 0 if exact else max(0, seq.prompt_len - self.keep)
                pre.append(PrefillChunk(seq.slot, ch.start, ids, seq.controls if ch.sample else None, keep_from))
        wants_rows = sched is not None and any(
            ch.seq.params.prompt_logprobs is not None for ch in chunks if not ch.from_device
        )
        n_dec, n_pre, length, all_rows = self._plan(
            [len(dec), len(pre), max([len(c.ids) for c in pre] + [0]), int(wants_rows)]
        )
        # the decode and prefill parts' chunks in row order (a verify chunk's grammar masks: _verify_masks)
        parts = ([ch for ch in chunks if ch.from_device and not ch.drafts], [ch for ch in chunks if not ch.from_device])
        masked = tuple(any(ch.sample and ch.seq.grammar is not None for ch in part) for part in parts)

        def masks() -> tuple:
            if before_masks is not None:
                before_masks()
            return tuple(self._masks(part) if m else None for part, m in zip(parts, masked))

        d, p = self.steps.step(
            dec,
            pre,
            mode,
            k,
            bool(all_rows),
            min_requests=n_dec,
            min_chunks=n_pre,
            min_length=length,
            masked=masked,
            masks=masks,
        )
        stride = (
            p.logits.shape[0] // self.steps.prefill_layout(max(len(pre), n_pre), 1).requests
            if p is not None and all_rows
            else 1
        )
        if not ver:
            return [d, p], where, first_row, stride, ({}, None)
        # saved before the verify forward writes the rows a rejected draft must not leave behind
        saved = snapshot(self.pool, [v.slot for v in ver])
        verify = {i: (ver[w[1]], w[1]) for i, w in enumerate(where) if w is not None and w[0] == VERIFY}
        spec = [ch for ch in chunks if ch.drafts]
        k_ver = self.logprobs_k if any(ch.seq.params.logprobs is not None for ch in spec) else None
        mask = self._verify_masks(spec, self.steps.verify_layout(len(ver), max(len(v.ids) for v in ver)).length)
        return [d, p, self.steps.verify(ver, mode, k=k_ver, mask=mask)], where, first_row, stride, (verify, saved)

    def _verify_masks(self, chunks: Seq, length: int) -> torch.Tensor | None:
        """The token bitmasks of verify ``chunks`` (rows of ``length`` each; None: no grammar among
        them): a constrained chunk's row j holds its grammar's mask after its first j drafts, up to
        the first draft the grammar refuses (``GrammarState.draft_masks``); other rows allow all."""
        if not any(ch.seq.grammar is not None for ch in chunks):
            return None
        t0 = time.perf_counter()
        mask = torch.full((len(chunks) * length, self.mask_words), -1, dtype=torch.int32)
        for c, ch in enumerate(chunks):
            st = ch.seq.grammar
            if st is None or ch.seq.error is not None:
                continue
            st.draft_masks(ch.drafts, mask, c * length)
            if not mask[c * length].ne(0).any():  # the grammar allows no token here
                ch.seq.error = DEAD_GRAMMAR.format(n=len(ch.seq.output_ids))
                mask[c * length].zero_()
                mask[c * length, 0] = 1  # token 0 alone keeps the step defined; the loop ends the request
        self.mask_s += time.perf_counter() - t0
        return mask.pin_memory() if self.async_copy else mask

    def step_time(self, lengths: Seq[int]) -> float | None:
        """The measured seconds of a step whose requests verify ``lengths`` drafts each (0: a
        decode row), from the step graphs' timings (None: a part not measured yet)."""
        steps, total = self.steps, 0.0
        plain, verify = sum(1 for n in lengths if n == 0), [n for n in lengths if n > 0]
        parts = [steps.decode_layout(plain)] if plain else []
        if verify:
            parts.append(steps.verify_layout(len(verify), max(verify) + 1))
        for layout in parts:
            t = steps.times.estimate((layout.kind, layout.requests, layout.length))
            if t is None:
                return None
            total += t
        return total

    @torch.no_grad()
    def rollback(self, handle: StepHandle, rejected: Seq[tuple[int, int]]) -> None:
        """Undo what the rejected drafts of verify chunks ``(i, accepted)`` wrote: restore their
        slots' saved state and run each one's token and accepted drafts again, as prompt chunks
        that sample nothing, in one step (the bonus tokens in ``next_token`` stay)."""
        restore(self.pool, handle.saved, [handle.verify[i][1] for i, _ in rejected])
        chunks = [
            PrefillChunk(handle.verify[i][0].slot, handle.verify[i][0].start, handle.verify[i][0].ids[: n + 1])
            for i, n in rejected
        ]
        with swapped(self.swaps):
            self.steps.step((), chunks, "greedy", draft=False)

    def _masks(self, chunks: Seq) -> torch.Tensor | None:
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
        mask, dead = self._filler.fill(states, self.mask_words, pinned=self.async_copy, skip=failed)
        for i in dead:
            chunks[i].seq.error = DEAD_GRAMMAR.format(n=len(chunks[i].seq.output_ids))
        self.mask_s += time.perf_counter() - t0
        return mask

    def _launch_host(
        self, sched: SchedulerOutputs, mode: str, k: int | None, before_masks: Callable[[], None] | None
    ) -> StepHandle:
        """One eager packed forward of a batch built on the host: context parallelism (this
        rank's share of the chunks; every CP rank then samples from every row alike), or a step
        with image spans, whose rows take their merged embeddings (the requests' images are
        encoded here, at their first prefill step, all in one pass)."""
        c, params = self.model
        ids, pos, dev_rows, dev_slots, chunks, sampled, where = [], [], [], [], [], [], []
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
            where.append((0, len(sampled)) if ch.sample else None)
            if ch.sample:
                sampled.append(SampledRow(offset + ch.length - 1, seq.slot, seq.controls, ch.start + ch.length))
            offset += ch.length
        token_ids = torch.tensor(ids, device=self.device)
        if dev_rows:
            token_ids[torch.tensor(dev_rows, device=self.device)] = self.next_token[
                torch.tensor(dev_slots, device=self.device)
            ]
        batch = Batch(
            token_ids, torch.tensor(pos, device=self.device), group_chunks(chunks, self.device), tuple(chunks)
        )
        spans = [
            (chunks[i].offset, ch.start, ch.length, ch.seq.images)
            for i, ch in enumerate(sched.chunks)
            if ch.seq.images is not None and not ch.from_device
        ]
        if spans:
            encode_requests(self.model, [item for *_, item in spans])
            embeds, image_rows = batch_embeddings(self.model, token_ids, spans)
            batch = dataclasses.replace(batch, embeds=embeds, image_rows=image_rows)
            for ch in sched.chunks:
                if ch.seq.images is not None and ch.start + ch.length >= ch.seq.images.positions()[-1][1]:
                    ch.seq.images = None  # past its last span: its later chunks are text, the features are dropped
        if self.split is not None:
            batch = self.split(batch)
        logits, _ = forward_batch(params, self.pool.state, c, batch)
        if batch.split is not None:  # this step's chunks were split: gather every row
            logits = context_gather(logits, batch.split)
        layout = Layout("decode", len(sampled))
        buf = torch.tensor(
            fill(layout, [0] * layout.model_size, sampled, self.pool.slots), dtype=torch.long, device=self.device
        )
        if before_masks is not None:
            before_masks()
        mask = self._masks([ch for ch in sched.chunks if ch.sample])
        mask = None if mask is None else mask.to(self.device)
        out = StepOut(
            *sample_rows(logits, self.next_token, layout.sampling_part(buf), mode, k, self.steps.vocab_ids, mask),
            logits,
        )
        return self._copy_back(sched, where, [out], self._prompt_logprobs(sched, logits, [ch.offset for ch in chunks]))

    @torch.no_grad()
    def idle(self) -> None:
        """What a rank with nothing to launch runs while other ranks step, so that its EP group's
        all-to-alls complete: the turn's agreed steps on padding alone (eager context
        parallelism: one forward of a padding request; the scratch slot, nothing kept)."""
        with swapped(self.swaps):
            if self.split is None:
                self._launch_steps(None, "greedy", None)
                return
            c, params = self.model
            decode_logits(params, self.pool.state, c, self.next_token, *idle_step(self.pool.state, self.device))

    def _plan(self, mine: list[int]) -> list[int]:
        """This turn's steps: decode requests, prefill chunks, prefill length, every row or
        not. On a multi-rank mesh the max over ranks, so every rank runs the same steps at the
        same sizes and the EP all-to-alls inside them pair up."""
        return mine if self.lockstep is None else self.lockstep.agree(mine)

    def _copy_back(self, sched, where, outs: list, prompt_lp, verify: tuple = ({}, None)) -> StepHandle:
        """Host copies of every part's results, queued behind the step."""

        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            # a copy even on the CPU: a captured step's outputs are its graph's, rewritten by its next replay
            return None if t is None else t.to("cpu", non_blocking=self.async_copy, copy=True)

        parts = [
            tuple(host(t) for t in out[:4]) if out is not None else (torch.empty(0, dtype=torch.long),)
            for out in outs[:VERIFY]
        ]
        if len(outs) > VERIFY:
            v = outs[VERIFY]
            parts.append(
                tuple(host(t) for t in (v.tokens, v.accepted, v.logprob, v.top_ids, v.top_logprobs) if t is not None)
            )
        drafts = [
            None if out is None or out.drafts is None else (host(out.drafts), host(out.confidence)) for out in outs
        ]
        lp = {i: tuple(host(x) for x in v) for i, v in prompt_lp.items()}
        done = None
        if self.async_copy:
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        return StepHandle(sched, where, parts, lp, done, *verify, part_drafts=drafts)
