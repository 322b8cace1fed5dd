"""The P8 sweep (the role of DeepInfer's ``run_sweep.sh``): decode over batch sizes and
contexts, prefill over chunk sizes, each point against HF and the roofline, then the plots.

    python -m deepinfer_fx.bench.sweep --out bench/results/sweep

Each segment runs as its own process (a fresh CUDA context and its own JSON), so a point that
runs out of memory or time loses only its segment. ``--dry`` prints the commands only.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

DECODE_BATCHES = "1,2,4,8,16,32,64,128,256"
PREFILL_CHUNKS = "1024,2048,4096,8192,16384"


def commands(out: str, contexts: list[str], hf: bool) -> list[list[str]]:
    base = [sys.executable, "-m", "deepinfer_fx.bench.p8_vs_hf", "--out", out]
    peer = [] if hf else ["--no-hf"]
    runs = [[*base, *peer, "--segments", "prefill", "--prefill-tokens", PREFILL_CHUNKS]]
    for ctx in contexts:
        # long contexts hold big per-request caches: stop the batch where the state still fits
        batches = DECODE_BATCHES if int(ctx) <= 4096 else "1,8,64"
        runs.append([*base, *peer, "--segments", "decode", "--context", ctx, "--batches", batches])
    return runs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="bench/results/sweep")
    ap.add_argument("--contexts", default="512,4096,32768")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--dry", action="store_true")
    args = ap.parse_args(argv)
    failed = []
    for i, cmd in enumerate(commands(args.out, args.contexts.split(","), not args.no_hf)):
        print(" ".join(cmd[1:]), flush=True)
        if args.dry:
            continue
        out = Path(args.out) / f"run{i}"  # p8_vs_hf names files by segment; keep each run's own
        cmd[cmd.index("--out") + 1] = str(out)
        if subprocess.run(cmd, check=False).returncode:
            failed.append(" ".join(cmd[1:]))
    if not args.dry:
        from .plots import main as plot

        plot([str(p) for p in sorted(Path(args.out).glob("run*/*.json"))] + ["--out", args.out])
    for f in failed:
        print(f"FAILED: {f}")


if __name__ == "__main__":
    main()
