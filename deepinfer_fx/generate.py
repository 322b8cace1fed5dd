"""``python -m deepinfer_fx.generate``: offline generation from the command line.

With no ``--model`` and no ``DEEPINFER_HF_MODEL_DIR`` it writes and runs the built-in tiny
demo model: a real tokenizer with RANDOM weights, so its text is gibberish. The parser is
``cli/parser.py``; what the arguments mean, ``cli/arguments.py``.
"""

from __future__ import annotations

# Only the standard library (and torch-free modules) before the arguments are parsed: --help and
# argument errors answer at once; torch and the engine load after.
import argparse
import sys

from .cli.arguments import check_combinations, read_prompts, so_args, speculative_config, with_images
from .cli.parser import build_parser
from .demo import demo_model_dir
from .settings import EngineConfig


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_combinations(ap, args)
    try:
        if args.plan:
            from .engine.memory_plan import cli as plan

            return plan(
                args.model,
                args.mesh,
                args.gpu_memory_gb,
                dtype=args.dtype,
                eager=args.eager,
                expert_format=args.expert_format,
                dense_format=args.dense_format,
                kv_format=args.kv_format,
                max_model_len=args.max_model_len,
                max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens,
            )
        if args.dry_run:
            from .sharding.dryrun import cli as dry_run

            return dry_run(args.model, args.mesh or "1", args.rank or 0, args.dump_graphs)
        return _generate(ap, args)
    except (ValueError, OSError) as e:  # bad settings, checkpoints, devices, launches: a message, not a trace
        print(f"error: {e}", file=sys.stderr)
        return 2


def _generate(ap: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    prompts = read_prompts(ap, args)
    from .engine import LLM, SamplingParams  # after argparse: --help stays instant
    from .engine.inputs import resolve_device

    if args.device is not None:
        try:
            resolve_device(args.device)
        except ValueError as e:
            ap.error(f"argument --device: {e}")
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        max_tokens=args.max_tokens,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        so_args=so_args(ap, args),
    )
    path = args.model or EngineConfig.from_env().hf_model_dir
    if path is None:
        path = demo_model_dir()
        print(
            f"[demo] no checkpoint given: using the built-in tiny demo model at {path} (random weights: output is gibberish)"
        )
    llm = LLM(
        path,
        dtype=args.dtype,
        device=args.device,
        eager=True if args.eager else (False if args.compile else None),
        overlap=not args.no_overlap,
        cuda_graphs=False if args.no_cuda_graphs else None,
        inductor=False if args.no_inductor else None,
        dump_graphs=args.dump_graphs,
        disable_passes=args.disable_passes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        mesh=args.mesh,
        num_threads=args.threads,
        fake_quant=False if args.no_fake_quant else None,
        expert_format=args.expert_format,
        dense_format=args.dense_format,
        kv_format=args.kv_format,
        warmup=False if args.no_warmup else None,
        speculative_config=speculative_config(args),
    )
    texts = list(prompts)
    if args.image:
        prompts = [with_images(llm, prompts[0], args.image)]
    if args.stream:
        print(texts[0], end="", flush=True)
        llm.add_request(prompts[0], params)
        while llm.has_unfinished_requests():
            for o in llm.step():
                print(o.outputs[0].delta_text, end="", flush=True)
                if o.finished:
                    print(f"\n--- request {o.request_id} ({o.outputs[0].finish_reason})")
        st = llm.stats
    else:
        outs = llm.generate(prompts, params, use_tqdm=True)
        for o in outs:
            print(f"--- request {o.request_id} ({o.outputs[0].finish_reason})")
            print((o.prompt or texts[0]) + o.outputs[0].text)  # a prompt with images went in as ids
        st = llm.last_stats
    plan = llm.plan
    if llm.speculator is not None:
        print(llm.speculator.stats.summary())
    print(
        f"prefill: {st.prefill_tokens} tokens, {st.prefill_tokens / max(st.prefill_time, 1e-9):.1f} tok/s; "
        f"decode: {st.decode_tokens} tokens, {st.decode_tokens / max(st.decode_time, 1e-9):.1f} tok/s; "
        f"{st.steps} steps in {st.wall:.2f}s, host {st.host_us_per_step:.0f} us a step"
    )
    print(
        f"cache: {llm.bytes_per_token():.0f} B/token of compressed state + {plan.fixed_bytes_per_slot / 2**20:.2f} MiB/sequence "
        f"fixed; the pool holds {plan.slots} sequences x {plan.max_len} tokens ({plan.tokens_capacity} tokens)"
    )
    if llm.options.steps.compiled:  # start-up cost: what each graph took to compile (and capture)
        for r in llm.runner.steps.report():
            print(
                f"graph {r['graph']}: compile+first run {r['compile_s']:.1f}s, capture {r['capture_s']:.2f}s, "
                f"{r['calls']} calls, pass rewrites {r['rewrites']}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
