"""Steps over static buffers per bucket: compiled, captured as graphs and replayed.

A graph key is (kind, token bucket, request bucket, sampler mode, logprobs, masked). A step is the
model part (compiled once per bucket) followed by the sampler (``steps.sample_rows``, compiled once
per mode for every bucket), the functions of ``step_functions``; on a device with graphs both are
captured as one graph (``graph_capture``), so a replay turns the step's input buffer into sampled
tokens written to ``next_token`` with no host work between. Decode and prefill alike are captured,
except prefill keys that return every row's logits (prompt logprobs), whose ``[tokens, vocab]``
fp32 output a graph would hold for good (2 GiB at 4096 tokens of a 129k vocabulary), and on a
mesh with ep > 1 every prefill key, whose EP dispatch reads its splits on the host. Prefill gains
from graphs as decode does: uncaptured, a 4096-token P8 prefill (~650 launches) ran 3.9 ms longer
than its kernels on an H200 (55.2 vs 51.3 ms).

Every input of a step sits in one device arena (``step_arena``). A key's first step runs the compiled
functions (compiling them: ``warm_up`` does it ahead of time on padding), then captures the graph.
``compile=False`` runs the same step functions eagerly at exact sizes (the CPU engine, the tests' eager
twin). ``draft=False`` runs keys without the drafter (the bench's baselines).

A step with structured-output rows (``masked``) runs a sampler variant that reads a token bitmask
per sampled row from a static device buffer (``StepArena.masks``), in two pieces (``graph_capture``):
the host fills the masks while the model part runs. Unconstrained batches pay nothing for it.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import torch

from ..api import Model
from ..kernels.ops_engram import engram_rows
from ..passes.manager import accelerator_of, resolve_disabled
from ..passes.saved_steps import SavedSteps
from ..sharding.cp import ContextRank
from .engram_tables import Placed, place_engram_tables
from .graph_capture import GRAPH_DEVICES, Entry, GraphEntries, GraphKey
from .spec_schedule import StepTimes
from .step_arena import GREEDY, DecodeRow, PrefillChunk, StepArena, VerifyChunk
from .step_functions import StepFunctions
from .step_inputs import Layout, StepSizes
from .steps import StepOut, VerifyOut
from .structured import mask_words


class StepGraphs(GraphEntries, StepSizes):
    """Decode / prefill steps over a model and a state pool: compiled per bucket and replayed as
    graphs (``compile=True``), or the same step functions run eagerly at the exact sizes."""

    def __init__(
        self,
        model: Model,
        state: dict,
        next_token: torch.Tensor,
        *,
        max_requests: int,
        max_tokens: int,
        accelerator: str | None = None,
        graphs: bool | None = None,
        inductor: bool = False,
        dump_dir: str | None = None,
        disabled: Sequence[str] | None = None,
        compile: bool = True,
        max_drafts: int = 0,
        keep: int | None = None,
        over: dict | None = None,
        prefill_over: dict | None = None,
        n_drafts: int = 0,
        varlen: bool = False,
        engram_tables: str | None = None,
        engram_budget: int | None = None,
        context: ContextRank | None = None,
        saved: SavedSteps | None = None,
        invariant: bool = False,
    ) -> None:
        """``max_drafts``: the most draft tokens a verify chunk carries (0: no verify steps).
        ``n_drafts``: drafts the model's drafter proposes after every step (``mtp`` / ``dspark``; 0: none).
        ``varlen``: confidence-scheduled verification: verify chunks of every length 2 .. max_drafts + 1
        (not only the longest) and every step part timed (``spec_schedule.StepTimes``).
        ``disabled``: the graph passes switched off (None, for a bench or script: ``DEEPINFER_DISABLE_PASSES``).
        ``over``: ``graphs.swap`` replacements that win over the pipeline's kernel swaps in the
        compiled steps (batch-invariant inference's table, ``passes/batch_invariant.py``);
        ``prefill_over``: more that win in compiled prefill steps alone, which are then run
        uncaptured (a mesh's ragged EP dispatch, whose splits are read on the host: ``EPSwaps``).
        ``engram_tables`` / ``engram_budget`` (bytes): where compiled steps hold V4.1's Engram
        tables (``engram_tables.place_engram_tables``; None: ``DEEPINFER_ENGRAM_TABLES`` /
        ``DEEPINFER_ENGRAM_DEVICE_GIB``); eager steps read them memory-mapped. ``context``: this
        rank's place in a CP group; prefill chunks are then padded to a multiple of twice its
        size and each step runs this rank's static share of them (``sharding.cp.split_bucket``).
        ``saved``: Inductor-compiled steps saved ahead of time and loaded on a later start
        (``passes/saved_steps.py``; None: traced by ``torch.compile`` on every start). ``invariant``:
        batch-invariant steps (with ``over`` its table): each compiled graph is checked for float
        sums outside the fixed-order ops (``passes/invariant_guard.py``)."""
        self.config, self.params = model
        self.state = state
        self.next_token = next_token
        self.n_drafts = n_drafts
        self.over = dict(over or {})
        self.prefill_over = dict(prefill_over or {})
        device = model.device
        self.accelerator = accelerator or accelerator_of(device)
        has_graphs = device.type in GRAPH_DEVICES
        if graphs and not (has_graphs and compile):
            raise ValueError(
                f"graph capture needs compiled steps on a CUDA or Ascend device; this model is on {device}"
            )
        self.disabled = tuple(sorted(resolve_disabled())) if disabled is None else tuple(disabled)
        self.inductor, self.dump_dir = inductor, dump_dir
        GraphEntries.__init__(
            self,
            device,
            compile and has_graphs and graphs is not False,
            StepTimes(device) if varlen else None,
            uncaptured=("prefill",) if self.prefill_over else (),
        )
        StepSizes.__init__(self, compile, max_requests, max_tokens, max_drafts, varlen, keep, context)
        self.scratch = state["slots"]
        self.gap: tuple | None = None  # the last masked step's timing events around its mask work (CUDA)
        self.arena = StepArena(device, self.scratch, *self.largest(), mask_words(self.config.vocab_size))
        self.vocab_ids = torch.arange(self.config.vocab_size, device=device)  # the sampler's race keys
        self.functions = StepFunctions(
            model,
            state,
            next_token,
            self.vocab_ids,
            accelerator=self.accelerator,
            compile=compile,
            inductor=inductor,
            dump_dir=dump_dir,
            disabled=self.disabled,
            split=None if context is None else context.bucket,
            saved=saved,
            invariant=invariant,
        )
        self.engram: list[Placed] = []  # where each Engram table went (compiled steps)
        if compile:
            self.engram = place_engram_tables(self.params, self.device, engram_tables, engram_budget)
        if any(p.where == "host" for p in self.engram):
            # not a disableable pass: a GPU step cannot read host rows any other way; it wins over
            # batch invariance's table too (which holds the place to the reference's host round
            # trip, which a CUDA graph cannot capture): a gather is exact in any batch
            self.over["engram.gather_rows"] = engram_rows

    # -- steps ------------------------------------------------------------------------------
    def step(
        self,
        decode: Sequence[DecodeRow],
        prefill: Sequence[PrefillChunk],
        mode: str,
        k: int | None = None,
        all_rows: bool = False,
        min_requests: int = 0,
        min_chunks: int = 0,
        min_length: int = 0,
        masked: tuple[bool, bool] = (False, False),
        masks: Callable[[], tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
        draft: bool = True,
    ) -> tuple[StepOut | None, StepOut | None]:
        """Launch one step: the decode rows through the decode graph, then the prompt chunks
        through the prefill graph, every input in one host-to-device copy. Sampling ``mode``
        (``sampler.MODES``) must serve every row; ``k``: top logprobs to return. Token i of the
        decode result is row i's; the prefill result has one token per chunk (a chunk that
        samples nothing writes its token to the scratch slot). With ``all_rows`` the prefill
        logits cover every row, chunk c's from ``c * layout.length``. ``min_*``: run buckets for
        at least that many (padded), as the ranks of a mesh agree. ``draft``: False runs the steps
        without the drafter (the bench's plain baselines). ``masked``: whether the decode
        part and the prefill part run their masked sampler (structured output); ``masks`` then
        returns their host token bitmasks (int32 ``[rows, words]``, pinned on a GPU; the rows in
        order), called once the step's model parts are launched, since it may wait for the
        previous step (``EngineLoop._feed``); only the masked parts' samplers wait for it.
        ``gap`` is then (on CUDA) a pair of timing events around the mask work: a sampler
        that waited for its masks shows as their elapsed time beyond the copy's."""
        parts: list[tuple[Entry, list[int]]] = []
        if decode or min_requests:
            layout = self.decode_layout(max(len(decode), min_requests))
            parts.append((self._entry(layout, mode, k, masked[0], draft), self.arena.decode_inputs(layout, decode)))
        if prefill or min_chunks:
            length = max([len(ch.ids) for ch in prefill] + [min_length, 1])
            layout = self.prefill_layout(max(len(prefill), min_chunks), length, all_rows)
            parts.append((self._entry(layout, mode, k, masked[1], draft), self.arena.prefill_inputs(layout, prefill)))
        self.arena.copy([(e.layout, values) for e, values in parts])
        # masked parts launch their model part here, before their masks are known: the host
        # fills the masks (and waits for the previous step's tokens) while it runs
        firsts = [self._start(e) for e, _ in parts]
        self.gap = None
        if any(masked):
            before = self._event()
            host_masks = masks() if masks is not None else (None, None)
            for e, _ in parts:
                host = host_masks[0 if e.layout.kind == "decode" else 1]
                if host is not None:
                    e.mask[: host.shape[0]].copy_(host, non_blocking=True)
                    e.mask[host.shape[0] :].fill_(-1)  # padding rows: unconstrained
            self.gap = None if before is None else (before, self._event())
        outs = [self._finish(e, first) for (e, _), first in zip(parts, firsts)]
        dec = outs.pop(0) if decode or min_requests else None
        return dec, (outs[0] if outs else None)

    def verify(
        self,
        chunks: Sequence[VerifyChunk],
        mode: str,
        draft: bool = True,
        k: int | None = None,
        mask: torch.Tensor | None = None,
        min_chunks: int = 0,
        min_length: int = 0,
    ) -> VerifyOut:
        """Launch one verify step (after ``step``'s parts, in its own copy): every chunk's rows scored in
        one target forward, drafts accepted on the device (``spec_accept``), each bonus token to
        ``next_token[slot]``. ``mode`` must serve every chunk; ``draft`` False: without the drafter
        (benches); ``k``: every row's top logprobs too; ``mask``: the rows' host token bitmasks
        (``[chunks * layout.length, words]``); ``min_*``: as in ``step`` (no chunks: padding alone)."""
        layout = self.verify_layout(max(len(chunks), min_chunks), max([len(c.ids) for c in chunks] + [min_length, 2]))
        e = self._entry(layout, mode, k, mask is not None, draft)
        self.arena.copy([(layout, self.arena.verify_inputs(layout, chunks))])
        if mask is not None:
            e.mask[: mask.shape[0]].copy_(mask, non_blocking=True)
            e.mask[mask.shape[0] :].fill_(-1)
        return self._run(e)

    def decode(
        self, slots: Sequence[int], starts: Sequence[int], min_requests: int = 0, mode: str = "greedy"
    ) -> StepOut:
        """Greedy decode of one token per request, read from ``next_token[slot]`` (benches, tests)."""
        rows = [DecodeRow(s, p, GREEDY) for s, p in zip(slots, starts)]
        return self.step(rows, (), mode, min_requests=min_requests)[0]

    def prefill(
        self,
        chunks: Sequence[tuple[int, int, Sequence[int]]],
        all_rows: bool = False,
        min_chunks: int = 0,
        min_length: int = 0,
        keep_from: Sequence[int] = (),
    ) -> tuple[StepOut, list[int]]:
        """``chunks``: (slot, start, token ids), each sampled greedily (``keep_from``: each chunk's
        ``PrefillChunk.keep_from``, compact prefill; default 0). Returns the step's results
        and, per chunk, the row of its first logit (``all_rows``: chunk c owns rows ``r ..
        r + n - 1``; otherwise only its last token's row ``r``)."""
        keep_from = list(keep_from) or [0] * len(chunks)
        pre = [PrefillChunk(slot, start, ids, GREEDY, keep) for (slot, start, ids), keep in zip(chunks, keep_from)]
        out = self.step((), pre, "greedy", all_rows=all_rows, min_chunks=min_chunks, min_length=min_length)[1]
        stride = out.logits.shape[0] // self.prefill_layout(max(len(chunks), min_chunks), 1).requests if all_rows else 1
        return out, [i * stride for i in range(len(chunks))]

    def warm_up(self, keys: Sequence[tuple], progress: Callable[[str], None] | None = None) -> float:
        """Compile and capture the steps of ``keys`` (layout, sampler mode[, with the drafter:
        default True]) on padding alone (the scratch slot: nothing real is read or written).
        Returns the seconds it took."""
        t0 = time.perf_counter()
        for layout, mode, *draft in keys:
            e = self._entry(layout, mode, None, False, *draft)
            if not e.captured or not self.graphs:
                self.arena.copy([(layout, self.arena.inputs(layout, ()))])
                self._run(e)
            if self.times is not None and layout.kind in ("decode", "verify"):
                for _ in range(2):  # the confidence scheduler's step-time curve (spec_schedule.py)
                    self._run(e)
            if progress is not None:
                progress(e.key.name)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def reset(self, prefill_over: dict | None = None) -> None:
        """Forget every compiled and captured graph: a captured graph replays the tensors it was
        captured with, so after an EPLB shuffle (new placement tables, moved expert slots) the
        steps are traced again on their next call; ``prefill_over`` (given) replaces the prefill
        steps' own swaps (the shuffle's new EP groups)."""
        self._forget()
        self.functions.clear()
        if prefill_over is not None:
            self.prefill_over = dict(prefill_over)

    def _entry(self, layout: Layout, mode: str, k: int | None, masked: bool = False, draft: bool = True) -> Entry:
        n_drafts = self.n_drafts if draft else 0
        key = GraphKey(
            layout.kind,
            layout.tokens or layout.requests,
            layout.requests,
            layout.all_rows,
            mode,
            k,
            layout.kept,
            masked,
            n_drafts,
        )
        if key in self._entries:
            return self._entries[key]
        dev = self.arena.region(layout)
        mask = self.arena.mask_rows(layout) if masked else None
        over = {**self.over, **self.prefill_over} if layout.kind == "prefill" else self.over
        pieces, backend = self.functions.pieces(key, layout, dev, mask, over)
        e = Entry(key, layout, dev, mask, pieces, backend)
        self._entries[key] = e
        return e
