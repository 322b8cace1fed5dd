"""An RMSNorm feeding a decode GEMV, as two launches against one (``skinny_linear_norm``), at
P8's shapes, in CUDA graphs with PDL as the engine runs them:

    python -m deepinfer_fx.bench.norm_gemv --rows 1,8,16 --out bench/results

Cases: ``q_norm`` -> ``wq_b`` (a window layer), -> ``wq_b`` + the indexer's ``wq_b`` (a CSA
layer), the final norm -> the head (fp32 logits). Variants, each a chain of ``--pairs``
norm+GEMV pairs in one graph (weights cycled through copies, so that none is found in L2):
``two_launches`` (``rms_norm_triton`` then ``skinny_linear_group_triton``, the rule's tiles:
the engine without the fusion), ``two_launches_norm_tiles`` (the same in the fused kernel's
tiles, ``norm_tiles``: what the tiling alone changes) and ``fused``. The variants are timed
alternately, ``--rounds`` times; reported: the median us per pair, the fused kernel's weight
bandwidth, and fused / two_launches.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Callable

import torch

from ..kernels.triton.linear import choose_tiles, norm_tiles, skinny_linear_group_triton, skinny_linear_norm_triton
from ..kernels.triton.norm import rms_norm_triton
from .p8 import P8, run_info, write_result
from .timing import graph_ms

_EPS = 1e-6


def _cases() -> dict[str, tuple[tuple[int, ...], int, bool, int]]:
    """name -> (weights' N, K, fp32 result, copies of the weights to cycle through)."""
    heads, dim, q_rank = P8["num_attention_heads"], P8["head_dim"], P8["q_lora_rank"]
    index = P8["index_n_heads"] * P8["index_head_dim"]
    return {"q_norm_wq_b": ((heads * dim,), q_rank, False, 4),
            "q_norm_wq_b_indexer": ((heads * dim, index), q_rank, False, 4),
            "norm_head": ((P8["vocab_size"],), P8["hidden_size"], True, 2)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,16")
    ap.add_argument("--pairs", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    g = torch.Generator("cuda").manual_seed(0)
    rows = []
    for name, (ns, k, out_fp32, copies) in _cases().items():
        weights = [[torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) / k**0.5 for n in ns] for _ in range(copies)]
        nw = torch.rand(k, generator=g, device="cuda", dtype=torch.bfloat16) + 0.5
        rule, fused_tiles = choose_tiles(sum(ns), k), norm_tiles(sum(ns), k)
        for m in [int(v) for v in args.rows.split(",")]:
            x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)

            def chain(step: Callable[[list[torch.Tensor]], object]) -> Callable[[], None]:
                def run() -> None:
                    for i in range(args.pairs):
                        step(weights[i % copies])
                return run

            variants = {
                "two_launches": chain(lambda ws: skinny_linear_group_triton(rms_norm_triton(x, nw, _EPS), ws, out_fp32, rule)),
                "two_launches_norm_tiles": chain(
                    lambda ws: skinny_linear_group_triton(rms_norm_triton(x, nw, _EPS), ws, out_fp32, fused_tiles)),
                "fused": chain(lambda ws: skinny_linear_norm_triton(x, nw, _EPS, ws, out_fp32)),
            }
            times: dict[str, list[float]] = {v: [] for v in variants}
            for _ in range(args.rounds):
                for v, fn in variants.items():
                    times[v].append(graph_ms(fn, args.iters) * 1e3 / args.pairs)
            us = {v: statistics.median(t) for v, t in times.items()}
            weight_bytes = sum(ns) * k * 2
            rows.append({"case": name, "rows": m, "n": list(ns), "k": k, **{f"{v}_us": round(t, 2) for v, t in us.items()},
                         "fused_TBps": round(weight_bytes / us["fused"] / 1e6, 3),
                         "fused_vs_two_launches": round(us["fused"] / us["two_launches"], 4)})
            print(rows[-1], flush=True)
        del weights
    result = {**run_info(argv), "rows": rows}
    write_result("norm_gemv", result, args.out)
    return result


if __name__ == "__main__":
    main()
