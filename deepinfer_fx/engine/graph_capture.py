"""Graph keys and the capture and replay of their pieces: a key's entry, the device graph API
(``DeviceGraph``: CUDA graphs on NVIDIA, ACL graphs on Ascend, torch_npu imported only there) and
``GraphEntries``, which captures each piece right after its first (compiling) call, into a memory
pool shared by the graphs of a kind, and times and reports the entries.

A key runs as one piece (the whole step) or, a masked decode / prefill step (structured output),
two: its model part, then its sampler, captured after the model part's graph over that graph's
static output, so a replay of both hands the logits on inside the graphs and the sampler graph
never takes the memory of the logits it reads. The model part is launched first, then the host
fills the masks (its matchers may first need the previous step's tokens) and copies them, then
the sampler runs; so the filling hides behind the forward. Every other step runs the unmasked
sampler inside its one graph. ``compile=False`` runs the same pieces uncompiled.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import torch

from ..passes.compiler import DeepinferBackend
from ..passes.dump import graph_name
from .spec_schedule import StepTimes
from .step_inputs import Layout
from .steps import StepOut


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


@dataclass
class Piece:
    """One captured unit of a step: the whole step, or (a masked step) its model part or its
    sampler, which takes the model part's output (``(logits, what the drafter reads)``)."""

    fn: Callable[..., Any]
    graph: GraphWrapper | None = None
    out: Any = None  # the captured graph's static output


@dataclass
class Entry:
    key: GraphKey
    layout: Layout
    dev: torch.Tensor  # the key's region of the device arena: every input of its steps
    mask: torch.Tensor | None  # masked keys: the token bitmask rows of its sampled rows
    pieces: tuple[Piece, ...]  # the whole step; masked decode / prefill keys: model part, then sampler
    backend: DeepinferBackend | None
    compile_s: float = 0.0
    capture_s: float = 0.0
    calls: int = field(default=0)
    started: object = None  # StepTimes.start() of the call in flight (varlen speculation)

    @property
    def captured(self) -> bool:
        return all(p.graph is not None for p in self.pieces)


class GraphEntries:
    """The entries of a step table by key, and the running of their pieces: a replay once
    captured, a run (and, with ``graphs``, a capture right after) on an entry's first call, every
    call timed per step shape with ``times`` (varlen speculation). Graph memory comes from one pool
    per kind, owned here: decode graphs one, prefill graphs another.

    A graph captured later may place its output in memory an earlier one of its pool uses as
    scratch, which is safe only while one graph of the pool runs per step: a mixed step replays the
    decode graph and then the prefill graph before it reads the decode results. Once every graph of
    a pool is gone (reset, or an engine dropped) the allocator retires the pool, and capturing into
    its id again fails an internal assert: so fresh pools after each reset (``_forget``)."""

    def __init__(
        self, device: torch.device, graphs: bool, times: StepTimes | None, uncaptured: Sequence[str] = ()
    ) -> None:
        self.device = device
        self.graphs = graphs
        self.uncaptured = frozenset(uncaptured)  # step kinds run compiled but never captured
        self.times = times
        self._entries: dict[GraphKey, Entry] = {}
        self._pools: dict[str, object] = {}

    def _forget(self) -> None:
        """Drop every entry and graph pool."""
        self._entries.clear()
        self._pools.clear()

    def _run(self, e: Entry) -> StepOut:
        return self._finish(e, self._start(e))

    def _start(self, e: Entry) -> Any:
        """Run (replay) the entry's first piece: the whole step, or a masked step's model part."""
        e.calls += 1
        if self.times is not None and e.calls > 1:  # the first call compiles
            e.started = self.times.start()
        out = self._call(e, 0)
        return out if len(e.pieces) > 1 else self._stop(e, out)

    def _finish(self, e: Entry, first: Any) -> StepOut:
        """The step's results: a masked step's sampler runs over its model part's output here."""
        return first if len(e.pieces) == 1 else self._stop(e, self._call(e, 1, first))

    def _stop(self, e: Entry, out: StepOut) -> StepOut:
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

    def _call(self, e: Entry, i: int, *args: Any) -> Any:
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
            capturable = not e.key.all_rows and e.key.kind not in self.uncaptured
            if self.graphs and capturable and (i == 0 or e.pieces[i - 1].graph is not None):
                t0 = time.perf_counter()
                if e.key.kind not in self._pools:
                    self._pools[e.key.kind] = graph_api(self.device.type).graph_pool_handle()
                graph = DeviceGraph(self.device.type, self._pools[e.key.kind])
                static = () if i == 0 else (e.pieces[i - 1].out,)
                p.out = graph.capture(lambda: p.fn(*static))
                p.graph = graph
                e.capture_s += time.perf_counter() - t0
        return out

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
