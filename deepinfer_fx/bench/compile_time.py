"""How long the engine's first compiled steps take, by model depth.

    python -m deepinfer_fx.bench.compile_time --configs v41,v41_deep --tiny --name compile_time_v41_tiny_cpu
    python -m deepinfer_fx.bench.compile_time --configs v41,v41_deep --name compile_time_v41_gpu

Each bench config (``bench/configs.py``) runs one request through ``LLM.generate`` with compiled
steps (a prefill and a decode graph are built on first use), then the same request again, warm.
``--tiny`` keeps each config's layer layout (depth, compression ratios, KV / index / candidate
sources, Engram layers) at ``config/tiny.py``'s V4.1 widths: the CPU can run it (aot_eager, where
the time is Dynamo's trace and our passes); without it the config's own widths on the GPU
(Inductor, CUDA graphs), held as ``HELD_TO_FIT`` says. Reported per config: the first and the
warm generate, and each graph's compile seconds as ``StepGraphs.report()`` counts them.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from ..api import random_model
from ..config import config_from_dict
from ..config.tiny import tiny_v41
from ..engine.llm import LLM
from ..engine.sampling import SamplingParams
from .configs import BENCH_CONFIGS, HELD_TO_FIT, bench_config, held_as_released
from .p8 import run_info, write_result

# the keys that make a layout: depth and each layer's role
_LAYOUT = (
    "num_hidden_layers",
    "compress_ratios",
    "kv_source_layer_ids",
    "index_source_layer_ids",
    "candidate_source_layer_id",
    "engram_layer_ids",
)


def bench_layout_model(name: str, tiny: bool):
    """Bench config ``name`` with random weights: at its widths on the GPU (bf16, held to fit),
    or with ``tiny`` its layer layout at the tiny V4.1 widths, fp32 on the CPU."""
    if tiny:
        d = BENCH_CONFIGS[name]
        if d["model_type"] != "deepseek_v41_text":
            raise ValueError(f"--tiny takes V4.1 layouts (the tiny widths are V4.1's); {name!r} is {d['model_type']}")
        return random_model(config_from_dict(tiny_v41(**{k: d[k] for k in _LAYOUT}), where=f"tiny {name}"), seed=0)
    c = held_as_released(bench_config(name), *HELD_TO_FIT.get(name, ("bf16", "bf16")))
    return random_model(c, seed=0, dtype=torch.bfloat16, device="cuda")


def time_first_steps(name: str, tiny: bool) -> dict:
    model = bench_layout_model(name, tiny)
    llm = LLM(model=model, max_num_seqs=1, max_model_len=256, warmup=False, eager=False)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = list(range(3, 67))
    t0 = time.perf_counter()
    llm.generate([prompt], params)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([prompt], params)
    warm = time.perf_counter() - t0
    graphs = [{"graph": g["graph"], "compile_s": g.get("compile_s")} for g in llm.runner.steps.report()]
    row = {
        "config": name,
        "layers": model.config.num_hidden_layers,
        "first_generate_s": round(first, 2),
        "warm_generate_s": round(warm, 3),
        "graphs": graphs,
    }
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="v41,v41_deep", help="bench configs, comma-separated")
    ap.add_argument("--tiny", action="store_true", help="each config's layout at the tiny V4.1 widths (runs on CPU)")
    ap.add_argument("--out", default="bench/results/latest")
    ap.add_argument("--name", default="compile_time")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in BENCH_CONFIGS]
    if unknown:
        ap.error(f"unknown bench configs {unknown}; known: {sorted(BENCH_CONFIGS)}")
    if not args.tiny and not torch.cuda.is_available():
        ap.error("the bench widths need a GPU; --tiny times the layouts at tiny widths on the CPU")
    result = {**run_info(argv), "tiny": args.tiny, "rows": []}
    for name in names:
        try:
            result["rows"].append(time_first_steps(name, args.tiny))
        except ValueError as e:
            ap.error(str(e))
        write_result(args.name, result, args.out)
    print(f"wrote {write_result(args.name, result, args.out)}")
    return result


if __name__ == "__main__":
    main()
