"""Chains of dependent decode-sized kernels in a CUDA graph, with and without programmatic
dependent launch (``kernels/triton/pdl.py``), in one run:

    python -m deepinfer_fx.bench.pdl_chain --out bench/results

Chains: RMSNorm of one 4096-wide row (a launch-bound kernel); the skinny GEMV of one row
against a [4096, 4096] weight (32 MiB a call, cycling through 8 weights so that none is found
in L2); and the two alternating, as a norm feeds a projection. Each chain is timed with
PDL off and on, alternately, ``--rounds`` times (the H200's clock drifts under load, so the
pairs are interleaved); reported: the median us per launch of each and the saving per launch.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch

from ..kernels.triton import pdl
from ..kernels.triton.linear import skinny_linear_triton
from ..kernels.triton.norm import rms_norm_triton
from .p8 import run_info, write_result
from .timing import graph_ms


def _chains(launches: int) -> dict[str, tuple[Callable[[], object], int]]:
    d = 4096
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, d, generator=g, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(d, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5
    ws = [torch.randn(d, d, generator=g, device="cuda", dtype=torch.bfloat16) / d**0.5 for _ in range(8)]
    gemvs = launches // 4

    def norms() -> None:
        y = x
        for _ in range(launches):
            y = rms_norm_triton(y, norm_w, 1e-6)

    def projections() -> None:
        for i in range(gemvs):
            skinny_linear_triton(x, ws[i % len(ws)], False)

    def norm_then_projection() -> None:
        y = x
        for i in range(gemvs):
            y = skinny_linear_triton(rms_norm_triton(y, norm_w, 1e-6), ws[i % len(ws)], False)

    return {"rms_norm": (norms, launches), "skinny_gemv": (projections, gemvs),
            "norm_gemv": (norm_then_projection, 2 * gemvs)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    device = torch.cuda.current_device()
    rows = []
    for name, (fn, n) in _chains(args.launches).items():
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for on in (False, True):
                pdl._ON[device] = on
                times[on].append(graph_ms(fn, args.iters) * 1e3 / n)
        off, on_ = statistics.median(times[False]), statistics.median(times[True])
        rows.append({"chain": name, "launches": n, "us_per_launch_plain": round(off, 3),
                     "us_per_launch_pdl": round(on_, 3), "saved_us_per_launch": round(off - on_, 3)})
        print(rows[-1], flush=True)
    pdl._ON.pop(device, None)
    result = {**run_info(), "rows": rows}
    write_result("pdl_chain", result, args.out)
    return result


if __name__ == "__main__":
    main()
