"""P8 on one GPU through ``LLM.generate`` against the bare step graphs it replays, in one run.

    python -m deepinfer_fx.bench.e2e --batches 1,8,64 --prompt-len 512 --max-tokens 256
    python -m deepinfer_fx.bench.e2e --startup --layers 2      # first and second start, TTFT

Decode: for each batch and sampling setting (greedy; temperature 0.7, top-p 0.95) one untimed
``generate`` compiles and captures what the timed one replays; the timed one's decode rate is
taken between the moment every request has its first token and the moment they all finish
(every request generates ``--max-tokens`` tokens, so each step in between decodes the whole
batch). The bare rate replays the same captured decode graph (same bucket, same sampler mode)
with nothing around it. ``ratio`` = e2e / bare; ``host_us_per_step`` is the host's own work per
step (scheduling, laying out, launching, reading results), the wait for the device excluded.

Prefill: ``--prefill-prompts`` prompts of ``--prefill-len`` tokens (one token generated each)
against the bare prefill graph of one such chunk.

Start-up (``--startup``): a child process builds the engine with the warm-up on (decode
buckets to ``--max-num-seqs``, prefill buckets to ``--budget``) with an empty compile cache,
a second child with the cache the first left; each reports its build time, the warm-up's
share and the time to the first token of one prompt.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from ..api import random_model
from ..engine.llm import LLM
from ..engine.request import Sequence
from ..engine.sampling import SamplingParams
from ..engine.step_arena import DecodeRow, PrefillChunk
from .configs import bench_config, held_as_released
from .p8 import run_info, write_result
from .timing import timed

PHASES = ("_compile.compile_inner", "bytecode_tracing", "OutputGraph.call_user_compiler")
SETTINGS = {"greedy": dict(temperature=0.0), "top_p": dict(temperature=0.7, top_p=0.95)}


def _model(layers: int, mtp: bool = False, expert_format: str = "bf16"):
    """P8 random weights, ``layers`` deep (``mtp``: with V4's MTP-1 block, a window-only layer;
    ``expert_format`` "fp4": routed experts held as MXFP4, ``configs.held_as_released``)."""
    c = held_as_released(bench_config("p8", layers, mtp), expert_format)
    return random_model(c, seed=0, dtype=torch.bfloat16, device="cuda")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g).tolist()


def decode_row(llm: LLM, batch: int, setting: str, prompt_len: int, max_tokens: int, iters: int) -> dict:
    c = llm.model.config
    params = SamplingParams(**SETTINGS[setting], max_tokens=max_tokens, ignore_eos=True, seq_seed=7)
    prompts = _prompts(batch, prompt_len, c.vocab_size, seed=batch)
    llm.generate(prompts, params)  # compiles and captures every shape the timed run takes
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    stats = llm.last_stats
    first = max(o.metrics.first_token_time for o in outs)
    last = max(o.metrics.finished_time for o in outs)
    e2e_ms = (last - first) / (max_tokens - 1) * 1e3
    # the same captured decode graph, bare: one request per slot, mid-way through the output
    probe = Sequence(-1, None, [0], params, 7)
    rows = [DecodeRow(slot, prompt_len + max_tokens // 2, probe.controls) for slot in range(batch)]
    steps = llm.runner.steps
    graphs_before = len(steps.report())
    graph_ms = timed(lambda: steps.step(rows, (), probe.sampler_mode), iters) * 1e3
    assert len(steps.report()) == graphs_before, "the bare step compiled a graph the generate did not run"
    row = {
        "batch": batch,
        "sampling": setting,
        "prompt_len": prompt_len,
        "max_tokens": max_tokens,
        "e2e_ms_per_step": round(e2e_ms, 3),
        "graph_ms_per_step": round(graph_ms, 3),
        "e2e_tok_s": round(batch * 1e3 / e2e_ms, 1),
        "graph_tok_s": round(batch * 1e3 / graph_ms, 1),
        "ratio": round(graph_ms / e2e_ms, 3),
        "host_us_per_step": round(stats.host_us_per_step, 1),
        "host_wait_share": round(stats.host_wait / max(stats.wall, 1e-9), 3),
        "generate_wall_s": round(wall, 3),
        "steps": stats.steps,
    }
    print(row, flush=True)
    return row


def prefill_row(llm: LLM, n: int, length: int, iters: int) -> dict:
    c = llm.model.config
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    prompts = _prompts(n, length, c.vocab_size, seed=length)
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    probe = Sequence(-1, None, [0], params, 7)
    chunk = [PrefillChunk(0, 0, prompts[0], probe.controls)]
    steps = llm.runner.steps
    graph_ms = timed(lambda: steps.step((), chunk, "greedy"), iters) * 1e3
    e2e_tok_s = n * length / wall
    row = {
        "prompts": n,
        "prompt_len": length,
        "e2e_tok_s": round(e2e_tok_s),
        "graph_tok_s": round(length * 1e3 / graph_ms),
        "ratio": round(e2e_tok_s / (length * 1e3 / graph_ms), 3),
        "generate_wall_s": round(wall, 3),
        "graph_ms_per_chunk": round(graph_ms, 3),
        "host_us_per_step": round(llm.last_stats.host_us_per_step, 1),
    }
    print(row, flush=True)
    return row


def _cache_files(root: str | None) -> int:
    return sum(len(files) for _, _, files in os.walk(root)) if root else 0


def startup_child(args: argparse.Namespace) -> dict:
    """One engine start with the warm-up on, as a fresh process sees it; with the compile
    caches' hits and misses and the files the start added to them."""
    from torch._dynamo.utils import compilation_time_metrics as times
    from torch._dynamo.utils import counters

    cache = os.environ["DEEPINFER_CACHE_DIR"]
    before = _cache_files(cache)
    t0 = time.perf_counter()
    model = _model(args.layers)
    torch.cuda.synchronize()
    t_model = time.perf_counter() - t0
    llm = LLM(
        model=model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.budget,
        max_model_len=max(args.budget, args.prompt_len) + args.max_tokens + 16,
        warmup=True,
    )
    t_engine = time.perf_counter() - t0 - t_model
    prompt = _prompts(1, args.prompt_len, llm.model.config.vocab_size, seed=1)
    t1 = time.perf_counter()
    out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=1))[0]
    ttft = out.metrics.first_token_time - t1
    compiled_late = [r["graph"] for r in llm.runner.steps.report() if r["graph"] not in llm.warmed]
    saved = llm.runner.steps.functions.saved
    return {
        "model_s": round(t_model, 2),
        "engine_s": round(t_engine, 2),
        "warmup_s": round(llm.warmup_s, 2),
        "graphs": len(llm.warmed),
        "ttft_s": round(ttft, 4),
        "compiled_in_generate": compiled_late,
        # Dynamo's whole compile, its tracing, and the backend (our passes, then Inductor or its cache)
        "compile_s": {k: round(sum(times.get(k, [])), 2) for k in PHASES},
        "fx_graph_cache": {k: counters["inductor"][f"fxgraph_cache_{k}"] for k in ("hit", "miss")},
        "aot_autograd_cache": {k: counters["aot_autograd"][f"autograd_cache_{k}"] for k in ("hit", "miss")},
        "cache_files_added": _cache_files(cache) - before,
        # model parts loaded without tracing, compiled and saved, or left to torch.compile (why)
        "saved_steps": None
        if saved is None
        else {"loaded": len(saved.loaded), "saved": len(saved.saved), "skipped": saved.skipped},
        "cache_dirs": {v: os.environ.get(v) for v in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")},
    }


def startup(args: argparse.Namespace, argv: list[str]) -> dict:
    cache = tempfile.mkdtemp(prefix="deepinfer-cache-")
    env = {**os.environ, "DEEPINFER_CACHE_DIR": cache}
    for var in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        env.pop(var, None)
    runs = []
    for name in ("first", "second"):
        cmd = [sys.executable, "-m", "deepinfer_fx.bench.e2e", "--startup-child", *argv]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"start-up child failed:\n{out.stderr[-4000:]}")
        runs.append({"start": name, **json.loads(out.stdout.strip().splitlines()[-1])})
        print(runs[-1], flush=True)
    first, second = runs
    return {
        "cache_dir": cache,
        "runs": runs,
        "second_over_first": round(second["engine_s"] / first["engine_s"], 3),
        "config": {"layers": args.layers, "max_num_seqs": args.max_num_seqs, "budget": args.budget},
    }


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--settings", default="greedy,top_p", help=f"sampling settings: {', '.join(SETTINGS)}")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prefill-prompts", type=int, default=16, help="0: no prefill row")
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--startup", action="store_true", help="measure first and second start instead")
    ap.add_argument("--startup-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--max-num-seqs", type=int, default=64, help="start-up: decode buckets up to this")
    ap.add_argument(
        "--budget", type=int, default=4096, help="start-up: prefill buckets up to this (max_num_batched_tokens)"
    )
    ap.add_argument("--out", default="bench/results/latest")
    ap.add_argument("--name", default=None, help="result file name (default e2e or e2e_startup)")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench.e2e times CUDA graphs: it needs a GPU")
    if args.startup_child:
        print(json.dumps(startup_child(args)), flush=True)
        return {}
    result = {**run_info(argv), "model": f"P8 random weights, {args.layers} layers, bf16"}
    if args.startup:
        child_argv = [a for a in argv if a != "--startup"]
        result["startup"] = startup(args, child_argv)
        print(f"wrote {write_result(args.name or 'e2e_startup', result, args.out)}")
        return result
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        model=_model(args.layers),
        max_num_seqs=max(batches),
        max_num_batched_tokens=4096,
        max_model_len=max(args.prompt_len + args.max_tokens, args.prefill_len + 1) + 16,
        warmup=False,
    )
    result["decode"] = [
        decode_row(llm, b, s, args.prompt_len, args.max_tokens, args.iters)
        for s in args.settings.split(",")
        for b in batches
    ]
    if args.prefill_prompts:
        result["prefill"] = prefill_row(llm, args.prefill_prompts, args.prefill_len, max(args.iters // 10, 3))
    result["graphs"] = llm.runner.steps.report()
    print(f"wrote {write_result(args.name or 'e2e', result, args.out)}")
    return result


if __name__ == "__main__":
    main()
