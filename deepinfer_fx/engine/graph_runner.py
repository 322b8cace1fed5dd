"""Steps over static buffers per bucket: compiled, captured as graphs and replayed.

A graph key is (kind, token bucket, request bucket, sampler mode, logprobs, masked). A step is the
model part (compiled once per bucket: ``passes.compiler``, the accelerator's pass pipeline,
dumps, cache key) followed by the sampler (``steps.sample_rows``, compiled once per mode for
every bucket); on a device with graphs both are captured as one graph, so a replay turns the
step's input buffer into sampled tokens written to ``next_token`` with no host work between.
Graph memory comes from a pool shared by the graphs of a kind (decode, prefill); a masked step's
sampler graph, captured after its model part's, never takes the memory of the logits it reads. Decode and
prefill alike are captured, except prefill keys that return every row's logits (prompt
logprobs), whose ``[tokens, vocab]`` fp32 output a graph would hold for good (2 GiB at 4096
tokens of a 129k vocabulary). Prefill gains from graphs as decode does: uncaptured, a 4096-token
P8 prefill (~650 launches) ran 3.9 ms longer than its kernels on an H200 (55.2 vs 51.3 ms).

Every input of a step sits in one device arena (``step_inputs``): the host lays a step out
once, pads it to its buckets and copies it in one host->device copy. The first step of a key
runs the compiled functions (which compiles them: ``warm_up`` does it ahead of time on
padding) and captures the graph right after. ``compile=False`` runs the same step functions
eagerly at the exact sizes (the CPU engine and the tests' eager twin).

With the model's drafter (``n_drafts`` > 0: MTP-1 or DSpark) a step's key carries its draft
count: the model part also returns what the drafter reads (the final streams, or DSpark's
target layers' streams) and a third compiled piece, ``steps.propose_drafts``, follows the
sampler inside the same graph. A rollback's replay of
accepted drafts runs keys without it (``draft=False``): the drafter already saw those rows.

A step with structured-output rows (``masked``) runs a sampler variant that reads a token bitmask
per sampled row from a static device buffer (``masks``), and runs in two pieces (two graphs):
the model part is launched first, then the host fills the masks (its matchers may first need
the previous step's tokens) and copies them, then the sampler runs over the model part's
static output; so the filling hides behind the forward. Every other step runs the unmasked
sampler inside its one graph, so unconstrained batches pay nothing for it. ``compile=False``
runs the same pieces uncompiled.

``GraphWrapper`` is what a device's graph API must provide; ``DeviceGraph`` serves CUDA graphs
on NVIDIA and ACL graphs on Ascend (torch_npu is imported only there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from ..api import Model
from ..graphs.model import cached_engram_layout
from ..graphs.swap import swapped
from ..kernels.ops_engram import engram_rows
from ..kernels.triton import register_nvidia_kernels
from ..passes.compiler import DeepinferBackend, compile_graph, make_backend
from ..passes.dump import graph_name
from .engram_tables import Placed, place_engram_tables
from .step_inputs import Layout, SampledRow, fill, float_bits
from .spec_accept import accept_rows
from .spec_schedule import StepTimes
from .steps import StepOut, VerifyOut, decode_logits, prefill_logits, propose_drafts, sample_rows, verify_out
from .structured import mask_words


def buckets(limit: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from ``smallest`` up to the first one >= ``limit``."""
    out = [smallest]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return tuple(out)


def bucket_for(n: int, choices: Sequence[int]) -> int:
    for b in choices:
        if b >= n:
            return b
    raise ValueError(f"{n} does not fit the largest bucket {choices[-1]}")


@dataclass(frozen=True)
class GraphKey:
    kind: str  # "decode", "prefill" or "verify"
    tokens: int  # packed tokens of the step
    requests: int  # chunks (requests) of the step
    all_rows: bool = False  # prefill: logits for every row (prompt logprobs), not just the last
    mode: str = "greedy"  # the sampler's mode (sampler.MODES)
    k: int | None = None  # top logprobs returned
    kept: int = 0  # prefill: rows per chunk the decoder replays (V4.1 compact prefill; 0: every row)
    masked: bool = False  # the sampler applies structured output's token bitmask
    drafts: int = 0  # drafts the model's drafter proposes after sampling (0: none)

    @property
    def model_name(self) -> str:
        """The model part's name, shared by every sampler mode of the bucket."""
        return (
            graph_name(self.kind, t=self.tokens, r=self.requests)
            + ("-all" if self.all_rows else "")
            + (f"-kept{self.kept}" if self.kept else "")
            + ("-streams" if self.drafts else "")
        )

    @property
    def name(self) -> str:
        return (
            f"{self.model_name}-{self.mode}"
            + (f"-k{self.k}" if self.k is not None else "")
            + ("-masked" if self.masked else "")
            + (f"-draft{self.drafts}" if self.drafts else "")
        )


class GraphWrapper(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class DeviceGraph:
    """One captured graph of a device's graph API (``torch.cuda`` or torch_npu's ``torch.npu``,
    which mirror each other), allocating from ``pool`` (``graph_api(device_type).graph_pool_handle()``)."""

    def __init__(self, device_type: str, pool: object) -> None:
        self.api = graph_api(device_type)
        self.pool = pool
        self.graph = self.api.CUDAGraph() if device_type == "cuda" else self.api.NPUGraph()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with self.api.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


GRAPH_DEVICES = ("cuda", "npu")  # CUDA graphs on NVIDIA, ACL graphs on Ascend


def graph_api(device_type: str):
    """``torch.cuda`` or ``torch.npu``: the module with ``CUDAGraph``/``NPUGraph`` and pools."""
    if device_type == "npu":
        try:
            import torch_npu  # noqa: F401  (only on Ascend machines: registers torch.npu)
        except ImportError as e:
            raise RuntimeError("ACL graphs need torch_npu (Ascend); run with graphs off elsewhere") from e
    return getattr(torch, device_type)


@dataclass(frozen=True)
class DecodeRow:
    """One decode request: its slot and position, the sampling controls of its row."""

    slot: int
    start: int
    controls: tuple[int, int, int, int, int]  # step_inputs.SampledRow.controls


@dataclass(frozen=True)
class PrefillChunk:
    """One prompt chunk; ``controls`` None when the chunk samples nothing (not the prompt's end)."""

    slot: int
    start: int
    ids: Sequence[int]
    controls: tuple[int, int, int, int, int] | None = None
    keep_from: int = 0  # compact prefill: the first prompt position the decoder replays (0: every row)


@dataclass(frozen=True)
class VerifyChunk:
    """One speculating request: its last token then its drafts, from position ``start``."""

    slot: int
    start: int
    ids: Sequence[int]
    controls: tuple[int, int, int, int, int]


GREEDY = (0, 0, float_bits(1.0), 0, 0)  # controls of a greedy row: temperature 0


@dataclass
class _Piece:
    """One captured unit of a step: the whole step, or (a masked step) its model part or its
    sampler, which takes the model part's output (``(logits, what the drafter reads)``)."""

    fn: Callable[..., Any]
    graph: GraphWrapper | None = None
    out: Any = None  # the captured graph's static output


@dataclass
class _Entry:
    key: GraphKey
    layout: Layout
    dev: torch.Tensor  # the key's region of the device arena: every input of its steps
    mask: torch.Tensor | None  # masked keys: the token bitmask rows of its sampled rows
    pieces: tuple[_Piece, ...]  # the whole step; masked decode / prefill keys: model part, then sampler
    backend: DeepinferBackend | None
    compile_s: float = 0.0
    capture_s: float = 0.0
    calls: int = field(default=0)
    started: object = None  # StepTimes.start() of the call in flight (varlen speculation)

    @property
    def captured(self) -> bool:
        return all(p.graph is not None for p in self.pieces)


class StepGraphs:
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
        disabled: Sequence[str] = (),
        compile: bool = True,
        max_drafts: int = 0,
        keep: int | None = None,
        over: dict | None = None,
        n_drafts: int = 0,
        varlen: bool = False,
        engram_tables: str | None = None,
        engram_budget: int | None = None,
    ) -> None:
        """``max_drafts``: the most draft tokens a verify chunk carries (0: no verify steps).
        ``n_drafts``: drafts the model's drafter proposes after every step (``mtp`` / ``dspark``; 0: none).
        ``varlen``: confidence-scheduled verification: verify chunks of every length 2 .. max_drafts + 1
        (not only the longest) and every step part timed (``spec_schedule.StepTimes``).
        ``over``: ``graphs.swap`` replacements that win over the pipeline's kernel swaps in the
        compiled steps (batch-invariant inference's table, ``passes/batch_invariant.py``).
        ``engram_tables`` / ``engram_budget`` (bytes): where compiled steps hold V4.1's Engram
        tables (``engram_tables.place_engram_tables``; None: ``DEEPINFER_ENGRAM_TABLES`` /
        ``DEEPINFER_ENGRAM_DEVICE_GIB``); eager steps read them memory-mapped."""
        self.config, self.params = model
        self.state = state
        self.next_token = next_token
        self.device = model.device
        self.compile = compile
        self.keep = keep  # V4.1 compact prefill's KEEP (engine/options.py checked it); None: exact prefill
        self.n_drafts = n_drafts
        self.over = dict(over or {})
        self.accelerator = accelerator or {"cuda": "nvidia", "npu": "ascend"}.get(self.device.type, "cpu")
        has_graphs = self.device.type in GRAPH_DEVICES
        if graphs and not (has_graphs and compile):
            raise ValueError(
                f"graph capture needs compiled steps on a CUDA or Ascend device; this model is on {self.device}"
            )
        self.graphs = compile and has_graphs and graphs is not False
        self.inductor, self.dump_dir, self.disabled = inductor, dump_dir, tuple(disabled)
        self.decode_buckets = buckets(max_requests)
        self.request_buckets = buckets(max_requests)
        self.length_buckets = buckets(max_tokens, smallest=min(16, max_tokens))
        # a verify chunk is a token and 1..max_drafts drafts, padded to one length: a verify of
        # 2 rows costs 0.96 of one of 4 at batch 1 on an H200, and one bucket a request count
        # warms up k times fewer graphs (docs/decisions.md)
        self.verify_buckets = (tuple(range(2, max_drafts + 2)) if varlen else (max_drafts + 1,)) if max_drafts else ()
        self.times = StepTimes(self.device) if varlen else None
        self.scratch = state["slots"]
        self._entries: dict[GraphKey, _Entry] = {}
        self._forwards: dict[tuple, Callable] = {}  # one compiled model part per bucket, shared by its modes
        self._samplers: dict[tuple, Callable] = {}  # one compiled sampler per (mode, k, masked), every bucket
        self._drafters: dict[tuple, Callable] = {}  # one compiled drafter per bucket
        self.gap: tuple | None = None  # the last masked step's timing events around its mask work (CUDA)
        # Every step's inputs live in one device arena: decode at offset 0, prefill after the
        # largest decode region, so a mixed step's inputs reach the device in one copy; verify
        # chunks (speculative decoding) after the largest prefill region.
        self._decode_span = Layout("decode", self.decode_buckets[-1]).size
        biggest = Layout(
            "prefill", self.request_buckets[-1], self.length_buckets[-1], all_rows=True, kept=int(keep is not None)
        ).size
        self._verify_at = self._decode_span + biggest
        verify = Layout("verify", self.request_buckets[-1], self.verify_buckets[-1]).size if max_drafts else 0
        self.arena = torch.zeros(self._verify_at + verify, dtype=torch.long, device=self.device)
        self.vocab_ids = torch.arange(
            self.config.vocab_size, device=self.device
        )  # the sampler's race keys (sampler.sample_mode)
        # structured output's token bitmasks, one row per sampled row (static: graphs capture them)
        words = mask_words(self.config.vocab_size)
        self.masks = {
            "decode": torch.full((self.decode_buckets[-1], words), -1, dtype=torch.int32, device=self.device),
            "prefill": torch.full((self.request_buckets[-1], words), -1, dtype=torch.int32, device=self.device),
        }
        if max_drafts:  # a verify chunk's every row samples (row j: after its first j drafts)
            rows = self.request_buckets[-1] * self.verify_buckets[-1]
            self.masks["verify"] = torch.full((rows, words), -1, dtype=torch.int32, device=self.device)
        # The graphs of one kind share a memory pool, owned here: decode graphs one, prefill
        # graphs another. A graph captured later may place its output in memory an earlier one
        # of its pool uses as scratch, which is safe only while one graph of the pool runs per
        # step: a mixed step replays the decode graph and then the prefill graph before it reads
        # the decode results. Once every graph of a pool is gone (reset, or an engine dropped) the
        # allocator retires the pool, and capturing into its id again fails an internal assert:
        # so fresh pools after each reset.
        self._pools: dict[str, object] = {}
        if compile and self.accelerator == "nvidia" and not register_nvidia_kernels():
            raise RuntimeError("compiled steps on NVIDIA GPUs need Triton (pip install triton), or run with eager=True")
        self.engram: list[Placed] = []  # where each Engram table went (compiled steps)
        if compile:
            self.engram = place_engram_tables(self.params, self.device, engram_tables, engram_budget)
        if any(p.where == "host" for p in self.engram):
            # not a disableable pass: a GPU step cannot read host rows any other way
            self.over.setdefault("engram.gather_rows", engram_rows)
        if self.config.engram_layer_ids:
            cached_engram_layout(self.config)  # built eagerly (numpy); the traced steps read it as a constant
        # one code object serves every bucket; each bucket is a separate compile
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 1024)

    # -- sizes --------------------------------------------------------------------------------
    def _bucket(self, n: int, choices: Sequence[int]) -> int:
        return bucket_for(n, choices) if self.compile else max(n, 1)

    def decode_layout(self, n: int) -> Layout:
        return Layout("decode", self._bucket(n, self.decode_buckets))

    def prefill_layout(self, n_chunks: int, length: int, all_rows: bool = False) -> Layout:
        """Compact prefill replays at most KEEP rows of a chunk, every row of a step with prompt
        logprobs (its other chunks still replay only theirs: ``PrefillChunk.keep_from``)."""
        n, L = self._bucket(n_chunks, self.request_buckets), self._bucket(length, self.length_buckets)
        kept = 0 if self.keep is None else L if all_rows else min(L, self.keep)
        return Layout("prefill", n, L, all_rows, kept)

    def verify_layout(self, n_chunks: int, length: int) -> Layout:
        if not self.verify_buckets:
            raise ValueError("these step graphs were built without verify steps (max_drafts=0)")
        return Layout("verify", self._bucket(n_chunks, self.request_buckets), self._bucket(length, self.verify_buckets))

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
        without the drafter (a rollback's replay). ``masked``: whether the decode
        part and the prefill part run their masked sampler (structured output); ``masks`` then
        returns their host token bitmasks (int32 ``[rows, words]``, pinned on a GPU; the rows in
        order), called once the step's model parts are launched, since it may wait for the
        previous step (``EngineLoop._feed``); only the masked parts' samplers wait for it.
        ``gap`` is then (on CUDA) a pair of timing events around the mask work: a sampler
        that waited for its masks shows as their elapsed time beyond the copy's."""
        parts: list[tuple[_Entry, list[int]]] = []
        if decode or min_requests:
            layout = self.decode_layout(max(len(decode), min_requests))
            parts.append((self._entry(layout, mode, k, masked[0], draft), self._fill_decode(layout, decode)))
        if prefill or min_chunks:
            length = max([len(ch.ids) for ch in prefill] + [min_length, 1])
            layout = self.prefill_layout(max(len(prefill), min_chunks), length, all_rows)
            parts.append((self._entry(layout, mode, k, masked[1], draft), self._fill_prefill(layout, prefill)))
        self._copy_inputs(parts)
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
    ) -> VerifyOut:
        """Launch one verify step (after ``step``'s parts, in its own copy): every chunk's rows
        scored in one target forward, drafts accepted on the device (``spec_accept``), each
        bonus token written to ``next_token[slot]``. Sampling ``mode`` must serve every chunk;
        ``draft`` False: without the drafter (benches); ``k``: every row's top logprobs too;
        ``mask``: host token bitmasks of the rows (``[chunks * layout.length, words]``, structured
        output), run by the masked acceptor."""
        layout = self.verify_layout(len(chunks), max(len(ch.ids) for ch in chunks))
        e = self._entry(layout, mode, k, mask is not None, draft)
        self._copy_inputs([(e, self._fill_verify(layout, chunks))])
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
                fill = {"decode": self._fill_decode, "prefill": self._fill_prefill, "verify": self._fill_verify}[
                    layout.kind
                ](layout, ())
                self._copy_inputs([(e, fill)])
                self._run(e)
            if self.times is not None and layout.kind in ("decode", "verify"):
                for _ in range(2):  # the confidence scheduler's step-time curve (spec_schedule.py)
                    self._run(e)
            if progress is not None:
                progress(e.key.name)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def reset(self) -> None:
        """Forget every compiled and captured graph: a captured graph replays the tensors it was
        captured with, so after an EPLB shuffle (new placement tables, moved expert slots) the
        steps are traced again on their next call."""
        self._entries.clear()
        self._forwards.clear()
        self._samplers.clear()
        self._drafters.clear()
        self._pools.clear()

    # -- inputs -----------------------------------------------------------------------------
    def _fill_decode(self, layout: Layout, rows: Sequence[DecodeRow]) -> list[int]:
        n, pad = len(rows), layout.requests - len(rows)
        model = (
            [r.slot for r in rows] + [self.scratch] * pad + [r.start for r in rows] + [0] * pad + [1] * n + [0] * pad
        )
        sampled = [SampledRow(i, r.slot, r.controls, r.start + 1) for i, r in enumerate(rows)]
        return fill(layout, model, sampled, self.scratch)

    def _fill_prefill(self, layout: Layout, chunks: Sequence[PrefillChunk]) -> list[int]:
        C, L, pad = layout.requests, layout.length, layout.requests - len(chunks)
        tokens: list[int] = []
        for ch in chunks:
            tokens += list(ch.ids)
            tokens += [0] * (L - len(ch.ids))
        tokens += [0] * (L * pad)
        lens = [len(ch.ids) for ch in chunks] + [0] * pad
        if layout.all_rows:
            rows = list(range(C * L))
            at = [c * L + max(n - 1, 0) for c, n in enumerate(lens)]
        else:
            rows = [c * L + max(n - 1, 0) for c, n in enumerate(lens)]
            at = list(range(C))
        model = (
            tokens
            + [ch.slot for ch in chunks]
            + [self.scratch] * pad
            + [ch.start for ch in chunks]
            + [0] * pad
            + lens
            + rows
        )
        if layout.kept:
            model += [ch.keep_from for ch in chunks] + [0] * pad
        sampled = [
            SampledRow(at[c], ch.slot, ch.controls, ch.start + len(ch.ids))
            if ch.controls is not None
            else SampledRow(at[c], self.scratch, GREEDY, 0)
            for c, ch in enumerate(chunks)
        ]
        return fill(layout, model, sampled, self.scratch)

    def _fill_verify(self, layout: Layout, chunks: Sequence[VerifyChunk]) -> list[int]:
        C, L, pad = layout.requests, layout.length, layout.requests - len(chunks)
        tokens: list[int] = []
        for ch in chunks:
            tokens += list(ch.ids) + [0] * (L - len(ch.ids))
        tokens += [0] * (L * pad)
        lens = [len(ch.ids) for ch in chunks] + [0] * pad
        model = (
            tokens + [ch.slot for ch in chunks] + [self.scratch] * pad + [ch.start for ch in chunks] + [0] * pad + lens
        )
        model += list(range(C * L))
        sampled = [SampledRow(0, ch.slot, ch.controls, ch.start) for ch in chunks]
        return fill(layout, model, sampled, self.scratch)

    def _offset(self, kind: str) -> int:
        return {"decode": 0, "prefill": self._decode_span, "verify": self._verify_at}[kind]

    def _copy_inputs(self, parts: Sequence[tuple[_Entry, list[int]]]) -> None:
        """Every part's inputs in one copy: decode at the arena's start, prefill after the decode
        span, verify after the prefill span."""
        if not parts:
            return
        start = self._offset(parts[0][0].layout.kind)
        host: list[int] = []
        for e, values in parts:
            host += [0] * (self._offset(e.layout.kind) - start - len(host))
            host += values
        t = torch.tensor(host, dtype=torch.long)
        if self.device.type != "cpu":
            # a fresh pinned buffer per step: the caching host allocator keeps it alive until the
            # asynchronous copy has run, so the host can fill the next step while this one waits
            t = t.pin_memory()
        self.arena[start : start + t.numel()].copy_(t, non_blocking=True)

    # -- machinery --------------------------------------------------------------------------
    def _run(self, e: _Entry) -> StepOut:
        return self._finish(e, self._start(e))

    def _start(self, e: _Entry) -> Any:
        """Run (replay) the entry's first piece: the whole step, or a masked step's model part."""
        e.calls += 1
        if self.times is not None and e.calls > 1:  # the first call compiles
            e.started = self.times.start()
        out = self._call(e, 0)
        return out if len(e.pieces) > 1 else self._stop(e, out)

    def _finish(self, e: _Entry, first: Any) -> StepOut:
        """The step's results: a masked step's sampler runs over its model part's output here."""
        return first if len(e.pieces) == 1 else self._stop(e, self._call(e, 1, first))

    def _stop(self, e: _Entry, out: StepOut) -> StepOut:
        if e.started is not None:
            self.times.stop((e.layout.kind, e.layout.requests, e.layout.length), e.started)
            e.started = None
        return out

    def _event(self) -> torch.cuda.Event | None:
        """A recorded timing event on the current CUDA stream (None elsewhere)."""
        if self.device.type != "cuda":
            return None
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _call(self, e: _Entry, i: int, *args: Any) -> Any:
        """Piece i of ``e`` (``args``: the previous piece's output). Its first call runs it (and
        compiles it), then captures it: a later piece is captured over the earlier piece's
        static output, so that a replay of both hands the logits on inside the graphs."""
        p = e.pieces[i]
        if p.graph is not None:
            p.graph.replay()
            return p.out
        t0 = time.perf_counter()
        out = p.fn(*args)
        if e.calls == 1:
            e.compile_s += time.perf_counter() - t0
            if self.graphs and not e.key.all_rows and (i == 0 or e.pieces[i - 1].graph is not None):
                t0 = time.perf_counter()
                if e.key.kind not in self._pools:
                    self._pools[e.key.kind] = graph_api(self.device.type).graph_pool_handle()
                graph = DeviceGraph(self.device.type, self._pools[e.key.kind])
                static = () if i == 0 else (e.pieces[i - 1].out,)
                p.out = graph.capture(lambda: p.fn(*static))
                p.graph = graph
                e.capture_s += time.perf_counter() - t0
        return out

    def _entry(self, layout: Layout, mode: str, k: int | None, masked: bool = False, draft: bool = True) -> _Entry:
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
        params, state, next_token = self.params, self.state, self.next_token
        base = self._offset(layout.kind)
        dev = self.arena[base : base + layout.size]
        mask = (
            self.masks[layout.kind][: layout.requests * (layout.length if layout.kind == "verify" else 1)]
            if masked
            else None
        )
        model_in, sampling_in = layout.model_part(dev), layout.sampling_part(dev)
        # eager (compile=False): the same pieces, uncompiled, at the step's exact sizes
        backend = self._backend(key.model_name)
        # kernel swaps are in force whenever the compiled function runs: it is traced on its
        # first call, and Dynamo's guards see the same replacements on every later call
        swaps = {**backend.pipeline.swaps(), **self.over} if backend is not None else {}
        forward = self._forward(layout, backend, streams=bool(n_drafts))
        drafter = self._drafter(layout, n_drafts) if n_drafts else None
        verify = layout.kind == "verify"
        sampler = self._sampler(mode, k, masked, verify=verify)
        extra = () if mask is None else (mask,)
        token_ids, lens = (model_in[: layout.tokens], layout.split_model(model_in)[3]) if verify else (None, None)

        def model_part() -> tuple[torch.Tensor, Any]:
            """(logits, what the drafter reads: None without one)."""
            with swapped(swaps):
                out = forward(params, state, next_token, model_in)
            return out if n_drafts else (out, None)

        def sample_part(fwd: tuple[torch.Tensor, Any]) -> StepOut | VerifyOut:
            logits, X = fwd
            with swapped(swaps):  # the sampler's places too (batch invariance swaps its softmaxes)
                if verify:
                    out = verify_out(
                        sampler(logits, next_token, token_ids, lens, sampling_in, self.vocab_ids, *extra), logits
                    )
                else:
                    out = StepOut(*sampler(logits, next_token, sampling_in, self.vocab_ids, *extra), logits)
                if drafter is None:
                    return out
                drafts, confidence = drafter(params, state, dev, X, out.tokens, out.accepted if verify else None)
            return out._replace(drafts=drafts, confidence=confidence)

        # a masked decode / prefill step in two pieces, so that its masks can be filled while its
        # model part runs; verify masks are known at launch (the drafts), as are every other step's
        split = masked and not verify
        pieces = (_Piece(model_part), _Piece(sample_part)) if split else (_Piece(lambda: sample_part(model_part())),)
        e = _Entry(key, layout, dev, mask, pieces, backend)
        self._entries[key] = e
        return e

    def _compiled(self, fn: Callable, backend: DeepinferBackend | None, dynamic: bool | None = False) -> Callable:
        """``fn`` compiled with ``backend`` (None: eager steps, ``fn`` itself)."""
        return fn if backend is None else compile_graph(fn, backend, dynamic=dynamic)

    def _backend(self, name: str) -> DeepinferBackend | None:
        if not self.compile:
            return None
        return make_backend(self.accelerator, self.disabled, self.dump_dir, name, inductor=self.inductor)

    def _forward(self, layout: Layout, backend: DeepinferBackend | None, streams: bool = False) -> Callable:
        """The model part of ``layout``'s bucket (``streams``: it also returns the final streams)."""
        fkey = (layout.kind, layout.requests, layout.length, layout.all_rows, layout.kept, streams)
        if fkey not in self._forwards:
            c = self.config
            if layout.kind == "decode":

                def forward(params, state, next_token, part):
                    return decode_logits(params, state, c, next_token, *layout.split_model(part), streams=streams)
            else:

                def forward(params, state, next_token, part):
                    return prefill_logits(
                        params, state, c, *layout.split_model(part), kept=layout.kept, streams=streams
                    )

            self._forwards[fkey] = self._compiled(forward, backend)
        return self._forwards[fkey]

    def _drafter(self, layout: Layout, n_drafts: int) -> Callable:
        """The model's drafter after ``layout``'s steps (``steps.propose_drafts``), compiled once per bucket."""
        dkey = (layout.kind, layout.requests, layout.length, layout.kept, n_drafts)
        if dkey not in self._drafters:
            c = self.config
            backend = self._backend(
                graph_name(f"draft-{layout.kind}", t=layout.tokens or layout.requests, r=layout.requests)
                + (f"-kept{layout.kept}" if layout.kept else "")
            )

            def drafter(params, state, buf, X, tokens, accepted):
                return propose_drafts(params, state, c, layout, buf, X, tokens, n_drafts, accepted)

            self._drafters[dkey] = self._compiled(drafter, backend)
        return self._drafters[dkey]

    def _sampler(self, mode: str, k: int | None, masked: bool = False, verify: bool = False) -> Callable:
        """The sampler of ``mode`` (``verify``: the draft acceptor, ``spec_accept.accept_rows``):
        its own small graph, compiled once for every bucket (the row count is dynamic), so a new
        mode costs seconds, not a model compile. ``masked``: the variant that takes a token
        bitmask (structured output) as a last input."""
        skey = (mode, k, masked, verify)
        if skey not in self._samplers:
            name = ("accept-" if verify else "sample-") + mode + (f"-k{k}" if k else "") + ("-masked" if masked else "")
            backend = self._backend(name)
            if verify:

                def sampler(logits, next_token, token_ids, lens, part, vocab_ids, mask=None):
                    return accept_rows(logits, next_token, token_ids, lens, part, mode, vocab_ids, k, mask)
            else:

                def sampler(logits, next_token, part, vocab_ids, mask=None):
                    return sample_rows(logits, next_token, part, mode, k, vocab_ids, mask)

            self._samplers[skey] = self._compiled(sampler, backend, dynamic=None)
        return self._samplers[skey]

    def backend(self, name: str) -> DeepinferBackend:
        """The compile backend of graph ``name`` (a ``GraphKey.name``): its ATen graphs and what
        each pass did (the dry run reads the collectives from them)."""
        return next(e.backend for e in self._entries.values() if e.key.name == name)

    def report(self) -> list[dict]:
        """Start-up cost per graph: compile (first run) and capture seconds, pass rewrites;
        ``model_graph`` names the model part's compile (its dump directory)."""
        return [
            {
                "graph": e.key.name,
                "model_graph": e.key.model_name,
                "compile_s": round(e.compile_s, 3),
                "capture_s": round(e.capture_s, 3),
                "captured": e.captured,
                "pieces": len(e.pieces),
                "calls": e.calls,
                "rewrites": {} if e.backend is None else e.backend.rewrites(),
            }
            for e in self._entries.values()
        ]
