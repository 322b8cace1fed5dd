"""Confidence-scheduled verification (``DEEPINFER_ENABLE_MTP_VARLEN=1``, spec §10): how many of
its drafts each request verifies in the next step.

DSpark's confidence head scores each draft ``c_j``: the chance that draft j is accepted given
that every draft before it was. A request's prefix survival ``a_j = c_1 ... c_j`` is then the
expected number of tokens draft j adds. ``plan_lengths`` admits (request, next draft) pairs in
decreasing ``a`` while the expected tokens of the step times the steps per second improve, and
stops at the first pair that does not improve it; the steps per second come from ``StepTimes``,
the measured time of each step graph shape (timed at warm-up for compiled engines, and on every
step after). A request left with no draft runs a plain decode row.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable, Sequence

import torch

Key = tuple[str, int, int]  # (kind, requests, length) of a step part's graph


class StepTimes:
    """Measured seconds per step part, by graph shape; an exponential average of its runs."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.seconds: dict[Key, float] = {}
        self._pending: list[tuple[Key, object, object]] = []  # CUDA: (key, start, end) events not yet read

    def start(self) -> object:
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, key: Key, started: object) -> None:
        if not self.cuda:
            self.record(key, time.perf_counter() - started)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((key, started, end))

    def record(self, key: Key, seconds: float) -> None:
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else 0.8 * old + 0.2 * seconds

    def _resolve(self) -> None:
        """Read the CUDA timings whose steps are done (never waits for the device)."""
        left = []
        for key, start, end in self._pending:
            if end.query():
                self.record(key, start.elapsed_time(end) / 1e3)
            else:
                left.append((key, start, end))
        self._pending = left

    def estimate(self, key: Key) -> float | None:
        """The measured seconds of ``key``, else the nearest measured shape of its kind (of any
        kind, while its own has none: every part is a forward over rows) scaled by rows. None:
        nothing measured yet."""
        self._resolve()
        if key in self.seconds:
            return self.seconds[key]
        kind, n, length = key
        same = [k for k in self.seconds if k[0] == kind] or list(self.seconds)
        if not same:
            return None
        near = min(same, key=lambda k: abs(k[1] * k[2] - n * length))
        return self.seconds[near] * (n * length) / (near[1] * near[2])


def survival(confidences: Sequence[float]) -> list[float]:
    """Prefix survival ``a_j = c_1 ... c_j`` of one request's drafts."""
    out, a = [], 1.0
    for c in confidences:
        a *= float(c)
        out.append(a)
    return out


def plan_lengths(confidences: Sequence[Sequence[float]], step_time: Callable[[list[int]], float | None]) -> list[int]:
    """Drafts to verify per request: ``confidences[r]`` scores request r's drafts (as many as it
    may verify); ``step_time(lengths)`` estimates the step's seconds for per-request lengths
    (0: a plain decode row), None when it cannot tell (then every draft is verified: fixed nextn).
    Greedy, as spec §10: pairs (r, j) join in decreasing ``a_{r,j}`` while expected tokens / step
    time grows. A step of decode rows and verify chunks runs two graphs, so the first draft of
    the first verifying request costs a whole part: the greedy runs from every request at 0
    drafts and again from every request at 1, and the better plan wins."""
    full = [len(c) for c in confidences]
    if step_time([0] * len(full)) is None or step_time(full) is None:
        return full
    gains = [survival(c) for c in confidences]
    plans = [
        _greedy(gains, full, [0] * len(full), step_time),
        _greedy(gains, full, [min(1, n) for n in full], step_time),
    ]
    return max(plans, key=lambda p: p[1])[0]


def _greedy(
    gains: list[list[float]], full: list[int], lengths: list[int], step_time: Callable[[list[int]], float | None]
):
    """(lengths, expected tokens per second) of the greedy from ``lengths`` on."""
    tokens = len(full) + sum(sum(g[:n]) for g, n in zip(gains, lengths))
    best = tokens / step_time(lengths)
    heap = [(-g[n], r) for r, (g, n) in enumerate(zip(gains, lengths)) if n < len(g)]
    heapq.heapify(heap)
    while heap:
        neg, r = heapq.heappop(heap)
        lengths[r] += 1
        rate = (tokens - neg) / step_time(lengths)
        if rate <= best:
            lengths[r] -= 1
            break
        tokens, best = tokens - neg, rate
        if lengths[r] < full[r]:
            heapq.heappush(heap, (-gains[r][lengths[r]], r))
    return lengths, best
