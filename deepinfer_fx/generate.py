"""``python -m deepinfer_fx.generate``: offline generation from the command line.

With no ``--model`` and no ``DEEPINFER_HF_MODEL_DIR`` it writes and runs the built-in tiny
demo model: a real tokenizer with RANDOM weights, so its text is gibberish.
"""

from __future__ import annotations

# Only the standard library (and torch-free modules) before the arguments are parsed: --help and
# argument errors answer at once; torch and the engine load after.
import argparse
import math
import sys
from pathlib import Path
from typing import Any, Callable

from .demo import demo_model_dir
from .settings import EngineConfig, usable_cores
from .sharding.mesh import parse_mesh

# what a dry run reads; any other option would be silently ignored there
DRY_RUN_OPTIONS = {"dry_run", "model", "mesh", "rank", "dump_graphs"}
# what --plan reads: the config and the sizes the engine would be built with
PLAN_OPTIONS = {
    "plan",
    "gpu_memory_gb",
    "model",
    "mesh",
    "dtype",
    "eager",
    "expert_format",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
}
# options that act on compiled steps only: they ask for them, and --eager turns them off
COMPILED_OPTIONS = ("no_cuda_graphs", "no_inductor", "dump_graphs", "disable_passes")


def _int_from(low: int, allowed: str | None = None) -> Callable[[str], int]:
    """An argparse type: an integer >= ``low``."""
    allowed = allowed or f"an integer >= {low}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {value}")
        return value

    return parse


def _float_in(ok: Callable[[float], bool], allowed: str) -> Callable[[str], float]:
    """An argparse type: a finite float for which ``ok`` holds."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}") from None
        if not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text}")
        return value

    return parse


def _text(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _mesh(text: str) -> str:
    try:
        parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m deepinfer_fx.generate",
        description="Offline generation from the command line (no --model: the tiny demo model, random weights).",
    )
    ap.add_argument(
        "--model", help="checkpoint directory or hub repo id (default: $DEEPINFER_HF_MODEL_DIR, else the tiny demo)"
    )
    ap.add_argument("--prompt", action="append", help="a prompt (repeatable; default: one demo prompt)")
    ap.add_argument("--prompts-file", help="a UTF-8 text file with one prompt per line (blank lines skipped)")
    ap.add_argument(
        "--image",
        action="append",
        metavar="FILE",
        help="an image for the prompt (repeatable, in order; V4.1 with its vision tower; one placeholder "
        "token per image is put before the prompt unless the prompt already holds them)",
    )
    s = ap.add_argument_group("sampling")
    s.add_argument(
        "--temperature",
        type=_float_in(lambda v: v >= 0, "a finite float >= 0"),
        default=0.0,
        help="sampling temperature, 0 = greedy (default: %(default)s, greedy, so the CLI's output is reproducible; "
        "SamplingParams in the Python API defaults to 1.0, as in vLLM)",
    )
    s.add_argument(
        "--top-p",
        type=_float_in(lambda v: 0 < v <= 1, "a float in (0, 1]"),
        default=1.0,
        help="nucleus sampling: keep the smallest set of tokens whose probability reaches p (default: %(default)s = off)",
    )
    s.add_argument(
        "--top-k",
        type=_int_from(-1, "-1 or 0 (off) or an integer >= 1"),
        default=-1,
        help="keep the k most likely tokens; -1 or 0 = off (default: %(default)s)",
    )
    s.add_argument(
        "--min-p",
        type=_float_in(lambda v: 0 <= v <= 1, "a float in [0, 1]"),
        default=0.0,
        help="drop tokens below min_p times the top token's probability (default: %(default)s = off)",
    )
    s.add_argument(
        "--max-tokens", type=_int_from(1), default=32, help="tokens to generate per prompt (default: %(default)s)"
    )
    s.add_argument("--stop", action="append", type=_text, default=None, help="stop string (repeatable; default: none)")
    s.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    s.add_argument(
        "--seed",
        type=_int_from(0),
        default=0,
        help="engine seed; each request's stream derives from it (default: %(default)s)",
    )
    so = s.add_mutually_exclusive_group()
    so.add_argument(
        "--regex", type=_text, default=None, metavar="PATTERN", help="structured output: the text must match PATTERN"
    )
    so.add_argument(
        "--json-schema", default=None, metavar="FILE", help="structured output: JSON valid against the schema in FILE"
    )
    so.add_argument(
        "--grammar",
        default=None,
        metavar="FILE",
        help="structured output: text of the EBNF grammar in FILE (root rule: root)",
    )
    e = ap.add_argument_group("engine")
    e.add_argument(
        "--mesh",
        type=_mesh,
        default=None,
        help="e.g. ep8, ep2,dp4; more than one rank: launch under torchrun (cp meshes step eagerly for now, "
        "with the GPU kernels) (default: one rank)",
    )
    e.add_argument(
        "--dry-run",
        action="store_true",
        help="trace one rank's decode and prefill steps of --mesh on a fake process group with abstract "
        "weights (no values are real), dump the graphs and print the collectives per MoE layer; "
        "without --model: the packaged V4.1-Flash config",
    )
    e.add_argument(
        "--rank", type=_int_from(0), default=None, help="the world rank a --dry-run traces (default: 0; --dry-run only)"
    )
    e.add_argument(
        "--plan",
        action="store_true",
        help="print the memory one GPU of --mesh needs, by category, and whether the model fits (reads only the config)",
    )
    e.add_argument(
        "--gpu-memory-gb",
        type=_float_in(lambda v: v > 0, "a float > 0"),
        default=141.0,
        help="a GPU's memory in GiB for --plan (default: an H200's %(default)s; --plan only)",
    )
    mode = e.add_mutually_exclusive_group()
    mode.add_argument("--eager", action="store_true", help="run the model functions uncompiled (no compile, no graphs)")
    mode.add_argument(
        "--compile",
        action="store_true",
        help="compile the steps on the CPU too (default: on GPUs only; --no-cuda-graphs, --no-inductor, "
        "--dump-graphs and --disable-passes imply it)",
    )
    e.add_argument("--no-cuda-graphs", action="store_true", help="compiled steps without graph capture")
    e.add_argument("--no-inductor", action="store_true", help="our passes on aot_eager instead of Inductor")
    e.add_argument(
        "--dump-graphs", metavar="DIR", help="write every compiled graph, after each pass, with diffs and an index"
    )
    e.add_argument(
        "--disable-passes",
        metavar="NAMES",
        help="comma-separated graph passes to switch off (adds to DEEPINFER_DISABLE_PASSES)",
    )
    e.add_argument("--no-overlap", action="store_true", help="run steps synchronously (no host/device overlap)")
    e.add_argument(
        "--no-warmup",
        action="store_true",
        help="compiled steps: skip the start-up compile of every bucket (each then compiles on first use)",
    )
    e.add_argument("--stream", action="store_true", help="print the tokens as they come (one prompt only)")
    e.add_argument(
        "--dtype",
        choices=["auto", "bfloat16", "float32"],
        default="auto",
        help="weights and activations (default: %(default)s = bfloat16 on GPUs, float32 on the CPU)",
    )
    e.add_argument("--device", default=None, help="cpu, cuda, cuda:N or npu (default: cuda where available, else cpu)")
    e.add_argument(
        "--threads",
        type=_int_from(1),
        default=None,
        help=f"intra-op CPU threads (torch.set_num_threads; on a busy machine fewer can be faster) "
        f"(default: $OMP_NUM_THREADS where set, as torchrun sets it, else the cores this process may use, "
        f"{usable_cores()} here)",
    )
    e.add_argument(
        "--max-num-seqs", type=_int_from(1), default=64, help="sequences in flight at once (default: %(default)s)"
    )
    e.add_argument(
        "--max-num-batched-tokens",
        type=_int_from(1),
        default=2048,
        help="tokens per engine step (default: %(default)s)",
    )
    e.add_argument(
        "--max-model-len",
        type=_int_from(1),
        default=None,
        help="longest prompt + output, in tokens (default: the model's limit, at most 8192)",
    )
    e.add_argument("--no-fake-quant", action="store_true", help="skip the official fake-quant points")
    e.add_argument(
        "--expert-format",
        choices=["auto", "fp8", "fp4", "dequant"],
        default=None,
        help="routed experts of quantised checkpoints: keep block FP8 (fp8) or MXFP4 (fp4) as stored, or "
        "dequantise on load (default: DEEPINFER_EXPERT_FORMAT, auto = fp8 kept on CUDA, MXFP4 dequantised)",
    )
    sp = ap.add_argument_group("speculative decoding")
    sp.add_argument(
        "--speculative-method",
        choices=["ngram", "mtp", "dspark"],
        default=None,
        help="draft tokens and verify them in one target forward (ngram: prompt lookup, no weights; mtp: the "
        "checkpoint's MTP-1 block, V4-Flash and V4-Pro; dspark: not built yet; default: off)",
    )
    sp.add_argument(
        "--num-speculative-tokens",
        type=_int_from(1),
        default=None,
        help="drafts per verify step (default: 3; DEEPINFER_USE_NEXTN_DECODE caps it)",
    )
    return ap


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _check_combinations(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Options that would have no effect in the mode asked for are errors, each naming why."""
    given = [dest for dest, value in vars(args).items() if value != ap.get_default(dest)]
    if args.plan:
        idle = [d for d in given if d not in PLAN_OPTIONS]
        if idle:
            ap.error(
                f"argument {_flag(idle[0])}: has no effect with --plan (it reads only the config; nothing is run); drop it"
            )
        return
    if args.gpu_memory_gb != ap.get_default("gpu_memory_gb"):
        ap.error("argument --gpu-memory-gb: only --plan reads it; drop it or add --plan")
    if args.dry_run:
        idle = [d for d in given if d not in DRY_RUN_OPTIONS]
        if idle:
            ap.error(
                f"argument {_flag(idle[0])}: has no effect with --dry-run (it traces one rank's steps on "
                "abstract weights; nothing is generated); drop it"
            )
        return
    if args.rank is not None:
        ap.error(
            "argument --rank: only a --dry-run traces one chosen rank; under torchrun each process's rank comes "
            "from torchrun; drop --rank or add --dry-run"
        )
    if args.num_speculative_tokens is not None and args.speculative_method is None:
        ap.error("argument --num-speculative-tokens: needs --speculative-method")
    if args.stream and args.prompts_file is not None or args.stream and len(args.prompt or []) > 1:
        ap.error("argument --stream: streams one request; give a single --prompt")
    if args.image and (args.prompts_file is not None or len(args.prompt or []) > 1):
        ap.error("argument --image: the images go with one prompt; give a single --prompt")
    if args.eager:
        compiled = [d for d in COMPILED_OPTIONS if d in given]
        if compiled:
            ap.error(
                f"argument {_flag(compiled[0])}: acts on compiled steps, which --eager turns off; drop one of them"
            )


def _read_prompts(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            prompts += [
                line for line in Path(args.prompts_file).read_text(encoding="utf-8").splitlines() if line.strip()
            ]
        except OSError as e:
            ap.error(f"argument --prompts-file: {e}")
        except UnicodeDecodeError as e:
            ap.error(
                f"argument --prompts-file: {args.prompts_file} is not UTF-8 text (byte {e.start}); save it as UTF-8"
            )
    return prompts or ["The weather today is"]


def _so_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict | None:
    """--regex / --json-schema FILE / --grammar FILE as SamplingParams.so_args (DeepInfer's form)."""
    if args.regex is not None:
        return {"schema_type": "regex", "schema": args.regex}
    for flag, kind in (("json_schema", "json"), ("grammar", "ebnf")):
        path = getattr(args, flag)
        if path is not None:
            try:
                return {"schema_type": kind, "schema": Path(path).read_text(encoding="utf-8")}
            except (OSError, UnicodeDecodeError) as e:
                ap.error(f"argument {_flag(flag)}: cannot read {path}: {e}")
    return None


def _with_images(llm: Any, prompt: str, files: list[str]) -> dict:
    """The prompt with its images in vLLM's shape: its token ids, with one placeholder per
    image after the BOS unless the text already holds the placeholders."""
    image_token = llm.model.config.image_token_id
    if llm.tokenizer is None or image_token is None:
        raise ValueError("--image needs a V4.1 checkpoint with a vision tower and its tokenizer.json")
    from .io.tokenizer import encode

    ids = encode(llm.tokenizer, prompt)
    if image_token not in ids:
        bos = encode(llm.tokenizer, "")  # what the post-processor puts first; [] if nothing
        head = len(bos) if ids[: len(bos)] == bos else 0
        ids = ids[:head] + [image_token] * len(files) + ids[head:]
    return {"prompt": ids, "multi_modal_data": {"image": list(files)}}


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    _check_combinations(ap, args)
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
    prompts = _read_prompts(ap, args)
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
        so_args=_so_args(ap, args),
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
        warmup=False if args.no_warmup else None,
        speculative_config=None
        if args.speculative_method is None
        else {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens or 3},
    )
    texts = list(prompts)
    if args.image:
        prompts = [_with_images(llm, prompts[0], args.image)]
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
