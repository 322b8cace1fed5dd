"""The indexer's scoring kernel at decode over a trained-format state: index keys held as MXFP4
rows and read where they lie, against bf16 keys and against unpacking the chunks' keys first
(what a trained-format state did before the kernel decoded them).

    python -m deepinfer_fx.bench.indexer_kernel [--config v41] [--entries 2048,8192,65536] [--batches 1,8,64]

Per (batch, index entries a slot): ``indexer_scores`` on a pool read by slot, captured in a CUDA
graph: ``values`` (bf16 keys), ``packed`` (uint8 rows, decoded tile by tile), ``unpack_then_values``
(``RowCodec.unpack`` of the slots' rows, then the values kernel). Reported: us each, the key bytes
each reads over its time (TB/s), and whether packed == values bit for bit (they must be).
"""

from __future__ import annotations

import argparse

import torch

from ..graphs import fake_quant as fq
from ..graphs.compressor import visible_entries
from ..kernels.triton.indexer import indexer_scores_triton
from .configs import BENCH_CONFIGS, bench_config
from .p8 import run_info, write_result
from .timing import graph_ms


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--config", choices=sorted(BENCH_CONFIGS), default="p8", help="the bench model whose widths to take"
    )
    ap.add_argument("--entries", default="2048,8192,65536", help="index entries a slot (context / 4 in V4)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    c = bench_config(args.config)
    codec = fq.codec(c, "index")
    h, d, ratio = c.index_n_heads, c.index_head_dim, c.csa_ratio
    torch.manual_seed(0)
    rows = []
    for n in [int(v) for v in args.entries.split(",")]:
        for b in [int(v) for v in args.batches.split(",")]:
            q = torch.randn(b, 1, h, d, device="cuda", dtype=torch.bfloat16)
            packed = codec.pack(torch.randn(b, n, d, device="cuda", dtype=torch.bfloat16))
            values = codec.unpack(packed, torch.bfloat16)
            w = torch.randn(b, 1, h, device="cuda") * h**-0.5
            visible = visible_entries(torch.full((b, 1), ratio * n - 1, device="cuda"), n, ratio)
            slots = torch.arange(b, device="cuda")
            runs = {
                "values": lambda: indexer_scores_triton(q, values, w, visible, 1.0, slots),
                "packed": lambda: indexer_scores_triton(q, packed, w, visible, 1.0, slots, codec.spec),
                "unpack_then_values": lambda: indexer_scores_triton(
                    q, codec.unpack(packed[slots], torch.bfloat16), w, visible, 1.0
                ),
            }
            same = torch.equal(runs["packed"](), runs["values"]())
            us = {name: graph_ms(fn, args.iters) * 1e3 for name, fn in runs.items()}
            key_bytes = {"values": values.numel() * 2, "packed": packed.numel(), "unpack_then_values": packed.numel()}
            row = {
                "batch": b,
                "entries": n,
                **{f"{k}_us": round(v, 2) for k, v in us.items()},
                **{f"{k}_TBps": round(key_bytes[k] / us[k] / 1e6, 3) for k in us},
                "packed_vs_values": round(us["values"] / us["packed"], 3),
                "packed_equals_values": same,
            }
            rows.append(row)
            print(row, flush=True)
    result = {**run_info(argv), "shape": {"heads": h, "dim": d, "rows": codec.spec}, "rows": rows}
    write_result(f"indexer_kernel_{args.config}", result, args.out)
    return result


if __name__ == "__main__":
    main()
