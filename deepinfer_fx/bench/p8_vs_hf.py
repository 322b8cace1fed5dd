"""A bench model on one GPU (P8 by default), side by side in one run: this engine, HF
transformers' DeepseekV4ForCausalLM (eager, as installed) on the same weights, and the roofline.

    python -m deepinfer_fx.bench.p8_vs_hf --segments prefill,decode --batches 1,8,64 --context 512
    python -m deepinfer_fx.bench.p8_vs_hf --config v41 --random-weights

``--config`` picks the model from ``bench/configs.py``: ``p8`` (V4-Flash widths), ``v41``
(V4.1-Flash widths; HF has no V4.1, so only with ``--random-weights``) or ``pro`` (V4-Pro widths;
HF's model beside ours may not fit one GPU: ``--random-weights`` then).

The weights are HF's own random initialisation (hash tables made random permutations), saved
with ``save_pretrained`` to a RAM disk and loaded by our loader, so both engines multiply the
same numbers; a 64-token teacher-forced check compares the two before timing.

Segments follow DeepInfer's method: prefill and decode are timed separately; the per-kernel
profile of a decode step is taken after the measurement window, never inside it. Decode
throughput = steps/s x batch x (1 + nextn) / cp; no draft head runs (nextn = 0, so no
acceptance rate is assumed) and runs on one GPU (cp = 1). The engine has no expert-load
statistics flushes, so no interval needs dropping.
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from ..api import load_model, logits, random_model
from ..engine.graph_runner import StepGraphs
from ..graphs.state import init_state
from ..passes.batch_invariant import batch_invariant_swaps
from ..passes.manager import resolve_disabled
from . import roofline
from .configs import BENCH_CONFIGS, bench_config, check_held_to_fit, held_as_released
from .p8 import hf_kwargs, run_info, write_result
from .timing import between_steps, kernel_table, kernel_timeline, timed


def build_hf(config: str, layers: int | None, seed: int):
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV4Config(**hf_kwargs(layers, BENCH_CONFIGS[config]))
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            model = DeepseekV4ForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(old)
    with torch.no_grad():
        for name, buf in list(model.named_buffers()) + list(model.named_parameters()):
            if name.endswith("tid2eid"):  # HF initialises the hash table to zeros: every token -> expert 0
                perm = torch.rand(buf.shape[0], cfg.n_routed_experts, device="cuda").argsort(dim=1)
                buf.copy_(perm[:, : buf.shape[1]])
    return model


@torch.no_grad()
def hf_decode_ms(hf, batch: int, context: int, steps: int, vocab: int) -> float:
    ids = torch.randint(3, vocab, (batch, context), device="cuda")
    out = hf(input_ids=ids, use_cache=True)
    cache, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    del out

    def step():
        nonlocal nxt
        o = hf(input_ids=nxt, past_key_values=cache, use_cache=True)
        nxt = o.logits[:, -1].argmax(-1, keepdim=True)

    return timed(step, steps) * 1e3


def _compare(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Logits ``a`` against the reference ``b``: max difference relative to b's max, argmax agreement."""
    return {
        "max_rel_diff": round(((a - b).abs().max() / b.abs().max()).item(), 4),
        "argmax_agree": round((a.argmax(-1) == b.argmax(-1)).float().mean().item(), 4),
    }


def _print_kernels(kernels: list[dict], top: int = 12) -> None:
    for r in kernels[:top]:
        print(f"   {r['us']:9.1f} us {r['launches']:5d}x {100 * r['share']:5.1f}%  {r['kernel'][:90]}")


def _decode_row(graphs: StepGraphs, hf, c, b: int, context: int, steps: int, ceil: roofline.Ceilings) -> dict:
    sl, starts = list(range(b)), [context] * b
    graphs.decode(sl, starts)
    ms = timed(lambda: graphs.decode(sl, starts), steps) * 1e3
    hf_ms = None if hf is None else hf_decode_ms(hf, b, context, min(steps, 10), c.vocab_size)
    roof = roofline.decode(c, b, context, ceil=ceil)
    row = {
        "batch": b,
        "context": context,
        "ours_ms": round(ms, 3),
        "hf_ms": None if hf_ms is None else round(hf_ms, 2),
        "roofline_ms": round(roof.seconds * 1e3, 3),
        "ours_vs_roofline": round(roof.seconds * 1e3 / ms, 3),
        "ours_tok_s": round(1e3 / ms * b),
        "hf_tok_s": None if hf_ms is None else round(1e3 / hf_ms * b),
        "roofline": roof.as_dict(),
    }
    # the profile comes after the measurement window, never inside it
    kernels, kernel_us, launches = kernel_table(lambda: graphs.decode(sl, starts), 3)
    row.update(kernel_ms=round(kernel_us / 1e3, 3), launches=launches, kernels=kernels)
    # what each kernel adds to the step's span (durations overlap under PDL)
    row["timeline"], row["step_kernels"] = kernel_timeline(lambda: graphs.decode(sl, starts), 3)
    # the cost between steps: the inputs' copy and the graph launch (the timeline sees one step)
    row["between_steps"] = between_steps(lambda: graphs.decode(sl, starts), 8)
    print({k: v for k, v in row.items() if k not in ("kernels", "roofline", "timeline", "step_kernels")}, flush=True)
    _print_kernels(kernels)
    for r in row["timeline"][:16]:
        print(
            f"   advance {r['advance_us']:8.1f} us + gap {r['gap_us']:6.1f} us {r['launches']:4d}x  {r['kernel'][:90]}"
        )
    return row


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--segments", default="prefill,decode")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--context", default="512", help="decode contexts, comma-separated")
    ap.add_argument(
        "--prefill-tokens", default="4096", help="chunk sizes, comma-separated (one chunk from position 0 each)"
    )
    ap.add_argument("--config", choices=sorted(BENCH_CONFIGS), default="p8", help="the bench model (bench/configs.py)")
    ap.add_argument("--layers", type=int, default=None, help="cut the model to its first N layers (default: all of it)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--no-inductor", action="store_true")
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="the steps as LLM(batch_invariant=True) runs them: the invariant forms and kernels at every place "
        "(passes/batch_invariant.py), each graph checked by passes/invariant_guard.py; on Inductor as the engine "
        "runs them on CUDA, on aot_eager with --no-inductor",
    )
    ap.add_argument("--no-hf", action="store_true", help="skip the peer (our engine and the roofline only)")
    ap.add_argument(
        "--random-weights",
        action="store_true",
        help="our own random init, no HF model at all (fast set-up; implies --no-hf)",
    )
    ap.add_argument(
        "--expert-format",
        choices=["bf16", "fp4"],
        default="bf16",
        help="fp4: routed experts held as MXFP4 (the released format; with --random-weights), read by the fp4 kernels",
    )
    ap.add_argument(
        "--dense-format",
        choices=["bf16", "fp8"],
        default="bf16",
        help="fp8: dense projections held in block FP8 (128 x 128 blocks unless the config has its own; with "
        "--random-weights), read by the fp8 GEMV at decode",
    )
    ap.add_argument(
        "--kv-format",
        choices=["model", "trained"],
        default="model",
        help="trained: the state holds window kv, compressed entries and index keys as fp8 / fp4 bytes "
        "(graphs/state.py; the roofline still counts bf16 state reads); needs --fake-quant",
    )
    ap.add_argument(
        "--fake-quant",
        action="store_true",
        help="run the official fake-quant points (the bench configs skip them, as HF V4 does)",
    )
    ap.add_argument(
        "--check-fp32", action="store_true", help="also compare both engines with HF run in fp32 (the bf16 noise floor)"
    )
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(argv)
    segments = set(args.segments.split(","))
    batches = [int(b) for b in args.batches.split(",")]
    chunk_sizes = [int(n) for n in args.prefill_tokens.split(",")]
    contexts = [int(n) for n in args.context.split(",")]
    if BENCH_CONFIGS[args.config]["model_type"] == "deepseek_v41_text" and not args.random_weights:
        ap.error(f"--config {args.config} has no HF peer (transformers has no DeepSeek-V4.1): add --random-weights")
    if args.expert_format == "fp4" and not args.random_weights:
        ap.error("--expert-format fp4 needs --random-weights (the HF peer's experts are bf16)")
    if args.kv_format == "trained" and not args.fake_quant:
        ap.error("--kv-format trained holds what the fake-quant points produce: add --fake-quant")
    if args.fake_quant and not args.random_weights:
        ap.error("--fake-quant needs --random-weights (the HF peer has no fake-quant points)")
    if args.dense_format == "fp8" and not args.random_weights:
        ap.error("--dense-format fp8 needs --random-weights (the HF peer's weights are bf16)")
    try:
        check_held_to_fit(args.config, args.expert_format, args.dense_format)
        config = bench_config(args.config, args.layers)
    except ValueError as e:
        ap.error(str(e))
    config = held_as_released(config, args.expert_format, args.dense_format)
    if args.fake_quant:
        config = config.replace(fake_quant=True)

    t0 = time.perf_counter()
    hf, check = None, None
    if args.random_weights:
        model = random_model(config, seed=0, dtype=torch.bfloat16, device="cuda")
    else:
        hf = build_hf(args.config, args.layers, seed=0)
        with tempfile.TemporaryDirectory(dir="/dev/shm") as tmp:
            hf.save_pretrained(tmp)
            model = load_model(tmp, dtype=torch.bfloat16, device="cuda", fake_quant=False)
        ids = torch.randint(3, model.config.vocab_size, (64,), device="cuda")
        ours, theirs = logits(model, ids), hf(input_ids=ids[None]).logits[0].float()
        check = _compare(ours, theirs)
        if args.check_fp32:  # the bf16 noise floor: both engines against HF run in fp32 on the same weights
            hf.float()
            exact = hf(input_ids=ids[None]).logits[0].float()
            hf.to(torch.bfloat16)  # bf16 -> fp32 -> bf16 is exact: the timed model is unchanged
            check = {
                "ours_vs_hf_bf16": check,
                "ours_vs_hf_fp32": _compare(ours, exact),
                "hf_bf16_vs_hf_fp32": _compare(theirs, exact),
            }
        if args.no_hf:
            hf = None
    c = model.config
    print(f"setup {time.perf_counter() - t0:.0f} s; ours vs HF on 64 tokens: {check}", flush=True)
    print(
        "decode tok/s = steps/s x batch x (1 + nextn) / cp with nextn = 0 (no draft head runs, so no "
        "acceptance rate is assumed) and cp = 1 (one GPU)",
        flush=True,
    )

    slots = max(batches)
    state = init_state(
        c, max(*contexts, *chunk_sizes) + 64, torch.bfloat16, "cuda", mtp=False, slots=slots, kv_format=args.kv_format
    )
    next_token = torch.randint(3, c.vocab_size, (slots + 1,), device="cuda")
    graphs = StepGraphs(
        model,
        state,
        next_token,
        max_requests=slots,
        max_tokens=max(chunk_sizes),
        graphs=True,
        inductor=not args.no_inductor,
        over=batch_invariant_swaps((), "nvidia", resolve_disabled()) if args.batch_invariant else None,
        invariant=args.batch_invariant,
    )
    ceil = roofline.measure_ceilings()  # the roofline of the GPU that runs, not the H200's
    result = {
        **run_info(argv),
        "ceilings": ceil.as_dict(),
        "model": f"{args.config} ({c.num_hidden_layers} layers), bf16"
        + (", MXFP4 experts, " if c.held_experts == "fp4" else ", ")
        + ("block-FP8 dense weights, " if c.held_dense == "fp8" else "")
        + ("fake-quant points on, " if c.fake_quant else "")
        + ("state as trained (fp8 / fp4), " if args.kv_format == "trained" else "")
        + ("our random init" if args.random_weights else "HF random init"),
        "inductor": not args.no_inductor,
        "batch_invariant": args.batch_invariant,
        "check_vs_hf": check,
        "nextn": 0,
        "cp": 1,
        "acceptance": "none (no draft head runs)",
        "prefill": [],
        "decode": [],
    }
    name = f"{args.config}_vs_hf_" + "_".join(sorted(segments)) + ("_aot_eager" if args.no_inductor else "")
    name += "_fp4" if c.held_experts == "fp4" else ""
    name += "_fp8dense" if c.held_dense == "fp8" else ""
    name += "_fq" if c.fake_quant else ""
    name += "_trainedkv" if args.kv_format == "trained" else ""
    name += "_bi" if args.batch_invariant else ""

    if "prefill" in segments:
        for n in chunk_sizes:
            chunk = [(0, 0, torch.randint(3, c.vocab_size, (n,)).tolist())]
            t1 = time.perf_counter()
            graphs.prefill(chunk)
            torch.cuda.synchronize()
            compile_s = time.perf_counter() - t1
            ms = timed(lambda: graphs.prefill(chunk), 3) * 1e3
            hf_ms = None
            if hf is not None:
                hf_ms = timed(lambda: hf(input_ids=torch.tensor(chunk[0][2], device="cuda")[None]), 2) * 1e3
            roof = roofline.prefill(c, n, ceil=ceil)
            row = {
                "tokens": n,
                "ours_ms": round(ms, 2),
                "ours_tok_s": round(n / ms * 1e3),
                "first_call_s": round(compile_s, 1),
                "hf_ms": None if hf_ms is None else round(hf_ms, 2),
                "hf_tok_s": None if hf_ms is None else round(n / hf_ms * 1e3),
                "roofline_ms": round(roof.seconds * 1e3, 3),
                "roofline_tok_s": round(n / roof.seconds),
                "roofline": roof.as_dict(),
            }
            kernels, kernel_us, launches = kernel_table(lambda: graphs.prefill(chunk), 1)
            row.update(kernel_ms=round(kernel_us / 1e3, 3), launches=launches, kernels=kernels)
            result["prefill"].append(row)
            print({k: v for k, v in row.items() if k not in ("kernels", "roofline")}, flush=True)
            _print_kernels(kernels)
            write_result(name, result, args.out)  # after every row: a run cut short keeps what it measured

    if "decode" in segments:
        for context in contexts:
            for b in batches:
                result["decode"].append(_decode_row(graphs, hf, c, b, context, args.steps, ceil))
                write_result(name, result, args.out)
    result["graphs"] = graphs.report()
    write_result(name, result, args.out)
    return result


if __name__ == "__main__":
    main()
