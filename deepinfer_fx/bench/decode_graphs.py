"""Decode step time on the P8 model: compiled + CUDA graphs vs eager, in one run.

    python -m deepinfer_fx.bench.decode_graphs --batches 1,64 --context 512

Each batch decodes one token per request at position ``--context`` of a state that holds that
many positions (a decode step at a fixed position rewrites the same cache rows, so steps can be
repeated). The eager step is the same function run uncompiled; the graph step is
``StepGraphs.decode`` (host inputs -> one copy -> replay). Also checks that both give the same
logits (bf16 tolerance) and reports compile and capture time.
"""

from __future__ import annotations

import argparse
import time

import torch

from ..api import random_model
from ..engine.graph_runner import StepGraphs
from ..engine.steps import decode_logits
from ..graphs.state import init_state
from .p8 import p8_config, run_info, write_result
from .timing import timed


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--no-inductor", action="store_true", help="our passes on aot_eager instead of Inductor")
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    c = p8_config(num_hidden_layers=args.layers, compress_ratios=[0, 0, 4, 128, 4, 128, 4, 128][: args.layers])
    model = random_model(c, seed=0, dtype=torch.bfloat16, device="cuda")
    slots = max(batches)
    state = init_state(c, args.context + 64, torch.bfloat16, "cuda", mtp=False, slots=slots)
    next_token = torch.randint(3, c.vocab_size, (slots + 1,), device="cuda")
    graphs = StepGraphs(
        model, state, next_token, max_requests=slots, max_tokens=16, graphs=True, inductor=not args.no_inductor
    )
    rows = []
    for b in batches:
        sl = list(range(b))
        starts = [args.context] * b
        meta = [torch.tensor(v, device="cuda") for v in (sl, starts, [1] * b)]
        eager_logits = decode_logits(model.params, state, c, next_token, *meta)
        t0 = time.perf_counter()
        graph_logits = graphs.decode(sl, starts).logits
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        replay_logits = graphs.decode(sl, starts).logits.clone()
        err = ((replay_logits - eager_logits).abs().max() / eager_logits.abs().max()).item()
        err_first = ((graph_logits - eager_logits).abs().max() / eager_logits.abs().max()).item()
        same_top = (replay_logits.argmax(-1) == eager_logits.argmax(-1)).float().mean().item()
        t_eager = timed(lambda: decode_logits(model.params, state, c, next_token, *meta), args.iters)
        t_graph = timed(lambda: graphs.decode(sl, starts), args.iters)
        rows.append(
            {
                "batch": b,
                "context": args.context,
                "eager_ms": round(t_eager * 1e3, 3),
                "graph_ms": round(t_graph * 1e3, 3),
                "speedup": round(t_eager / t_graph, 2),
                "first_call_s": round(first, 1),
                "max_rel_diff_graph_vs_eager": err,
                "max_rel_diff_compiled_first_run": err_first,
                "argmax_agree": same_top,
            }
        )
        print(rows[-1], flush=True)
    result = {
        **run_info(argv),
        "model": f"P8 ({args.layers} layers), bf16, random weights",
        "inductor": not args.no_inductor,
        "rows": rows,
        "graphs": graphs.report(),
    }
    write_result("decode_graphs_p8", result, args.out)
    return result


if __name__ == "__main__":
    main()
