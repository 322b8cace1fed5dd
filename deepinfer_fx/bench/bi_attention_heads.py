"""``deepinfer::bi_attend``'s head tiling on a GPU: heads a program (16 / 32 / 64), and whether
each gives the 16-head tiling's bits, at P8-like prefill and decode shapes.

    python -m deepinfer_fx.bench.bi_attention_heads --out bench/results/latest

Each case draws q, keys and a visibility (window slots by position, about 640 keys a query
visible) and the canonical key order (``graphs/batch_invariant.canonical_order``), then runs the
kernel with each tiling (``bi_attention.heads_per_program`` replaced for the run): the time of
one call (CUDA events over ``--iters`` calls, after one warm call) and ``torch.equal`` against
the first tiling's output. The choice in ``heads_per_program`` is one of H and the dtypes only,
so a tiling that changes the bits can still be chosen, but never by T or C.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from ..graphs.batch_invariant import canonical_order
from ..kernels.triton import bi_attention, register_nvidia_kernels
from .p8 import run_info, write_result

# (heads a program, pipeline stages): the 16-head tiling first (the reference for the bits)
TILINGS = [(16, 3), (64, 2), (32, 3)]
# name: (C, T, N, window slots, fraction of keys visible)
CASES = {
    "prefill4096": (1, 4096, 4096 + 128, 128, 640 / 4224),
    "decode_b1": (1, 1, 640, 128, 1.0),
    "decode_b8": (8, 1, 640, 128, 1.0),
    "decode_b64": (64, 1, 640, 128, 1.0),
}


def _case(c: int, t: int, n: int, nw: int, visible: float, h: int, d: int = 512) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cuda").manual_seed(0)
    k_pos = torch.stack([torch.randperm(4 * n, device="cuda", generator=g)[:nw] for _ in range(c)])
    bias = torch.where(torch.rand(c, t, n, device="cuda", generator=g) < visible, 0.0, float("-inf"))
    order, count = canonical_order(k_pos, bias)
    q = torch.randn(c, t, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
    keys = torch.randn(c, n, d, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, keys, order, count, torch.randn(h, device="cuda", generator=g)


def _us(fn: Callable[[], object], iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters * 1000


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="64,128", help="H of the cases (V4 / V4.1: 64, V4-Pro: 128)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available() or not register_nvidia_kernels():
        raise SystemExit("bi_attention_heads needs a CUDA GPU with Triton")
    chosen = bi_attention.heads_per_program
    rows = []
    try:
        for name, shape in CASES.items():
            for h in (int(x) for x in args.heads.split(",")):
                inputs = _case(*shape, h=h)
                outs, times = [], []
                for tiling in TILINGS:
                    bi_attention.heads_per_program = lambda *_, tiling=tiling: tiling
                    outs.append(bi_attention.bi_attend_triton(*inputs))
                    times.append(round(_us(lambda: bi_attention.bi_attend_triton(*inputs), args.iters), 1))
                same = [torch.equal(o, outs[0]) for o in outs]
                rows.append({"case": name, "heads": h, "tilings": TILINGS, "us": times, "same_bits_as_16": same})
                print(f"{name} h{h}: us {times}, same bits as 16 heads {same}", flush=True)
    finally:
        bi_attention.heads_per_program = chosen
    result = {**run_info(argv), "rows": rows}
    print(write_result("bi_attention_heads", result, args.out))
    return result


if __name__ == "__main__":
    main()
