"""Compiled steps with static buffers per bucket, and graph capture/replay of every step.

A graph key is (kind, token bucket, request bucket). Each key owns static input buffers, one
compiled function (``passes.compiler``: the accelerator's pass pipeline, dumps, cache key) and,
on a device with graphs, one captured graph whose memory comes from a pool shared by the
graphs of its kind (decode, prefill). Decode and prefill alike are captured, except prefill
keys that return every row's logits (prompt logprobs), whose ``[tokens, vocab]`` fp32 output a
graph would hold for good (2 GiB at 4096 tokens of a 129k vocabulary). Prefill gains from graphs as decode does: uncaptured, a
4096-token P8 prefill (~650 launches) ran 3.9 ms longer than its kernels on an H200 (55.2 vs
51.3 ms). A step pads its inputs up to the nearest bucket, copies them into the key's buffers
in one host->device copy and replays; the first step of a key runs the compiled function (which
compiles it: that run is the warm-up) and captures the graph right after.

``GraphWrapper`` is what a device's graph API must provide; ``DeviceGraph`` serves CUDA graphs
on NVIDIA and ACL graphs on Ascend (torch_npu is imported only there).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

import torch

from ..api import Model
from ..graphs.engram import EngramTable
from ..graphs.model import cached_engram_layout
from ..graphs.swap import swapped
from ..kernels.triton import register_nvidia_kernels
from ..passes.compiler import DeepinferBackend, compile_graph, make_backend
from ..passes.dump import graph_name
from .steps import decode_step, prefill_step

# Engram tables are memory-mapped on the host in eager runs; a compiled step needs them resident.
MAX_RESIDENT_ENGRAM_BYTES = 2 << 30


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
    kind: str  # "decode" or "prefill"
    tokens: int  # packed tokens of the step
    requests: int  # chunks (requests) of the step
    all_rows: bool = False  # prefill: logits for every row (prompt logprobs), not just the last

    @property
    def name(self) -> str:
        return graph_name(self.kind, t=self.tokens, r=self.requests) + ("-all" if self.all_rows else "")


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


@dataclass
class _Entry:
    key: GraphKey
    dev: torch.Tensor  # the static int64 device buffer the graph reads (all of a step's inputs)
    fn: Callable[[], torch.Tensor]
    backend: DeepinferBackend
    graph: GraphWrapper | None = None
    out: torch.Tensor | None = None
    compile_s: float = 0.0
    capture_s: float = 0.0
    calls: int = field(default=0)


class StepGraphs:
    """Compiled decode / prefill steps over a model and a state pool."""

    def __init__(
        self, model: Model, state: dict, next_token: torch.Tensor, *, max_requests: int, max_tokens: int,
        accelerator: str | None = None, graphs: bool | None = None, inductor: bool = False,
        dump_dir: str | None = None, disabled: Sequence[str] = (),
    ) -> None:
        self.config, self.params = model
        self.state = state
        self.next_token = next_token
        self.device = model.device
        self.accelerator = accelerator or {"cuda": "nvidia", "npu": "ascend"}.get(self.device.type, "cpu")
        has_graphs = self.device.type in GRAPH_DEVICES
        if graphs and not has_graphs:
            raise ValueError(f"graph capture needs a CUDA or Ascend device; this model is on {self.device}")
        self.graphs = has_graphs and graphs is not False
        self.inductor, self.dump_dir, self.disabled = inductor, dump_dir, tuple(disabled)
        self.decode_buckets = buckets(max_requests)
        self.request_buckets = buckets(max_requests)
        self.length_buckets = buckets(max_tokens, smallest=min(16, max_tokens))
        self.scratch = state["slots"]
        self._entries: dict[GraphKey, _Entry] = {}
        # The graphs of one kind share a memory pool, owned here: decode graphs one, prefill
        # graphs another. A graph captured later may place its output in memory an earlier one
        # of its pool uses as scratch, which is safe only while one graph of the pool runs per
        # step: a mixed step replays the decode graph and then the prefill graph before it reads
        # the decode logits. Once every graph of a pool is gone (reset, or an engine dropped) the
        # allocator retires the pool, and capturing into its id again fails an internal assert:
        # so fresh pools after each reset.
        self._pools: dict[str, object] = {}
        if self.accelerator == "nvidia" and not register_nvidia_kernels():
            raise RuntimeError("compiled steps on NVIDIA GPUs need Triton (pip install triton), or run with eager=True")
        _make_engram_resident(self.params, self.device)
        if self.config.engram_layer_ids:
            cached_engram_layout(self.config)  # built eagerly (numpy); the traced steps read it as a constant
        # one code object serves every bucket; each bucket is a separate compile
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 256)
        torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 1024)

    # -- steps ------------------------------------------------------------------------------
    def decode(self, slots: Sequence[int], starts: Sequence[int], min_requests: int = 0) -> torch.Tensor:
        """Logits ``[len(slots), vocab]``: one token per request, read from ``next_token[slot]``.
        ``min_requests``: run a bucket for at least that many (padded), as multi-rank turns agree."""
        n = len(slots)
        b = bucket_for(max(n, min_requests), self.decode_buckets)
        e = self._entry(GraphKey("decode", b, b))
        pad = b - n
        host = torch.tensor([*slots, *[self.scratch] * pad, *starts, *[0] * pad, *[1] * n, *[0] * pad])
        return self._run(e, host)[:n]

    def prefill(
        self, chunks: Sequence[tuple[int, int, Sequence[int]]], all_rows: bool = False, min_chunks: int = 0, min_length: int = 0
    ) -> tuple[torch.Tensor, list[int]]:
        """``chunks``: (slot, start, token ids). Returns logits and, per chunk, the row of its
        first logit: with ``all_rows`` a chunk of n tokens owns rows ``r .. r+n-1``, otherwise
        only its last token's row ``r``. ``min_chunks`` / ``min_length``: run a bucket for at
        least that many chunks of that length (padded), as multi-rank turns agree."""
        c_bucket = bucket_for(max(len(chunks), min_chunks), self.request_buckets)
        length = bucket_for(max([len(ids) for _, _, ids in chunks] + [min_length]), self.length_buckets)
        key = GraphKey("prefill", c_bucket * length, c_bucket, all_rows)
        e = self._entry(key)
        tokens = torch.zeros(c_bucket, length, dtype=torch.long)
        meta = torch.tensor([[self.scratch, 0, 0]] * c_bucket, dtype=torch.long)
        for i, (slot, start, ids) in enumerate(chunks):
            tokens[i, : len(ids)] = torch.as_tensor(list(ids), dtype=torch.long)
            meta[i] = torch.tensor([slot, start, len(ids)])
        lens = meta[:, 2]
        if all_rows:
            rows = torch.arange(c_bucket * length)
            first = [i * length for i in range(len(chunks))]
        else:
            rows = torch.arange(c_bucket) * length + (lens - 1).clamp(min=0)
            first = list(range(len(chunks)))
        return self._run(e, torch.cat([tokens.reshape(-1), meta.T.reshape(-1), rows])), first

    def reset(self) -> None:
        """Forget every compiled and captured graph: a captured graph replays the tensors it was
        captured with, so after an EPLB shuffle (new placement tables, moved expert slots) the
        steps are traced again on their next call."""
        self._entries.clear()
        self._pools.clear()

    # -- machinery --------------------------------------------------------------------------
    def _run(self, e: _Entry, host: torch.Tensor) -> torch.Tensor:
        # a fresh pinned buffer per step: the caching host allocator keeps it alive until the
        # asynchronous copy has run, so the host can fill the next step while this one waits
        if self.device.type != "cpu":
            host = host.pin_memory()
        e.dev.copy_(host, non_blocking=True)
        e.calls += 1
        if e.graph is not None:
            e.graph.replay()
            return e.out
        t0 = time.perf_counter()
        out = e.fn()
        if e.calls == 1:
            e.compile_s = time.perf_counter() - t0
            if self.graphs and not e.key.all_rows:
                t0 = time.perf_counter()
                if e.key.kind not in self._pools:
                    self._pools[e.key.kind] = graph_api(self.device.type).graph_pool_handle()
                graph = DeviceGraph(self.device.type, self._pools[e.key.kind])
                e.out = graph.capture(e.fn)
                e.graph = graph
                e.capture_s = time.perf_counter() - t0
        return out

    def _entry(self, key: GraphKey) -> _Entry:
        if key in self._entries:
            return self._entries[key]
        c, params, state = self.config, self.params, self.state
        if key.kind == "decode":
            size = 3 * key.requests
        else:
            size = key.tokens + 3 * key.requests + (key.tokens if key.all_rows else key.requests)
        dev = torch.zeros(size, dtype=torch.long, device=self.device)
        backend = make_backend(self.accelerator, self.disabled, self.dump_dir, key.name, inductor=self.inductor)
        # kernel swaps are in force whenever the compiled function runs: it is traced on its
        # first call, and Dynamo's guards see the same replacements on every later call
        swaps = backend.pipeline.swaps()
        r = key.requests
        if key.kind == "decode":
            def step(params, state, next_token, meta):
                slots, starts, lens = meta.view(3, -1).unbind(0)
                return decode_step(params, state, c, next_token, slots, starts, lens)

            compiled = compile_graph(step, backend)

            def fn() -> torch.Tensor:
                with swapped(swaps):
                    return compiled(params, state, self.next_token, dev)
        else:
            t = key.tokens

            def step(params, state, buf):
                slots, starts, lens = buf[t : t + 3 * r].view(3, r).unbind(0)
                return prefill_step(params, state, c, buf[:t], slots, starts, lens, buf[t + 3 * r :])

            compiled = compile_graph(step, backend)

            def fn() -> torch.Tensor:
                with swapped(swaps):
                    return compiled(params, state, dev)
        e = _Entry(key, dev, fn, backend)
        self._entries[key] = e
        return e

    def backend(self, name: str) -> DeepinferBackend:
        """The compile backend of graph ``name`` (a ``GraphKey.name``): its ATen graphs and what
        each pass did (the dry run reads the collectives from them)."""
        return next(e.backend for e in self._entries.values() if e.key.name == name)

    def report(self) -> list[dict]:
        """Start-up cost per graph: compile (first run) and capture seconds, pass rewrites."""
        return [
            {"graph": e.key.name, "compile_s": round(e.compile_s, 3), "capture_s": round(e.capture_s, 3),
             "captured": e.graph is not None, "calls": e.calls, "rewrites": e.backend.rewrites()}
            for e in self._entries.values()
        ]


def _make_engram_resident(params: dict, device: torch.device) -> None:
    """Swap memory-mapped Engram tables for device-resident ones (a compiled step cannot read a
    host memory map), refusing tables too large to hold."""
    for lp in params.get("layers", []):
        table = lp.get("engram", {}).get("embed")
        if isinstance(table, EngramTable) and not table.is_dense:
            nbytes = table.num_rows * table.head_dim * 4
            if nbytes > MAX_RESIDENT_ENGRAM_BYTES:
                raise ValueError(
                    f"compiled steps keep Engram tables on the device; {table.name} needs {nbytes / 2**30:.1f} GiB "
                    "as float32. Run with eager=True (tables stay memory-mapped on the host)."
                )
            lp["engram"]["embed"] = table.resident(device)
