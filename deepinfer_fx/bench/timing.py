"""Timing helpers the benchmarks share: wall time of a GPU call and a per-kernel profile."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Sequence
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def timed(fn: Callable[[], object], iters: int, warmup: int = 1) -> float:
    """Mean wall seconds per call over ``iters`` calls, the device drained before and after."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / iters


def kernel_table(fn: Callable[[], object], steps: int) -> tuple[list[dict], float, int]:
    """Run ``fn`` ``steps`` times under the profiler; per kernel name: us per step, launches
    per step and share of the step. Also the summed kernel time and kernel count of one step."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            total[ev.name] += ev.device_time_total
            count[ev.name] += 1
    step_us = sum(total.values()) / steps
    rows = sorted(
        (
            {
                "kernel": k[:120],
                "us": round(v / steps, 2),
                "launches": count[k] // steps,
                "share": round(v / steps / step_us, 4),
            }
            for k, v in total.items()
        ),
        key=lambda r: -r["us"],
    )
    return rows, step_us, sum(count.values()) // steps


def advances(spans: Sequence[tuple[str, float, float]]) -> list[dict]:
    """Kernel spans ``(name, start, end)`` of one step -> in start order, each kernel's *advance*
    (how far its end pushes the timeline past the end of every kernel before it) and the idle
    *gap* before it starts. Advances and gaps add up to the step's span exactly, where durations
    do not: with PDL a kernel starts before its predecessor ends and waits on it, so its
    duration counts its wait too."""
    rows: list[dict] = []
    frontier = None
    for name, start, end in sorted(spans, key=lambda s: s[1]):
        gap = 0.0 if frontier is None else max(0.0, start - frontier)
        advance = end - start if frontier is None else max(0.0, end - max(frontier, start))
        frontier = end if frontier is None else max(frontier, end)
        rows.append({"kernel": name[:120], "start": start, "us": end - start, "advance": advance, "gap": gap})
    return rows


def kernel_timeline(fn: Callable[[], object], steps: int) -> tuple[list[dict], list[dict]]:
    """Profile ``steps`` calls of ``fn``, one at a time; per kernel name: advance and gap in us per
    step (``advances``) and launches, by advance; and the ordered kernels of the last call, start
    times from its first kernel."""
    fn()
    torch.cuda.synchronize()
    adv: dict[str, float] = defaultdict(float)
    gap: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    rows: list[dict] = []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        spans = [
            (ev.name, ev.time_range.start, ev.time_range.end)
            for ev in prof.events()
            if ev.device_type == torch.autograd.DeviceType.CUDA
        ]
        rows = advances(spans)
        for r in rows:
            adv[r["kernel"]] += r["advance"]
            gap[r["kernel"]] += r["gap"]
            count[r["kernel"]] += 1
    table = sorted(
        (
            {
                "kernel": k,
                "advance_us": round(adv[k] / steps, 2),
                "gap_us": round(gap[k] / steps, 2),
                "launches": count[k] // steps,
            }
            for k in adv
        ),
        key=lambda r: -r["advance_us"] - r["gap_us"],
    )
    t0 = rows[0]["start"] if rows else 0.0
    ordered = [
        {
            "kernel": r["kernel"][:80],
            "start": round(r["start"] - t0, 2),
            "us": round(r["us"], 2),
            "advance": round(r["advance"], 2),
            "gap": round(r["gap"], 2),
        }
        for r in rows
    ]
    return table, ordered


def step_spans(spans: Sequence[tuple[str, float, float]]) -> dict:
    """Kernel and copy spans ``(name, start, end)`` of back-to-back steps, each begun by one
    host-to-device copy -> the steps' mean span (first kernel's start to last kernel's end) and
    the mean and largest time from one step's last kernel to the next step's first (the copy and
    the graph launch, which a one-step timeline cannot see)."""
    groups: list[list[tuple[float, float]]] = []
    for name, start, end in sorted(spans, key=lambda s: s[1]):
        if name.startswith("Memcpy HtoD") or not groups:
            groups.append([])
        if not name.startswith("Memcpy"):
            groups[-1].append((start, end))
    groups = [g for g in groups if g]
    span = [max(e for _, e in g) - g[0][0] for g in groups]
    between = [b[0][0] - max(e for _, e in a) for a, b in zip(groups, groups[1:])]
    return {
        "steps": len(groups),
        "span_us": round(sum(span) / max(len(span), 1), 2),
        "between_us": round(sum(between) / max(len(between), 1), 2),
        "between_max_us": round(max(between, default=0.0), 2),
    }


def between_steps(fn: Callable[[], object], steps: int) -> dict:
    """``step_spans`` of ``steps`` calls of ``fn`` run back to back (no sync between them) under
    the profiler, and the host's time per call while the device is busy (the profiler's own
    cost included)."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        host_s = (time.perf_counter() - t0) / steps
        torch.cuda.synchronize()
    spans = [
        (ev.name, ev.time_range.start, ev.time_range.end)
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
    ]
    return {**step_spans(spans), "host_us_per_call": round(host_s * 1e6, 1)}


def graph_ms(fn: Callable[[], object], iters: int) -> float:
    """Mean ms per replay of ``fn`` captured in a CUDA graph (after an eager warm-up call that
    compiles the kernels)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters
