"""One mHC site at a bench model's widths (P8's by default, ``--config v41`` / ``pro`` for hidden
5120 / 7168): the fused Triton op against what a compiled step runs without it.

    python -m deepinfer_fx.bench.mhc_kernel --tokens 1,8,16,64,256,4096,16384 [--sweep] [--config v41]

At P8: X bf16 ``[T, 4, 4096]``, ``fn`` fp32 ``[24, 16384]``, 20 Sinkhorn rounds (``--rounds``): the site up to the
sublayer input (mixing GEMV, pre / post, Sinkhorn comb, collapse). Timed per token count, each
captured in a CUDA graph: ``mhc_site_triton`` (2 launches); the reference compiled through the
engine's CUDA pipeline with the ``mhc_site_kernel`` swap off (cuBLAS GEMM, the Sinkhorn kernel,
Inductor for the rest: what a step runs where the swap does not apply); the eager reference.
Reported: us per site, X read bandwidth of the Triton op (X bytes over its time), and the max
difference of ``u`` from the reference relative to its max. ``--sweep`` also times launch 1's
tilings (``dots=`` of ``mhc_site_triton``) and launch 2's (``finish=``). These rows (the op
faster at every size) are why the swap serves every site (``passes/swaps.py``).
"""

from __future__ import annotations

import argparse

import torch

from ..graphs.mhc import mhc_site
from ..kernels.triton.mhc import mhc_site_triton
from ..passes.compiler import compile_graph, make_backend
from .configs import BENCH_CONFIGS, bench_config
from .p8 import run_info, write_result
from .timing import graph_ms

_SWEEP = [
    {"BT": bt, "BK": bk, "SPLITS": s, "UNROLL": u}
    for bt in (16, 64)
    for bk in (64, 128)
    for s in (32, 64, 128)
    for u in (False, True)
]
_SWEEP_FINISH = [{"BLOCK_D": b, "num_warps": w} for b in (128, 256, 512, 1024) for w in (1, 2, 4)]


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,16,64,256,4096,16384")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--sweep", action="store_true", help="also time the launches' tilings")
    ap.add_argument(
        "--config", choices=sorted(BENCH_CONFIGS), default="p8", help="the bench model whose widths to take"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="Sinkhorn rounds (the config's by default; fewer times what the rounds cost)",
    )
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    c = bench_config(args.config)
    n, d = c.hc_mult, c.hidden_size
    rounds = c.hc_sinkhorn_iters if args.rounds is None else args.rounds
    if rounds < 1:
        ap.error(f"--rounds must be at least 1, got {rounds}")
    consts = (c.rms_norm_eps, c.hc_eps, rounds)
    torch.manual_seed(0)
    m = 2 * n + n * n
    fn = torch.randn(m, n * d, device="cuda") * (n * d) ** -0.5
    base, scale = torch.randn(m, device="cuda"), 0.5 + torch.rand(3, device="cuda")
    reference = mhc_site.reference  # type: ignore[attr-defined]
    engine = compile_graph(reference, make_backend("nvidia", disabled=("mhc_site_kernel",), inductor=True))
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        X = torch.randn(t, n, d, device="cuda", dtype=torch.bfloat16)
        site = (X, fn, base, scale, *consts, None)
        want = reference(*site)[3].float()
        err = ((mhc_site_triton(*site)[3].float() - want).abs().max() / want.abs().max()).item()
        us = {
            name: graph_ms(lambda f=f: f(*site), args.iters) * 1e3
            for name, f in (("triton", mhc_site_triton), ("engine_without", engine), ("eager", reference))
        }
        row = {
            "tokens": t,
            **{f"{k}_us": round(v, 2) for k, v in us.items()},
            "triton_vs_without": round(us["engine_without"] / us["triton"], 2),
            "triton_X_TBps": round(X.numel() * X.element_size() / us["triton"] / 1e6, 3),
            "u_max_rel_diff": err,
        }
        if args.sweep:
            row["sweep_us"] = {
                "{BT}/{BK}/{SPLITS}/{UNROLL}".format(**cfg): round(
                    graph_ms(lambda c=cfg: mhc_site_triton(*site, dots=c), args.iters) * 1e3, 2
                )
                for cfg in _SWEEP
            }
            row["finish_sweep_us"] = {
                "{BLOCK_D}/{num_warps}".format(**cfg): round(
                    graph_ms(lambda c=cfg: mhc_site_triton(*site, finish=c), args.iters) * 1e3, 2
                )
                for cfg in _SWEEP_FINISH
            }
        rows.append(row)
        print(row, flush=True)
    result = {
        **run_info(argv),
        "shape": {"hc_mult": n, "hidden": d, "fn": [m, n * d], "X": "bfloat16", "rounds": rounds},
        "sweep_key": "BT/BK/SPLITS/UNROLL",
        "finish_sweep_key": "BLOCK_D/num_warps",
        "rows": rows,
    }
    write_result(f"mhc_kernel_{args.config}", result, args.out)
    return result


if __name__ == "__main__":
    main()
