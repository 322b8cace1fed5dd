"""The sweep of a bench model (the role of DeepInfer's ``run_sweep.sh``; P8 by default, ``--config``
as ``p8_vs_hf`` takes it): decode over batch sizes and contexts, prefill over chunk sizes, each
point against HF and the roofline, then the plots.

    python -m deepinfer_fx.bench.sweep --out bench/results/latest/sweep
    python -m deepinfer_fx.bench.sweep --random-weights --contexts 4096 --batches 1,4,16,64,256
    python -m deepinfer_fx.bench.sweep --config v41 --random-weights --out bench/results/latest/sweep_v41

Each segment runs as its own process (a fresh CUDA context and its own JSON), so a point that
runs out of memory or time loses only its segment. ``--random-weights`` skips building HF's
model (minutes of set-up; no peer then); ``--dry`` prints the commands only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from .configs import BENCH_CONFIGS

DECODE_BATCHES = "1,2,4,8,16,32,64,128,256"
PREFILL_CHUNKS = "1024,2048,4096,8192,16384"
# Above this context, decode runs only the batches up to LONG_MAX_BATCH: big per-request caches.
LONG_CONTEXT = 4096
LONG_MAX_BATCH = 64


def commands(
    out: str,
    contexts: list[str],
    hf: bool,
    random_weights: bool = False,
    batches: str = DECODE_BATCHES,
    chunks: str = PREFILL_CHUNKS,
    steps: int | None = None,
    config: str = "p8",
) -> list[list[str]]:
    """One ``p8_vs_hf`` command per segment of bench model ``config``: the prefill chunks, then
    decode per context."""
    base = [sys.executable, "-m", "deepinfer_fx.bench.p8_vs_hf", "--out", out, "--config", config]
    if random_weights:  # no HF model at all, hence no peer
        base.append("--random-weights")
    elif not hf:
        base.append("--no-hf")
    if steps is not None:
        base += ["--steps", str(steps)]
    runs = [[*base, "--segments", "prefill", "--prefill-tokens", chunks]] if chunks else []
    long_batches = ",".join(b for b in batches.split(",") if int(b) <= LONG_MAX_BATCH) or batches.split(",")[0]
    for ctx in contexts:
        runs.append(
            [
                *base,
                "--segments",
                "decode",
                "--context",
                ctx,
                "--batches",
                batches if int(ctx) <= LONG_CONTEXT else long_batches,
            ]
        )
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/latest/sweep")
    ap.add_argument("--config", choices=sorted(BENCH_CONFIGS), default="p8", help="the bench model (bench/configs.py)")
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument(
        "--batches",
        default=DECODE_BATCHES,
        help=f"decode batch sizes (above {LONG_CONTEXT} context only those <= {LONG_MAX_BATCH})",
    )
    ap.add_argument("--chunks", default=PREFILL_CHUNKS, help="prefill chunk sizes; empty: no prefill segment")
    ap.add_argument("--steps", type=int, default=None, help="decode steps per point (p8_vs_hf's default otherwise)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--random-weights", action="store_true", help="our own random init, no HF model (fast; no peer)")
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args(argv)
    for name, text in (("--batches", args.batches), ("--chunks", args.chunks), ("--contexts", args.contexts)):
        if text and not all(x.strip().isdigit() and int(x) > 0 for x in text.split(",")):
            ap.error(f"{name} takes comma-separated positive integers, got {text!r}")
    failed = []
    if args.config == "v41" and not args.random_weights:
        ap.error("--config v41 has no HF peer (transformers has no DeepSeek-V4.1): add --random-weights")
    runs = commands(
        args.out,
        args.contexts.split(","),
        not args.no_hf,
        args.random_weights,
        args.batches,
        args.chunks,
        args.steps,
        args.config,
    )
    for i, cmd in enumerate(runs):
        print(" ".join(cmd[1:]), flush=True)
        if args.dry:
            continue
        out = Path(args.out) / f"run{i}"  # p8_vs_hf names files by segment; keep each run's own
        cmd[cmd.index("--out") + 1] = str(out)
        if subprocess.run(cmd, check=False).returncode:
            failed.append(" ".join(cmd[1:]))
    if not args.dry:
        from .plots import main as plot

        files = [str(p) for p in sorted(Path(args.out).glob("run*/*.json"))]
        try:
            if files:  # else every run failed: nothing to plot
                plot(files + ["--out", args.out])
        except ImportError:
            print(
                f"matplotlib is not installed (pip install -e '.[bench]'): plot later with "
                f"python -m deepinfer_fx.bench.plots {args.out}/run*/*.json --out {args.out}"
            )
    for f in failed:
        print(f"FAILED: {f}")


if __name__ == "__main__":
    main()
