"""Turns ``SchedulerOutputs`` into one step on the device.

The host lays the step out once (``StepGraphs.step``: decode rows, prompt chunks, each sampled
row's controls) and the device does the rest: the model, the sampler, and the write of every
sampled token to ``next_token[slot]``, the buffer decode rows read their input from, so step
N+1 can be launched before the host has seen step N's tokens. Results come back with one
device-to-host copy per part, queued behind the step on its stream (the next step, which may
replay the same graph over the same output buffers, is queued after the copies);
``StepHandle.wait`` is the only place the host waits for the device. Verify chunks
(speculative decoding) run as a third part after decode and prefill; a rejected draft needs
nothing undone on the device (the state's rings keep room for it, ``graphs/state.py``).

Structured output: a step with constrained rows carries one token bitmask per sampled row
(``grammar_masks``), filled once the step's model parts are launched and the loop has fed every
matcher its request's last token (``before_masks``, ``loop.py``); only the samplers wait for them.
"""

from __future__ import annotations

from typing import Callable, Sequence as Seq

import torch

from ..api import Model
from ..graphs.swap import swapped
from ..passes.batch_invariant import batch_invariant_swaps
from ..passes.manager import accelerator_of, resolve_disabled
from ..passes.saved_steps import SavedSteps
from ..sharding.cp import ContextRank
from ..sharding.lockstep import LockStep
from ..sharding.parallel import idle_step
from ..vision.compiled import request_encoder
from .cache import CachePool
from .engram_tables import engram_budget
from .grammar_masks import GrammarMasks
from .graph_runner import StepGraphs
from .host_step import host_step
from .options import StepOptions
from .request import Sequence
from .sampler import MODES
from .sampling import MAX_LOGPROBS
from .scheduler import SchedulerOutputs
from .step_arena import DecodeRow, PrefillChunk, VerifyChunk
from .step_handle import VERIFY, StepHandle, copy_back, prompt_logprobs
from .steps import decode_logits


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
        context: ContextRank | None = None,
        lockstep: LockStep | None = None,
        max_drafts: int = 0,
        model_drafts: int = 0,
        varlen: bool = False,
        prefill_swaps: dict | None = None,
    ) -> None:
        """``options``: how steps run (compiled or eager, graphs, passes, buckets). ``swaps``:
        ``graphs.swap`` replacements in force around every forward (a multi-rank mesh: the
        expert-parallel MoE, ``sharding.parallel.ep_swaps``); ``prefill_swaps``: those that win
        over them in compiled prefill steps, which are then not captured (``engine.ranks.EPSwaps``).
        ``context``: this rank's place in a CP group (context parallelism): compiled prefill steps run its static share of their
        bucket, eager steps its share of a host-built batch (``sharding.cp``). ``lockstep``: a
        multi-rank mesh, whose ranks agree on each turn's step sizes (``_plan``) so that the
        all-to-alls inside them pair up. ``max_drafts``: the longest draft of speculative
        decoding (0: off), which sizes the verify buckets. ``model_drafts``: the drafts the model's drafter proposes after every step (speculative
        decoding's ``mtp`` and ``dspark`` methods); ``varlen``: confidence-scheduled verification
        (verify buckets of every length, step parts timed: ``step_time``)."""
        self.model = model
        # eager context parallelism: each step's batch built on the host, then this rank's share of it
        self.split = context.step if context is not None and not options.compiled else None
        self.lockstep = lockstep
        # batch-invariant forms win over every replacement but the sharding's, eager or compiled
        invariant = {}
        if options.batch_invariant:
            accelerator = options.accelerator or accelerator_of(model.device)
            invariant = batch_invariant_swaps(swaps or {}, accelerator, resolve_disabled(options.disabled_passes))
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
            prefill_over=prefill_swaps,
            n_drafts=model_drafts,
            varlen=varlen,
            engram_tables=options.engram_tables,
            engram_budget=engram_budget(self.device, options.engram_device_gib),
            context=context if options.compiled else None,
            saved=SavedSteps(options.saved_dir) if options.saved_dir else None,
            invariant=options.batch_invariant,
        )
        self.keep = options.keep
        self.logprobs_k = min(MAX_LOGPROBS, model.config.vocab_size)
        self.async_copy = self.device.type == "cuda"
        self.grammar_masks = GrammarMasks(model.config.vocab_size, pinned=self.async_copy)
        self.encode_images = request_encoder(options.compiled, options.inductor, options.batch_invariant)

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
                handle = self._launch_host(sched, mode, k, before_masks)
                handle.release = self.grammar_masks.lend()
                return handle
            outs, where, first_row, stride, verify = self._launch_steps(sched, mode, k, before_masks)
            gap = self.steps.gap
        logits = outs[1].logits if outs[1] is not None else None
        prompt_lp = prompt_logprobs(sched, logits, [r * stride for r in first_row], self.device)
        handle = copy_back(sched, where, outs, prompt_lp, verify, async_copy=self.async_copy, device=self.device)
        handle.gap = gap
        handle.release = self.grammar_masks.lend()  # this step's host mask buffers, until it is done
        return handle

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
        n_dec, n_pre, length, all_rows, n_ver, ver_len = self._plan(
            [len(dec), len(pre), _longest(pre), int(wants_rows), len(ver), _longest(ver)]
        )
        # the decode and prefill parts' chunks in row order (a verify chunk's grammar masks: _verify_masks)
        parts = ([ch for ch in chunks if ch.from_device and not ch.drafts], [ch for ch in chunks if not ch.from_device])
        masked = tuple(any(ch.sample and ch.seq.grammar is not None for ch in part) for part in parts)

        def masks() -> tuple:
            if before_masks is not None:
                before_masks()
            return tuple(self.grammar_masks.rows(part) if m else None for part, m in zip(parts, masked))

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
        if not n_ver:
            return [d, p], where, first_row, stride, {}
        spec = [ch for ch in chunks if ch.drafts]
        k_ver = self.logprobs_k if any(ch.seq.params.logprobs is not None for ch in spec) else None
        mask = self.grammar_masks.verify_rows(spec, self.steps.verify_layout(n_ver, ver_len).length)
        out = self.steps.verify(ver, mode, k=k_ver, mask=mask, min_chunks=n_ver, min_length=ver_len)
        verify = {i: (ver[w[1]], w[1]) for i, w in enumerate(where) if w is not None and w[0] == VERIFY}
        return [d, p, out][: 3 if ver else 2], where, first_row, stride, verify  # none here: padding

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
        """This turn's steps: decode requests, prefill chunks and length, every row or not, verify
        chunks and length. On a multi-rank mesh the max over ranks, so every
        rank runs the same steps at the same sizes (padded) and the EP all-to-alls inside them pair up."""
        return mine if self.lockstep is None else self.lockstep.agree(mine)

    def _launch_host(
        self, sched: SchedulerOutputs, mode: str, k: int | None, before_masks: Callable[[], None] | None
    ) -> StepHandle:
        """One eager packed forward of a batch built on the host (``host_step``): context
        parallelism, or a step with image spans."""

        def masks() -> torch.Tensor | None:
            if before_masks is not None:
                before_masks()
            return self.grammar_masks.rows([ch for ch in sched.chunks if ch.sample])

        vocab_ids = self.steps.vocab_ids
        out, where, first_row = host_step(
            self.model, self.pool, self.next_token, vocab_ids, sched, mode, k, self.split, masks, self.encode_images
        )
        prompt_lp = prompt_logprobs(sched, out.logits, first_row, self.device)
        return copy_back(sched, where, [out], prompt_lp, async_copy=self.async_copy, device=self.device)


def _longest(chunks: Seq) -> int:
    return max([len(ch.ids) for ch in chunks] + [0])
