"""Per-kernel breakdown of one replayed P8 decode step (where the milliseconds go).

    python -m deepinfer_fx.bench.profile_step --batches 1,64 --context 512

Captures the decode graph of each batch (as ``decode_graphs`` does), then records a few replays
under ``torch.profiler`` and prints, per kernel name, the total device time per step, the
number of launches per step and the share of the step. Writes the table as JSON.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from ..api import random_model
from ..engine.graph_runner import StepGraphs
from ..graphs.state import init_state
from .p8 import p8_config, run_info, write_result


def kernel_table(fn, steps: int) -> tuple[list[dict], float, int]:
    """Run ``fn`` ``steps`` times under the profiler; per kernel name: us per step, launches
    per step. Also the summed kernel time and the kernel count of one step."""
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
            total[ev.name] += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
            count[ev.name] += 1
    step_us = sum(total.values()) / steps
    rows = sorted(
        ({"kernel": k[:120], "us": round(v / steps, 2), "launches": count[k] // steps, "share": round(v / steps / step_us, 4)}
         for k, v in total.items()),
        key=lambda r: -r["us"],
    )
    return rows, step_us, sum(count.values()) // steps


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    c = p8_config(num_hidden_layers=args.layers, compress_ratios=[0, 0, 4, 128, 4, 128, 4, 128][: args.layers])
    model = random_model(c, seed=0, dtype=torch.bfloat16, device="cuda")
    slots = max(batches)
    state = init_state(c, args.context + 64, torch.bfloat16, "cuda", mtp=False, slots=slots)
    next_token = torch.randint(3, c.vocab_size, (slots + 1,), device="cuda")
    graphs = StepGraphs(model, state, next_token, max_requests=slots, max_tokens=16, graphs=True, inductor=not args.no_inductor)
    out = []
    for b in batches:
        sl, starts = list(range(b)), [args.context] * b
        graphs.decode(sl, starts)
        rows, step_us, launches = kernel_table(lambda: graphs.decode(sl, starts), args.steps)
        print(f"\n== batch {b}: {step_us / 1e3:.3f} ms of kernels per step, {launches} launches", flush=True)
        for r in rows[: args.top]:
            print(f"{r['us']:9.1f} us {r['launches']:5d}x {100 * r['share']:5.1f}%  {r['kernel']}")
        out.append({"batch": b, "kernel_ms": round(step_us / 1e3, 3), "launches": launches, "kernels": rows})
    result = {**run_info(argv), "model": f"P8 ({args.layers} layers), bf16, random weights", "rows": out}
    write_result("profile_step_p8", result, args.out)
    return result


if __name__ == "__main__":
    main()
