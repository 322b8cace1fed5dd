"""A captured P8 prefill step timed alone after idle and back to back, with the GPU's clocks.

    python -m deepinfer_fx.bench.prefill_power --tokens 4096 --replays 40

A 4096-token P8 prefill keeps the H200's tensor cores busy for ~50 ms; run back to back it
reaches the 700 W power cap and the SM clock falls from 1980 MHz to ~1600, and a step takes
~10 % longer than one started from idle. The wall time of ``p8_vs_hf`` is the sustained one
(what a stream of prefills gets); this bench reports both, each replay timed with CUDA events
(back to back: the host waits for each replay's end event, ~0.2 ms, before launching the next),
next to ``nvidia-smi``'s samples of clock and power taken during the run.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

import torch

from ..api import random_model
from ..engine.graph_runner import StepGraphs
from ..graphs.state import init_state
from .p8 import P8, p8_config, run_info, write_result


def _replay_ms(replay, pause_s: float = 0.0) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    time.sleep(pause_s)
    start.record()
    replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _clock_samples(path: str) -> list[dict[str, float]]:
    """nvidia-smi's "1980 MHz, 702.13 W" lines; lines it could not fill ("[N/A]") are skipped."""
    out = []
    for line in open(path):
        try:
            mhz, watts = (float(p.split()[0]) for p in line.strip().split(", "))
        except ValueError:
            continue
        out.append({"sm_mhz": mhz, "watts": watts})
    return out


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--replays", type=int, default=40)
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("prefill_power times CUDA graphs: it needs an NVIDIA GPU")
    model = random_model(
        p8_config(num_hidden_layers=args.layers, compress_ratios=P8["compress_ratios"][: args.layers]),
        seed=0,
        dtype=torch.bfloat16,
        device="cuda",
    )
    c = model.config
    state = init_state(c, args.tokens + 64, torch.bfloat16, "cuda", mtp=False, slots=1)
    steps = StepGraphs(
        model,
        state,
        torch.zeros(2, dtype=torch.long, device="cuda"),
        max_requests=1,
        max_tokens=args.tokens,
        graphs=True,
        inductor=True,
    )
    chunk = [(0, 0, torch.randint(3, c.vocab_size, (args.tokens,)).tolist())]
    steps.prefill(chunk)  # compiles, then captures
    torch.cuda.synchronize()
    entry = next(iter(steps._entries.values()))
    if not entry.captured:
        raise SystemExit("the prefill step was not captured")

    def replay() -> None:  # every captured piece of the step, in order
        for piece in entry.pieces:
            piece.graph.replay()

    smi, log = shutil.which("nvidia-smi"), tempfile.NamedTemporaryFile("w", suffix=".csv", delete=False)
    sampler = None
    if smi:
        sampler = subprocess.Popen(
            [smi, "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader", "-lms", "100"], stdout=log
        )
    idle = [_replay_ms(replay, pause_s=0.5) for _ in range(3)]
    sustained = [_replay_ms(replay) for _ in range(args.replays)]
    if sampler is not None:
        sampler.terminate()
        sampler.wait()
    log.close()
    samples = _clock_samples(log.name) if smi else []
    os.unlink(log.name)
    loaded = [s for s in samples if s["watts"] > 0.8 * max((x["watts"] for x in samples), default=0)]
    steady = statistics.median(sustained[args.replays // 4 :])
    result = {
        **run_info(argv),
        "model": f"P8 ({args.layers} layers), bf16, our random init",
        "tokens": args.tokens,
        "after_idle_ms": [round(t, 2) for t in idle],
        "back_to_back_ms": [round(t, 2) for t in sustained],
        "after_idle_tok_s": round(args.tokens / min(idle) * 1e3),
        "sustained_median_ms": round(steady, 2),
        "sustained_tok_s": round(args.tokens / steady * 1e3),
        "sm_mhz_max": max((s["sm_mhz"] for s in samples), default=None),
        "sm_mhz_median_under_load": statistics.median(s["sm_mhz"] for s in loaded) if loaded else None,
        "watts_max": max((s["watts"] for s in samples), default=None),
    }
    print({k: v for k, v in result.items() if k != "back_to_back_ms"}, flush=True)
    write_result(f"prefill_power_t{args.tokens}", result, args.out)
    return result


if __name__ == "__main__":
    main()
