"""Step timing for ``bench/mesh.py``: one engine's decode and prefill forwards, timed in lock
step over the ranks of a mesh (or alone on one device), and the time spent in the EP all-to-all.

What a step is. With compiled steps (GPUs by default) the engine's own decode / prefill graphs
(``StepGraphs``; traced again per row, with the row's EP group); eagerly as follows.
Decode: ``engine.steps.decode_logits`` of ``B`` requests at position ``context``
(slots ``0..B-1``); a decode at a fixed position rewrites the same cache rows, so it repeats
(as in ``bench/decode_graphs.py``), and the cache's contents do not change the work. Prefill:
one chunk of ``T`` tokens at position 0 of slot 0, cut by the engine's own eager CP split
(``runner.split``) on a cp mesh, logits of its last row only, from the rank owning it (what the
compiled prefill step computes; the eager runner's all-row fp32 logits would add a vocab-sized
GEMM per row). The batch is built once, so host-side batch building and sampling are outside the
timed steps.

EP capacity. The engine sizes an EP group's static send buffers from the scheduler's token
budget, so each row uses a group sized as an engine configured for that row would be
(``max_num_batched_tokens`` = B or T) under the current expert placement, instead of the LLM's
own group (sized for its correctness run): rows then see the all-to-all bytes such a run sends.

All-to-all time. The torch profiler runs over a few steps after the timing window on every rank:
on CUDA the NCCL kernels of the exchanges (``SendRecv``/``AllToAll``), device time, which includes
waiting for the slowest peer; on the CPU the ``gloo:all_to_all`` work events. ``ep.py`` has no
timing hook, and events around a collective would time the same thing less exactly.
"""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from ..engine.llm import LLM
from ..engine.steps import decode_logits
from ..graphs.batch import make_batch
from ..graphs.model import forward_batch
from ..graphs.swap import swapped
from ..sharding.ep import EPGroup, ep_group
from ..sharding.parallel import ep_swaps
from ..sharding.world import moe_view


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def row_swaps(llm: LLM, max_tokens: int) -> tuple[dict[str, Callable], EPGroup | None]:
    """The LLM's swaps with its EP group re-made for a ``max_tokens`` budget (same placement,
    same process group, fresh counters); on one rank the LLM's own (none)."""
    ep = llm.ranks.ep
    if ep is None:
        return dict(llm.runner.swaps), None
    c = llm.model.config
    group = ep_group(
        ep.placement,
        max_tokens,
        c.num_experts_per_tok,
        moe_view(llm.ranks.world),
        device=llm.model.device,
        capacity_factor=llm.settings.ep_capacity_factor,
    )
    return {**llm.runner.swaps, **ep_swaps(group)}, group


def decode_fn(llm: LLM, batch: int, context: int) -> Callable[[], torch.Tensor]:
    if llm.options.steps.compiled:  # the engine's compiled decode graph (captured on GPUs)
        return lambda: llm.runner.steps.decode(list(range(batch)), [context] * batch)
    c, params = llm.model
    dev = llm.model.device
    slots = torch.arange(batch, device=dev)
    starts = torch.full((batch,), context, dtype=torch.long, device=dev)
    lens = torch.ones(batch, dtype=torch.long, device=dev)
    return lambda: decode_logits(params, llm.pool.state, c, llm.runner.next_token, slots, starts, lens)


def prefill_fn(llm: LLM, tokens: int, seed: int) -> Callable[[], torch.Tensor]:
    c, params = llm.model
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, c.vocab_size, (tokens,), generator=gen)
    if llm.options.steps.compiled:  # the engine's compiled prefill graph: logits of the last row
        return lambda: llm.runner.steps.prefill([(0, 0, ids.tolist())])[0]
    batch = make_batch([ids], [0], [0], llm.model.device)
    if llm.runner.split is not None:
        batch = llm.runner.split(batch)
    rows = torch.tensor([tokens - 1], device=llm.model.device)  # a row of the whole chunk (forward_batch)
    return lambda: forward_batch(params, llm.pool.state, c, batch, rows=rows)[0]


def seconds_per_step(
    fn: Callable[[], object], steps: int, warmup: int, device: torch.device, host: dist.ProcessGroup | None
) -> float:
    """Wall seconds per step, ranks released together (host barrier) and the slowest rank's
    time taken (a collective step ends when its last rank does)."""
    for _ in range(warmup):
        fn()
    sync(device)
    if host is not None:
        dist.barrier(group=host)
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    sync(device)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    if host is not None:
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=host)
    return float(elapsed) / steps


def _is_all_to_all(ev, cuda: bool) -> bool:
    if cuda:
        return ev.device_type == torch.autograd.DeviceType.CUDA and ("SendRecv" in ev.name or "AllToAll" in ev.name)
    return ev.name == "gloo:all_to_all"


def all_to_all_per_step(fn: Callable[[], object], steps: int, device: torch.device) -> tuple[float, float, float]:
    """(seconds, calls) of EP all-to-all per step on this rank, from the profiler, and the wall
    seconds per profiled step (the profiler slows steps down: shares are taken of these)."""
    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        sync(device)
        wall = time.perf_counter() - t0
    events = [ev for ev in prof.events() if _is_all_to_all(ev, cuda)]
    us = sum(ev.device_time_total if cuda else ev.cpu_time_total for ev in events)
    return us / 1e6 / steps, len(events) / steps, wall / steps


def measure(
    llm: LLM,
    kind: str,
    size: int,
    *,
    context: int,
    steps: int,
    warmup: int,
    profile_steps: int,
    seed: int,
    host: dist.ProcessGroup | None,
) -> dict:
    """One row on this LLM (every rank of its mesh calls it; ``host`` None: one process):
    ``kind`` "decode" (``size`` requests per serving rank) or "prefill" (a ``size``-token chunk
    per serving group). Per GPU: the mesh serves ``dp * ep`` such units on ``dp * cp * ep`` GPUs
    (a CP group shares one)."""
    spec, dev = llm.ranks.spec, llm.model.device
    swaps, group = row_swaps(llm, size)
    compiled = llm.options.steps.compiled
    engine_prefill = dict(llm.runner.steps.prefill_over)
    if compiled and group is not None:  # graphs captured with another EP group would replay it
        llm.runner.steps.reset(ep_swaps(group, ragged_traced=True) if group.size > 1 else {})  # as the engine's
    with torch.no_grad(), swapped(swaps):
        fn = decode_fn(llm, size, context) if kind == "decode" else prefill_fn(llm, size, seed)
        step_s = seconds_per_step(fn, steps, warmup, dev, host)
        row = {
            "step_ms": round(step_s * 1e3, 3),
            "tok_s_per_gpu": round(size * spec.dp * spec.ep / spec.world_size / step_s, 1),
        }
        if group is not None:
            # eager steps and compiled prefill send the routed pairs only (sharding/ep_ragged.py)
            row.update(ep_columns(llm, group, fn, profile_steps, host, not compiled or kind == "prefill"))
    if compiled and group is not None:
        llm.runner.steps.reset(engine_prefill)
    return row


def ep_columns(
    llm: LLM, group: EPGroup, fn: Callable[[], object], profile_steps: int, host: dist.ProcessGroup, ragged: bool
) -> dict:
    """A mesh row's EP side: all-to-all time per MoE layer (mean and max over the ranks), its
    largest share of a profiled step, calls per layer, the rows sent per call (``ragged``: the
    routed pairs counted, else the capacity) and the bytes they imply, and the pairs dropped over
    capacity (none at the default worst-case capacity)."""
    a2a_s = calls = share = 0.0
    sent_before = list(group.ragged_sent)
    if group.size > 1:  # ep1 exchanges nothing
        a2a_s, calls, profiled_s = all_to_all_per_step(fn, profile_steps, llm.model.device)
        share = a2a_s / profiled_s
    if group.size == 1:
        rows = 0.0
    elif ragged:  # rows per call over the profiled steps
        rows = (group.ragged_sent[0] - sent_before[0]) / max(1, group.ragged_sent[1] - sent_before[1])
    else:
        rows = float(group.size * group.capacity)
    per_rank: list = [None] * dist.get_world_size(host)
    dist.all_gather_object(per_rank, (a2a_s, calls, share, int(group.overflow)), group=host)
    c, elem = llm.model.config, llm.model.dtype.itemsize
    layers = c.num_hidden_layers
    return {
        "a2a_ms_per_layer_mean": round(sum(r[0] for r in per_rank) / len(per_rank) * 1e3 / layers, 4),
        "a2a_ms_per_layer_max": round(max(r[0] for r in per_rank) * 1e3 / layers, 4),
        "a2a_share_of_profiled_step_max": round(max(r[2] for r in per_rank), 4),
        "a2a_calls_per_layer": round(calls / layers, 2),
        "ep_dispatch": "ragged" if ragged else "static",
        "ep_capacity": group.capacity,
        "capacity_factor": llm.settings.ep_capacity_factor,
        # rows sent: the static capacity to every rank, or what the ragged path counted over the
        # profiled steps; each row is its token (run dtype) + slot/weight (2 x int32) + fp32 results back
        "a2a_bytes_sent_per_layer_per_rank": round(rows * (c.hidden_size * elem + 8 + c.hidden_size * 4)),
        "dropped_pairs": sum(r[3] for r in per_rank),
    }
