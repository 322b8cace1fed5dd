"""Timing helpers the benchmarks share: wall time of a GPU call and a per-kernel profile."""

from __future__ import annotations

import time
from collections import defaultdict
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
        ({"kernel": k[:120], "us": round(v / steps, 2), "launches": count[k] // steps, "share": round(v / steps / step_us, 4)}
         for k, v in total.items()),
        key=lambda r: -r["us"],
    )
    return rows, step_us, sum(count.values()) // steps


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
