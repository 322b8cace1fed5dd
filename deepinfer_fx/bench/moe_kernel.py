"""Routed experts at a bench model's widths (P8 unless ``--config``): the Triton kernels against
``graphs/moe.py`` (torch._grouped_mm).

    python -m deepinfer_fx.bench.moe_kernel --tokens 1,8,64,256,4096 --shared
    python -m deepinfer_fx.bench.moe_kernel --sweep 4096   # prefill tile candidates
    python -m deepinfer_fx.bench.moe_kernel --sweep 1 --shared   # decode tile candidates
    python -m deepinfer_fx.bench.moe_kernel --config v41 --sweep 4096   # at V4.1-Flash widths

P8: D 4096, I 2048, 64 experts, top-6 (``--config v41``: D 5120, I 2304; ``pro``: D 7168, I 3072),
bf16, uniform random routing. Each implementation runs
captured in a CUDA graph (as decode runs in the engine) and the replays are timed with CUDA
events. Reported per token count: ms, weight bandwidth (bytes of the experts that received at
least one pair, each read once, over the time: the figure that matters for decode) and TFLOP/s
(6 * pairs * D * I flops, the figure that matters for prefill), plus the max difference from the
reference relative to its max. ``--fp8`` adds the fp8-weight kernel (block-128 scales),
``--fp4`` the MXFP4 one (the weights quantised, its bandwidth counting packed bytes + scales), on
Triton's tiles as chosen (``fp4``), again with the codes decoded in PTX (``fp4bits``,
``Tiles.fp4_bits``) and, on sm_90, through the Gluon GEMMs (``fp4wgmma``, ``moe_fp4_wgmma.py``:
the op's default there, in blocks of at most 64 rows) and, where an expert has more than 64 rows,
their 128-row prefill form (``fp4tall``, ``moe_fp4_tall.py``, with ``fp4tall_same_bits``);
``--shared`` the op with the shared expert folded in as expert E (``moe_experts_shared``), whose
bandwidth counts its weights too: in a P8 decode step at b1 the fold made gate/up and down
slower per byte (session 10), which this isolates.

``--sweep T`` times tile candidates at T tokens, gate/up then down, the other kernel's tiles as
chosen: the prefill list for T > 64, else the decode list, with the programs each launches (a
partial last wave over the H200's SMs shows there). With ``--shared`` the fused op is swept
(``bench/moe_tile_sweep.py``).
"""

from __future__ import annotations

import argparse

import torch

from ..graphs.moe import routed_experts
from ..io.quant import dequant_mxfp4, quant_mxfp4
from ..kernels.triton.moe import moe_experts_fp4_triton, moe_experts_fp8_triton, moe_experts_triton
from ..kernels.triton.moe_tiles import expert_tiles
from .configs import BENCH_CONFIGS
from .moe_tile_sweep import expert_op, sweep
from .p8 import run_info, write_result
from .timing import graph_ms

_BLOCK = 128


def _fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A block-scaled fp8 copy of ``w`` (one scale for the whole tensor, stored per block: the
    values do not matter for timing, the layout does)."""
    e, n, k = w.shape
    s = w.abs().amax().float() / 448.0
    scale = torch.full((e, -(-n // _BLOCK), -(-k // _BLOCK)), s.item(), device=w.device)
    return (w.float() / s).to(torch.float8_e4m3fn), scale


def _row(name: str, ms: float, weight_bytes: int, flops: int) -> dict:
    return {
        f"{name}_ms": round(ms, 4),
        f"{name}_TBps": round(weight_bytes / ms / 1e9, 3),
        f"{name}_TFLOPs": round(flops / ms / 1e9, 2),
    }


def _shared_weights(w: dict) -> dict:
    """A shared expert of one routed expert's shapes (``moe_experts_shared``)."""
    return {n: torch.randn_like(v[0]) / v.shape[-1] ** 0.5 for n, v in w.items()}


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,8,64,256,4096")
    ap.add_argument("--config", choices=sorted(BENCH_CONFIGS), default="p8", help="whose widths (bench/configs.py)")
    ap.add_argument("--experts", type=int, default=None, help="routed experts (default: the config's)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--fp8", action="store_true", help="also time fp8 weights with block-128 scales")
    ap.add_argument("--fp4", action="store_true", help="also time MXFP4 weights (ue8m0 scales per 32)")
    ap.add_argument("--shared", action="store_true", help="also time the op with the shared expert folded in")
    ap.add_argument(
        "--sweep",
        type=int,
        default=0,
        metavar="T",
        help="instead: sweep the tiles of the bf16 kernels (the MXFP4 ones with --fp4) at T tokens (prefill tiles above 64)",
    )
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    cfg = BENCH_CONFIGS[args.config]
    d, inter, top, limit = (
        cfg["hidden_size"],
        cfg["moe_intermediate_size"],
        cfg["num_experts_per_tok"],
        cfg["swiglu_limit"],
    )
    e = args.experts or cfg["n_routed_experts"]
    # the expert count in the name when it is not the config's
    tag = args.config if e == cfg["n_routed_experts"] else f"{args.config}_e{e}"
    torch.manual_seed(0)
    w = {
        "w1": torch.randn(e, inter, d, device="cuda", dtype=torch.bfloat16) / d**0.5,
        "w3": torch.randn(e, inter, d, device="cuda", dtype=torch.bfloat16) / d**0.5,
        "w2": torch.randn(e, d, inter, device="cuda", dtype=torch.bfloat16) / inter**0.5,
    }
    sh = _shared_weights(w) if args.shared else None
    if args.sweep:
        q4 = {n: tuple(t.view(torch.uint8) for t in quant_mxfp4(v)) for n, v in w.items()} if args.fp4 else None
        rows = sweep(args.sweep, w, limit, top, args.iters, sh, q4)
        result = {**run_info(argv), "tokens": args.sweep, "shared": args.shared, "fp4": args.fp4, "rows": rows}
        write_result(f"moe_tile_sweep_{tag}{'_fp4' if args.fp4 else ''}_t{args.sweep}", result, args.out)
        return result
    q = {n: _fp8(v) for n, v in w.items()} if args.fp8 else {}
    q4 = {n: tuple(t.view(torch.uint8) for t in quant_mxfp4(v)) for n, v in w.items()} if args.fp4 else {}
    rows = []
    for t in [int(v) for v in args.tokens.split(",")]:
        x = torch.randn(t, d, device="cuda", dtype=torch.bfloat16)
        idx = torch.rand(t, e, device="cuda").topk(top, dim=-1).indices
        rw = torch.rand(t, top, device="cuda")
        out = torch.empty(t, d, device="cuda")
        active = int(torch.unique(idx).numel())
        weight_bytes = active * 3 * inter * d * w["w1"].element_size()
        flops = 6 * t * top * d * inter
        ref = routed_experts.reference(w, limit, x, idx, rw)
        bf16_args = (x, w["w1"], w["w3"], w["w2"], idx, rw, limit)
        got = moe_experts_triton(*bf16_args)
        err = ((got - ref).abs().max() / ref.abs().max()).item()
        t_triton = graph_ms(lambda: moe_experts_triton(*bf16_args, out=out), args.iters)
        t_torch = graph_ms(lambda: routed_experts.reference(w, limit, x, idx, rw), args.iters)
        row = {
            "tokens": t,
            "active_experts": active,
            **_row("triton", t_triton, weight_bytes, flops),
            **_row("torch", t_torch, weight_bytes, flops),
            "speedup": round(t_torch / t_triton, 2),
            "max_rel_diff": err,
        }
        if sh is not None:
            op, reference = expert_op(w, sh)
            err = ((op(x, idx, rw, limit) - reference(x, idx, rw, limit)).abs().max() / ref.abs().max()).item()
            t_shared = graph_ms(lambda: op(x, idx, rw, limit, out=out), args.iters)
            row.update(
                _row(
                    "shared", t_shared, weight_bytes + 3 * inter * d * w["w1"].element_size(), flops + 6 * t * d * inter
                ),
                shared_max_rel_diff=err,
            )
        if q:
            w8 = (q["w1"][0], q["w1"][1], q["w3"][0], q["w3"][1], q["w2"][0], q["w2"][1])
            fp8_args = (x, *w8, idx, rw, limit, _BLOCK)
            t_fp8 = graph_ms(lambda: moe_experts_fp8_triton(*fp8_args, out=out), args.iters)
            row.update(_row("fp8", t_fp8, weight_bytes // 2, flops))
        if q4:
            w4 = (q4["w1"][0], q4["w1"][1], q4["w3"][0], q4["w3"][1], q4["w2"][0], q4["w2"][1])
            fp4_args = (x, *w4, idx, rw, limit)
            t_fp4 = graph_ms(lambda: moe_experts_fp4_triton(*fp4_args, out=out, wgmma=False), args.iters)
            ref4 = routed_experts.reference({n: dequant_mxfp4(*q4[n], x.dtype) for n in q4}, limit, x, idx, rw)
            err4 = ((moe_experts_fp4_triton(*fp4_args, wgmma=False) - ref4).abs().max() / ref4.abs().max()).item()
            row.update(_row("fp4", t_fp4, weight_bytes // 4 + weight_bytes // 64, flops), fp4_max_rel_diff=err4)
            # the same tiles with the weights decoded in PTX (Tiles.fp4_bits) instead of Triton's microscaled dot
            pairs = t * top
            bits = tuple(v._replace(fp4_bits=True) for v in expert_tiles(pairs, e, inter, d, 0, True, 2, 1))
            t_bits = graph_ms(lambda: moe_experts_fp4_triton(*fp4_args, out=out, tiles=bits), args.iters)
            err_bits = ((moe_experts_fp4_triton(*fp4_args, tiles=bits) - ref4).abs().max() / ref4.abs().max()).item()
            row.update(
                _row("fp4bits", t_bits, weight_bytes // 4 + weight_bytes // 64, flops), fp4bits_max_rel_diff=err_bits
            )
            from ..kernels.triton import moe_fp4_wgmma as fp4_wgmma  # Gluon: only where it is timed

            if fp4_wgmma.fits(x, inter, d, w4):  # the Gluon GEMMs (sm_90)
                for form, tall_from in (("fp4wgmma", None), ("fp4tall", 64)):
                    if tall_from is not None and pairs / min(e, pairs) <= tall_from:
                        continue  # the 128-row prefill form (moe_fp4_tall) only where an expert has > 64 rows
                    fp4_wgmma.TALL_FROM, default = tall_from, fp4_wgmma.TALL_FROM
                    try:
                        t_wg = graph_ms(lambda: moe_experts_fp4_triton(*fp4_args, out=out, wgmma=True), args.iters)
                        got = moe_experts_fp4_triton(*fp4_args, wgmma=True)
                    finally:
                        fp4_wgmma.TALL_FROM = default
                    err_wg = ((got - ref4).abs().max() / ref4.abs().max()).item()
                    row.update(
                        _row(form, t_wg, weight_bytes // 4 + weight_bytes // 64, flops),
                        **{f"{form}_max_rel_diff": err_wg},
                    )
                    if form == "fp4wgmma":
                        short = got
                    else:  # a row's sums in the same order: the same bits as the 64-row blocks
                        row["fp4tall_same_bits"] = torch.equal(got, short)
        rows.append(row)
        print(row, flush=True)
    cols = (
        [
            "tokens",
            "active_experts",
            "triton_ms",
            "torch_ms",
            "speedup",
            "triton_TBps",
            "torch_TBps",
            "triton_TFLOPs",
            "torch_TFLOPs",
        ]
        + (["shared_ms", "shared_TBps"] if sh else [])
        + (["fp8_ms", "fp8_TBps"] if q else [])
        + (
            ["fp4_ms", "fp4_TBps", "fp4bits_ms", "fp4bits_TBps", "fp4wgmma_ms", "fp4wgmma_TBps", "fp4tall_ms"]
            if q4
            else []
        )
    )
    print(" ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print(" ".join(f"{r.get(c, '-'):>14}" for c in cols))
    result = {**run_info(argv), "shape": {"D": d, "I": inter, "E": e, "k": top, "dtype": "bfloat16"}, "rows": rows}
    write_result(f"moe_kernel_{tag}", result, args.out)
    return result


if __name__ == "__main__":
    main()
