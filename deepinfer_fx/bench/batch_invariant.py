"""The cost of batch invariance on a GPU: P8's dense projections with the flag on vs off, at the
decode batches 1, 8 and 64 and a 4096-token prefill.

    python -m deepinfer_fx.bench.batch_invariant --rows 1,8,64,4096 --out bench/results
    python -m deepinfer_fx.bench.batch_invariant --cpu --out bench/results   # the CPU cost (docs/decisions.md)

The whole step's cost, flag on against off, is ``p8_vs_hf --batch-invariant --no-inductor``; this
times the dense projections alone (``deepinfer::bi_matmul``, ``kernels/triton/batch_invariant.py``)
as a P8 step runs them: flag off, what the model runs today (the skinny
kernel for decode-sized calls, ``ops_linear.decode_sized``, cuBLAS for the rest; the head and
the fp32 projections in fp32 out), flag on, ``bi_matmul``. Each call is captured in a CUDA graph
cycling through enough weight copies (>= 256 MiB) that none finds its weight in L2, as in a
step. Reported per weight and summed over a step (P8's layers x the per-layer weights, plus the
head once): us, the on/off ratio, the largest difference from the off result relative to its
max, and whether every row of the on result equals the same row computed alone (M = 1).
Also written: the row counts, the command, the GPU and ``DEEPINFER_COMMIT``.

``--cpu``: what the flag costs where it is built. The fixed-order matmul against torch's (MKL)
at a few widths and row counts, one thread, and the demo model's (a tiny V4, ``demo.py``) ``generate`` (eager, 16 requests of
8-40 prompt tokens and 16 new ones) with the flag off and on, fp32 and bf16; each the fastest of
``--repeats`` runs (the CPU may be shared).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..kernels.ops_linear import decode_sized
from ..kernels.triton import register_nvidia_kernels
from .p8 import P8, run_info, write_result
from .timing import graph_ms

_ROTATE_BYTES = 256 << 20  # several times the H200's L2


def p8_projections() -> dict[str, tuple[int, int, bool, int]]:
    """[N, K], fp32 out, and calls per step of P8's dense projections (the per-layer ones once a layer)."""
    d, q, hd, layers = P8["hidden_size"], P8["q_lora_rank"], P8["head_dim"], P8["num_hidden_layers"]
    return {
        "wq_a": (q, d, False, layers),
        "wq_b": (P8["num_attention_heads"] * hd, q, False, layers),
        "wkv": (hd, d, False, layers),
        "wo_b": (d, P8["o_groups"] * P8["o_lora_rank"], False, layers),
        "shared_w1_w3": (P8["moe_intermediate_size"], d, False, 2 * layers),
        "shared_w2": (d, P8["moe_intermediate_size"], False, layers),
        "gate": (P8["n_routed_experts"], d, True, layers),
        "head": (P8["vocab_size"], d, True, 1),
    }


def _off(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    """What ``norm.project`` runs with the flag off (the swap's rule, ``passes/swap_calls.py``)."""
    if decode_sized(x, w):
        return torch.ops.deepinfer.skinny_linear(x, w, out_fp32)
    return torch.mm(x, w.T, out_dtype=torch.float32) if out_fp32 else F.linear(x, w)


def _on(x: torch.Tensor, w: torch.Tensor, out_fp32: bool) -> torch.Tensor:
    return torch.ops.deepinfer.bi_matmul(x, w, out_fp32)


def _time_us(call: Callable[[torch.Tensor], object], weights: list[torch.Tensor], iters: int) -> float:
    return graph_ms(lambda: [call(w) for w in weights], iters) * 1e3 / len(weights)


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


@torch.no_grad()
def cpu_cost(repeats: int) -> dict:
    """The CPU numbers of ``docs/decisions.md`` (batch invariance)."""
    from ..api import random_model
    from ..config import config_from_dict
    from ..demo import DEMO_CONFIG
    from ..engine.llm import LLM
    from ..engine.sampling import SamplingParams
    from ..graphs.batch_invariant import fixed_order_matmul

    torch.set_num_threads(1)
    matmul = []
    for dtype in (torch.float32, torch.bfloat16):
        for n, k, ms in ((300, 64, (1, 64, 512)), (1024, 1024, (1, 8, 64)), (4096, 4096, (1, 8))):
            w = torch.randn(n, k).to(dtype)
            for m in ms:
                x = torch.randn(m, k).to(dtype)
                ref = _best_ms(lambda x=x, w=w: x @ w.T, repeats)
                fixed = _best_ms(lambda x=x, w=w: fixed_order_matmul(x, w, False), repeats)
                matmul.append(
                    {
                        "dtype": str(dtype)[6:],
                        "N": n,
                        "K": k,
                        "M": m,
                        "torch_ms": round(ref, 3),
                        "fixed_ms": round(fixed, 3),
                        "ratio": round(fixed / ref, 1),
                    }
                )
                print(matmul[-1], flush=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(rng.randint(8, 40))] for _ in range(16)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = []
    for dtype in (torch.float32, torch.bfloat16):
        model = random_model(config_from_dict(DEMO_CONFIG).replace(fake_quant=False), seed=0, dtype=dtype)
        times = {}
        for on in (False, True):
            llm = LLM(model, device="cpu", eager=True, max_model_len=96, num_threads=1, batch_invariant=on)
            times[on] = _best_ms(lambda llm=llm: llm.generate(prompts, params), repeats)
        engine.append(
            {
                "dtype": str(dtype)[6:],
                "off_ms": round(times[False], 1),
                "on_ms": round(times[True], 1),
                "slower_pct": round(100 * (times[True] / times[False] - 1), 1),
            }
        )
        print(engine[-1], flush=True)
    return {"threads": 1, "matmul": matmul, "tiny_v4_generate": engine}


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,8,64,4096", help="decode batches and the prefill chunk")
    ap.add_argument("--iters", type=int, default=20, help="graph replays per timing")
    ap.add_argument("--out", default="bench/results/latest")
    ap.add_argument("--cpu", action="store_true", help="the CPU cost instead (no GPU needed)")
    ap.add_argument("--repeats", type=int, default=3, help="--cpu: runs per timing, the fastest kept")
    args = ap.parse_args(argv)
    if args.cpu:
        result = {**run_info(argv), **cpu_cost(args.repeats)}
        write_result("batch_invariant_cpu", result, args.out)
        return result
    if not register_nvidia_kernels():
        raise SystemExit("needs Triton and a CUDA GPU")
    rows_list = [int(v) for v in args.rows.split(",")]
    rows, step = [], {m: {"off_us": 0.0, "on_us": 0.0} for m in rows_list}
    for name, (n, k, out_fp32, calls) in p8_projections().items():
        copies = max(2, -(-_ROTATE_BYTES // (n * k * 2)))
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        for m in rows_list:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref, got = _off(x, weights[0], out_fp32).float(), _on(x, weights[0], out_fp32)
            alone = torch.cat([_on(x[i : i + 1], weights[0], out_fp32) for i in range(min(m, 64))])
            off_us = _time_us(lambda w, x=x, o=out_fp32: _off(x, w, o), weights, args.iters)
            on_us = _time_us(lambda w, x=x, o=out_fp32: _on(x, w, o), weights, args.iters)
            row = {
                "weight": name,
                "N": n,
                "K": k,
                "M": m,
                "out_fp32": out_fp32,
                "calls_per_step": calls,
                "off_us": round(off_us, 2),
                "on_us": round(on_us, 2),
                "on_over_off": round(on_us / off_us, 3),
                "max_rel_diff": ((got.float() - ref).abs().max() / ref.abs().max()).item(),
                "rows_equal_alone": bool(torch.equal(alone, got[: len(alone)])),
            }
            rows.append(row)
            step[m]["off_us"] += off_us * calls
            step[m]["on_us"] += on_us * calls
            print(row, flush=True)
        del weights
        torch.cuda.empty_cache()
    summary = [
        {
            "M": m,
            "off_us": round(s["off_us"], 1),
            "on_us": round(s["on_us"], 1),
            "slower_pct": round(100 * (s["on_us"] / s["off_us"] - 1), 1),
        }
        for m, s in step.items()
    ]
    for s in summary:
        print(
            f"M={s['M']:>5}: projections of a step {s['off_us']:>9.1f} us off, {s['on_us']:>9.1f} us on ({s['slower_pct']:+.1f} %)"
        )
    result = {
        **run_info(argv),
        "dtype": "bfloat16",
        "scope": "dense projections of a P8 step (the engine refuses the flag on CUDA)",
        "rows": rows,
        "step": summary,
    }
    write_result("batch_invariant_p8", result, args.out)
    return result


if __name__ == "__main__":
    main()
