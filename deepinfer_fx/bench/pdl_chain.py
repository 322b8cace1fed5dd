"""Chains of dependent decode-sized kernels in a CUDA graph, with and without programmatic
dependent launch (``kernels/triton/pdl.py``), in one run:

    python -m deepinfer_fx.bench.pdl_chain --out bench/results

Chains: RMSNorm of one 4096-wide row (a launch-bound kernel); the skinny GEMV of one row
against a [4096, 4096] weight (32 MiB a call, cycling through 8 weights so that none is found
in L2); and the two alternating, as a norm feeds a projection. Modes: ``plain`` (PDL off),
``pdl`` (on, the GEMV prefetching no weight before its wait) and ``pdl_prefetch`` (on, as the
engine runs it). The modes are timed alternately, ``--rounds`` times (the H200's clock drifts
under load); reported: the median us per launch of each.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch

from ..kernels.triton import pdl
from ..kernels.triton.linear import choose_tiles, skinny_linear_triton
from ..kernels.triton.norm import rms_norm_triton
from .p8 import run_info, write_result
from .timing import graph_ms

_MODES = {"plain": (False, None), "pdl": (True, 0), "pdl_prefetch": (True, None)}  # (PDL, prefetch tiles)


def _chains(launches: int) -> dict[str, tuple[Callable[[int | None], object], int, bool]]:
    """name -> (chain taking the GEMV's prefetch override, launches, has a GEMV)."""
    d = 4096
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, d, generator=g, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(d, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5
    ws = [torch.randn(d, d, generator=g, device="cuda", dtype=torch.bfloat16) / d**0.5 for _ in range(8)]
    rule = choose_tiles(d, d)
    gemvs = launches // 4

    def tiles(prefetch: int | None):
        return rule if prefetch is None else rule._replace(prefetch=prefetch)

    def norms(prefetch: int | None) -> None:
        y = x
        for _ in range(launches):
            y = rms_norm_triton(y, norm_w, 1e-6)

    def projections(prefetch: int | None) -> None:
        for i in range(gemvs):
            skinny_linear_triton(x, ws[i % len(ws)], False, tiles(prefetch))

    def norm_then_projection(prefetch: int | None) -> None:
        y = x
        for i in range(gemvs):
            y = skinny_linear_triton(rms_norm_triton(y, norm_w, 1e-6), ws[i % len(ws)], False, tiles(prefetch))

    return {
        "rms_norm": (norms, launches, False),
        "skinny_gemv": (projections, gemvs, True),
        "norm_gemv": (norm_then_projection, 2 * gemvs, True),
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--launches", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    device = torch.cuda.current_device()
    if torch.cuda.get_device_capability(device)[0] < 9:
        raise SystemExit(
            f"pdl_chain: {torch.cuda.get_device_name(device)} has no programmatic dependent launch (sm_90+)"
        )
    rows = []
    for name, (fn, n, gemv) in _chains(args.launches).items():
        modes = {m: v for m, v in _MODES.items() if gemv or m != "pdl_prefetch"}
        times: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for mode, (on, prefetch) in modes.items():
                pdl._ON[device] = on
                times[mode].append(graph_ms(lambda: fn(prefetch), args.iters) * 1e3 / n)
        rows.append(
            {
                "chain": name,
                "launches": n,
                **{f"us_per_launch_{m}": round(statistics.median(v), 3) for m, v in times.items()},
            }
        )
        print(rows[-1], flush=True)
    pdl._ON.pop(device, None)
    result = {**run_info(), "rows": rows}
    write_result("pdl_chain", result, args.out)
    return result


if __name__ == "__main__":
    main()
