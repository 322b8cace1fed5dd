"""Decode-sized projections of P8: the Triton skinny GEMM against cuBLAS, plus a tile sweep.

    python -m deepinfer_fx.bench.skinny_linear --rows 1,8,64 --out bench/results
    python -m deepinfer_fx.bench.skinny_linear --sweep --out bench/results
    python -m deepinfer_fx.bench.skinny_linear --fp8 128 --rows 1,8,16,17,64

Weights: P8's wq_b [32768, 1024], wo_b [4096, 8192], wq_a [1024, 4096], wkv [512, 4096]
(``--head`` adds the LM head [129280, 4096]), bf16. Per weight and row count it times
``skinny_linear_triton`` with the shape rule's tiles and cuBLAS as the model calls it
(``F.linear``; with ``--fp32-out`` ``torch.mm(..., out_dtype=float32)``, as ``linear_fp32``
does), each captured in a CUDA graph whose calls cycle through enough copies of the weight
(>= 256 MiB in all) that no call finds its weight in L2, as in a decode step. Reported: us per
call, weight bandwidth (weight bytes / time: the figure that matters here), the speedup and the
max difference from cuBLAS relative to its max.

``--fp8 BLOCK``: the weights in block FP8 as the checkpoints store them (``dense_format="fp8"``),
timed through ``skinny_linear_fp8_triton`` with the rule's row block (``linear.FP8_BM`` above 16
rows) and with 16-row blocks throughout, against cuBLAS on the dequantised bf16 weight and the
reference's dequantise-then-GEMM (what ran above the kernel's rows before); bandwidth counts the
fp8 bytes.

``--sweep`` then searches tilings per weight in three rounds: column tile x k tile x K splits
(4 warps, 3 stages), then warps x stages around the best, then the tensor-descriptor (TMA)
variant of the rule's tiles and of the three best; a tiling's score is its time summed over the
row counts (the rule may not depend on M). It prints each weight's best next to the
rule's, ready to pin in ``kernels/triton/linear.py::choose_tiles``.
"""

from __future__ import annotations

import argparse
import itertools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
from triton.runtime.errors import OutOfResources

from ..graphs.norm import dequant_dense, project_fp8
from ..io.quant import quant_fp8_block, ue8m0_to_float
from ..kernels.triton.linear import BM, Tiles, choose_tiles, skinny_linear_fp8_triton, skinny_linear_triton
from .timing import graph_ms
from .p8 import P8, run_info, write_result

_ROTATE_BYTES = 256 << 20  # several times the H200's L2
_SWEEP_BN = (32, 64, 128)
_SWEEP_BK = (128, 256)
_SWEEP_SPLIT = (1, 2, 4, 8, 16)
_SWEEP_WARPS = (4, 8)
_SWEEP_STAGES = (3, 4)
_TMA_TOP = 3


def p8_weights(head: bool) -> dict[str, tuple[int, int]]:
    """[N, K] of the P8 projections whose decode GEMMs this kernel targets."""
    d, q, hd = P8["hidden_size"], P8["q_lora_rank"], P8["head_dim"]
    shapes = {
        "wq_b": (P8["num_attention_heads"] * hd, q),
        "wo_b": (d, P8["o_groups"] * P8["o_lora_rank"]),
        "wq_a": (q, d),
        "wkv": (hd, d),
    }
    return {**shapes, "head": (P8["vocab_size"], d)} if head else shapes


def _time_us(call: Callable[[Any], object], weights: list[Any], rounds: int) -> float:
    """Mean us per call of ``call(w)`` over the weight copies, replayed from a CUDA graph (an
    eager pass first compiles the kernels and sets up cuBLAS outside the capture)."""
    return graph_ms(lambda: [call(w) for w in weights], rounds) * 1e3 / len(weights)


def _cublas(out_fp32: bool) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    if out_fp32:
        return lambda x, w: torch.mm(x, w.T, out_dtype=torch.float32)
    return F.linear


def _candidates(n: int, k: int) -> list[Tiles]:
    """Round one of the sweep: tilings with 64..4096 programs whose splits hold whole k tiles."""
    out = [choose_tiles(n, k)._replace(warps=4, stages=3)]
    for bn, bk, split in itertools.product(_SWEEP_BN, _SWEEP_BK, _SWEEP_SPLIT):
        t = Tiles(bn, bk, split, 4, 3)
        if t not in out and k >= split * bk and 64 <= triton.cdiv(n, bn) * split <= 4096:
            out.append(t)
    return out


def _sweep(name: str, xs: dict[int, torch.Tensor], weights: list[torch.Tensor], out_fp32: bool, rounds: int) -> dict:
    n, k = weights[0].shape

    def score(t: Tiles) -> dict[int, float] | None:
        try:
            return {
                m: _time_us(lambda w: skinny_linear_triton(x, w, out_fp32, t), weights, rounds) for m, x in xs.items()
            }
        except OutOfResources:  # too much shared memory for this tile and stage count
            return None

    tried: list[dict] = []

    def run(tiles: list[Tiles]) -> None:
        for t in tiles:
            us = score(t)
            if us is not None:
                tried.append({"tiles": t._asdict(), "us": us, "total_us": round(sum(us.values()), 2)})
                print(f"  {name} {t}: " + " ".join(f"M={m} {v:.2f}us" for m, v in us.items()), flush=True)

    run(_candidates(n, k))
    lead = Tiles(**min(tried, key=lambda r: r["total_us"])["tiles"])
    run(
        [
            lead._replace(warps=w, stages=s)
            for w, s in itertools.product(_SWEEP_WARPS, _SWEEP_STAGES)
            if (w, s) != (lead.warps, lead.stages)
        ]
    )
    # the tensor-descriptor variant of the rule's tiles and of the best few so far
    top = [Tiles(**r["tiles"]) for r in sorted(tried, key=lambda r: r["total_us"])[:_TMA_TOP]]
    run(list(dict.fromkeys(t._replace(tma=True) for t in [choose_tiles(n, k), *top])))
    best = min(tried, key=lambda r: r["total_us"])
    rule = score(choose_tiles(n, k))
    return {"rule": choose_tiles(n, k)._asdict(), "rule_us": rule, "best": best, "tried": tried}


def _fp8_rows(name: str, n: int, k: int, block: int, rows_list: list[int], out_fp32: bool, iters: int) -> list[dict]:
    """``--fp8``: one weight's rows (its copies, weights and scales, rotate as in ``_time_us``), the kernel (its rule, and 16-row blocks) against cuBLAS on the
    dequantised weight and the reference's in-graph dequantisation."""
    copies = max(2, -(-_ROTATE_BYTES // (n * k)))
    held = [quant_fp8_block(torch.randn(n, k) * k**-0.5, block) for _ in range(copies)]
    held = [(w.cuda(), ue8m0_to_float(sc).cuda()) for w, sc in held]
    bf16 = [dequant_dense(w, sc, torch.bfloat16) for w, sc in held]
    max_bk = min(128, block & -block)
    cublas, out = _cublas(out_fp32), []
    for m in rows_list:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        ref = cublas(x, bf16[0]).float()
        err = (skinny_linear_fp8_triton(x, *held[0], out_fp32).float() - ref).abs().max() / ref.abs().max()
        bm16 = choose_tiles(n, k, max_bk=max_bk, bm=BM)
        us = {
            "triton_us": _time_us(lambda h: skinny_linear_fp8_triton(x, *h, out_fp32), held, iters),
            "triton_bm16_us": _time_us(lambda h: skinny_linear_fp8_triton(x, *h, out_fp32, bm16), held, iters),
            "cublas_bf16_us": _time_us(lambda w: cublas(x, w), bf16, iters),
            "dequant_gemm_us": _time_us(lambda h: project_fp8.reference(x, *h, out_fp32), held, iters),  # type: ignore[attr-defined]
        }
        row = {"weight": name, "N": n, "K": k, "M": m, **{c: round(v, 2) for c, v in us.items()}}
        row |= {"triton_TBps": round(n * k / us["triton_us"] / 1e6, 3), "max_rel_diff": err.item()}
        out.append(row)
        print(row, flush=True)
    return out


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--head", action="store_true", help="also the LM head [vocab, hidden]")
    ap.add_argument("--only", default="", help="comma-separated weight names (default: all)")
    ap.add_argument("--fp32-out", action="store_true", help="fp32 results (linear_fp32) instead of bf16")
    ap.add_argument("--sweep", action="store_true", help="also search tilings per weight")
    ap.add_argument("--iters", type=int, default=20, help="graph replays per timing")
    ap.add_argument("--fp8", type=int, default=0, metavar="BLOCK", help="block-FP8 weights of BLOCK x BLOCK scales")
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    if args.fp8 and args.sweep:
        ap.error("--sweep searches bf16 tilings; run it without --fp8")
    rows_list = [int(v) for v in args.rows.split(",")]
    shapes = p8_weights(args.head)
    if args.only:
        shapes = {name: shapes[name] for name in args.only.split(",")}
    if args.fp8:
        rows = [
            r
            for name, (n, k) in shapes.items()
            for r in _fp8_rows(name, n, k, args.fp8, rows_list, args.fp32_out, args.iters)
        ]
        result = {
            **run_info(argv),
            "dtype": "float8_e4m3fn",
            "block": args.fp8,
            "out_fp32": args.fp32_out,
            "rows": rows,
        }
        write_result(f"skinny_linear_fp8_b{args.fp8}_p8" + ("_fp32out" if args.fp32_out else ""), result, args.out)
        return result
    cublas = _cublas(args.fp32_out)
    rows, sweeps = [], {}
    for name, (n, k) in shapes.items():
        copies = max(2, -(-_ROTATE_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        xs = {m: torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for m in rows_list}
        for m, x in xs.items():
            ref = cublas(x, weights[0]).float()
            err = (
                (skinny_linear_triton(x, weights[0], args.fp32_out).float() - ref).abs().max() / ref.abs().max()
            ).item()
            t_triton = _time_us(lambda w: skinny_linear_triton(x, w, args.fp32_out), weights, args.iters)
            t_cublas = _time_us(lambda w: cublas(x, w), weights, args.iters)
            row = {
                "weight": name,
                "N": n,
                "K": k,
                "M": m,
                "tiles": choose_tiles(n, k)._asdict(),
                "triton_us": round(t_triton, 2),
                "cublas_us": round(t_cublas, 2),
                "triton_TBps": round(n * k * 2 / t_triton / 1e6, 3),
                "cublas_TBps": round(n * k * 2 / t_cublas / 1e6, 3),
                "speedup": round(t_cublas / t_triton, 2),
                "max_rel_diff": err,
            }
            rows.append(row)
            print(row, flush=True)
        if args.sweep:
            sweeps[name] = _sweep(name, xs, weights, args.fp32_out, args.iters)
        del weights
        torch.cuda.empty_cache()
    cols = ["weight", "M", "triton_us", "cublas_us", "speedup", "triton_TBps", "cublas_TBps", "max_rel_diff"]
    print(" ".join(f"{c:>12}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>12.4g}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols))
    for name, s in sweeps.items():
        n, k = shapes[name]
        rule_total = sum(s["rule_us"].values()) if s["rule_us"] else float("nan")
        print(
            f"{name} [{n}, {k}]: rule {Tiles(**s['rule'])} {rule_total:.2f}us summed; "
            f"best {Tiles(**s['best']['tiles'])} {s['best']['total_us']:.2f}us summed"
        )
    result = {**run_info(argv), "dtype": "bfloat16", "out_fp32": args.fp32_out, "rows": rows, "sweep": sweeps}
    write_result("skinny_linear_p8" + ("_fp32out" if args.fp32_out else ""), result, args.out)
    return result


if __name__ == "__main__":
    main()
