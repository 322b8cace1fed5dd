"""Does a weight prefetched into L2 during a latency-bound stretch make the next GEMV faster?

    python -m deepinfer_fx.bench.l2_prefetch --out bench/results

A batch-1 decode step alternates weight-streaming GEMVs with stretches of small latency-bound
kernels (norms, rope, attention, mHC) during which HBM idles: ~50 us a layer of a P8 step on an
H200 (the ``timeline`` of ``p8_vs_hf``'s decode rows). This measures, in CUDA graphs, the pattern
*prefetch -> spin -> GEMV*: a bulk L2 prefetch (``cp.async.bulk.prefetch.L2``, sm_90: the
issuing thread does not wait for the data) of the first ``fraction`` of each K split of every
weight row, a one-program kernel spinning for a few microseconds in place of the latency stretch,
then the skinny GEMV (``kernels/triton/linear.py``) on that weight, at P8's ``wo_b`` and ``wq_b``
shapes. Weights rotate over copies that together exceed L2 several times. Reported per shape,
spin length and fraction: us per pattern, and the saving against the pattern without prefetch.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from ..kernels.triton.linear import choose_tiles, skinny_linear_triton
from .p8 import P8, run_info, write_result
from .timing import graph_ms

_ROTATE_BYTES = 384 << 20
_PAIRS = 128  # (row, split) pairs a prefetch program covers, one per thread


@triton.jit
def _bulk_prefetch_kernel(w_ptr, n_pairs, k, k_split, chunk_bytes, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """Ask L2 for ``chunk_bytes`` from the start of each (row, K split) range of a row-major
    weight: one asynchronous bulk prefetch per pair."""
    i = tl.minimum(tl.program_id(0) * BLOCK + tl.arange(0, BLOCK), n_pairs - 1)  # tail lanes repeat the last pair
    addr = w_ptr + (i // SPLITS).to(tl.int64) * k + (i % SPLITS) * k_split
    size = tl.full([BLOCK], 0, tl.int32) + chunk_bytes
    tl.inline_asm_elementwise(
        "cp.async.bulk.prefetch.L2.global [$1], $2; // $0",
        "=r,l,r",
        [addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _spin_kernel(buf_ptr, n):
    """A serial chain of ``n`` FMAs on one thread: latency, no memory traffic."""
    x = tl.load(buf_ptr)
    for _ in range(n):
        x = x * 0.999 + 1.0
    tl.store(buf_ptr, x)


def bulk_prefetch(w: torch.Tensor, fraction: float) -> None:
    """Prefetch the first ``fraction`` of every K split (the skinny kernel's tiling) of each row."""
    n, k = w.shape
    t = choose_tiles(n, k)
    k_split = triton.cdiv(triton.cdiv(k, t.split), t.bk) * t.bk
    splits = triton.cdiv(k, k_split)
    chunk = int(k_split * fraction) * w.element_size() // 16 * 16
    if chunk == 0:
        return
    pairs = n * splits
    _bulk_prefetch_kernel[(triton.cdiv(pairs, _PAIRS),)](
        w, pairs, k, k_split, chunk, SPLITS=splits, BLOCK=_PAIRS, num_warps=_PAIRS // 32
    )


def _pattern_us(
    weights: list[torch.Tensor],
    x: torch.Tensor,
    spin: int,
    fraction: float | None,
    gemv: bool,
    buf: torch.Tensor,
    iters: int,
) -> float:
    def call() -> None:
        for w in weights:
            if fraction is not None:
                bulk_prefetch(w, fraction)
            if spin:
                _spin_kernel[(1,)](buf, spin, num_warps=1)
            if gemv:
                skinny_linear_triton(x, w, False)

    return graph_ms(call, iters) * 1e3 / len(weights)


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spins", default="0,2000,6000", help="FMA chain lengths of the stand-in latency stretch")
    ap.add_argument("--fractions", default="0.25,0.5,0.75,1.0")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    d, q = P8["hidden_size"], P8["q_lora_rank"]
    shapes = {"wo_b": (d, P8["o_groups"] * P8["o_lora_rank"]), "wq_b": (P8["num_attention_heads"] * P8["head_dim"], q)}
    fractions = [float(f) for f in args.fractions.split(",")]
    buf = torch.zeros(1, device="cuda")
    result = {**run_info(argv), "rows": []}
    for name, (n, k) in shapes.items():
        copies = max(2, -(-_ROTATE_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        gemv_us = _pattern_us(weights, x, 0, None, True, buf, args.iters)
        for spin in [int(s) for s in args.spins.split(",")]:
            spin_us = _pattern_us(weights, x, spin, None, False, buf, args.iters) if spin else 0.0
            base = _pattern_us(weights, x, spin, None, True, buf, args.iters)
            row = {
                "weight": name,
                "N": n,
                "K": k,
                "spin": spin,
                "spin_us": round(spin_us, 2),
                "gemv_us": round(gemv_us, 2),
                "pattern_us": round(base, 2),
                "prefetched": {},
            }
            for f in fractions:
                issue_us = _pattern_us(weights, x, 0, f, False, buf, args.iters)
                us = _pattern_us(weights, x, spin, f, True, buf, args.iters)
                row["prefetched"][f] = {
                    "pattern_us": round(us, 2),
                    "saved_us": round(base - us, 2),
                    "prefetch_alone_us": round(issue_us, 2),
                }
            result["rows"].append(row)
            print(row, flush=True)
        del weights
        torch.cuda.empty_cache()
    write_result("l2_prefetch", result, args.out)
    return result


if __name__ == "__main__":
    main()
