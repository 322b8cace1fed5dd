"""One mHC site at P8 widths: the fused Triton op against the reference that Inductor compiles.

    python -m deepinfer_fx.bench.mhc_kernel --tokens 1,8,16,64,256,4096,16384

X bf16 ``[T, 4, 4096]``, ``fn`` fp32 ``[24, 16384]``, 20 Sinkhorn rounds: the site up to the
sublayer input (mixing GEMV, pre / post, Sinkhorn comb, collapse). Timed per token count, each
captured in a CUDA graph: ``mhc_site_triton`` (2 launches), the reference compiled by Inductor
(what a compiled step runs where the ``mhc_site_kernel`` swap does not apply) and the eager
reference. Reported: us per site, X read bandwidth of the Triton op (X bytes over its time),
and the max difference of ``u`` from the compiled reference relative to its max.
The swap serves sites of <= 16 tokens (``passes/swaps.py``); this bench decides that limit.
"""

from __future__ import annotations

import argparse

import torch

from ..graphs.mhc import mhc_site
from ..kernels.triton.mhc import mhc_site_triton
from .p8 import P8, run_info, write_result
from .timing import graph_ms


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,16,64,256,4096,16384")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="bench/results")
    args = ap.parse_args(argv)
    n, d = P8["hc_mult"], P8["hidden_size"]
    consts = (P8["rms_norm_eps"], P8["hc_eps"], P8["hc_sinkhorn_iters"])
    torch.manual_seed(0)
    m = 2 * n + n * n
    fn = torch.randn(m, n * d, device="cuda") * (n * d) ** -0.5
    base, scale = torch.randn(m, device="cuda"), 0.5 + torch.rand(3, device="cuda")
    reference = mhc_site.reference  # type: ignore[attr-defined]
    compiled = torch.compile(reference, dynamic=False)
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        X = torch.randn(t, n, d, device="cuda", dtype=torch.bfloat16)
        site = (X, fn, base, scale, *consts, None)
        want = compiled(*site)[3].float()
        err = ((mhc_site_triton(*site)[3].float() - want).abs().max() / want.abs().max()).item()
        us = {name: graph_ms(lambda f=f: f(*site), args.iters) * 1e3
              for name, f in (("triton", mhc_site_triton), ("inductor", compiled), ("eager", reference))}
        row = {"tokens": t, **{f"{k}_us": round(v, 2) for k, v in us.items()},
               "triton_vs_inductor": round(us["inductor"] / us["triton"], 2),
               "triton_X_TBps": round(X.numel() * X.element_size() / us["triton"] / 1e6, 3), "u_max_rel_diff": err}
        rows.append(row)
        print(row, flush=True)
    result = {**run_info(argv), "shape": {"hc_mult": n, "hidden": d, "fn": [m, n * d], "X": "bfloat16"}, "rows": rows}
    write_result("mhc_kernel_p8", result, args.out)
    return result


if __name__ == "__main__":
    main()
