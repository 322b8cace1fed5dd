"""What ``python -m deepinfer_fx.generate``'s parsed arguments mean: the combinations refused (an
option the mode asked for would ignore), the prompts read, ``so_args`` and a prompt's images."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

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
    "dense_format",
    "kv_format",
    "max_model_len",
    "max_num_seqs",
    "max_num_batched_tokens",
}
# options that act on compiled steps only: they ask for them, and --eager turns them off
COMPILED_OPTIONS = ("no_cuda_graphs", "no_inductor", "dump_graphs", "disable_passes")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def check_combinations(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
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
    if args.draft_head is not None and args.speculative_method not in ("mtp", "dspark"):
        ap.error("argument --draft-head: the head of a model drafter; needs --speculative-method mtp or dspark")
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


def read_prompts(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
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


def speculative_config(args: argparse.Namespace) -> dict | None:
    """``LLM(speculative_config=...)`` from the speculative decoding flags (None: off)."""
    if args.speculative_method is None:
        return None
    cfg = {"method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens or 3}
    return cfg if args.draft_head is None else {**cfg, "draft_head": args.draft_head}


def so_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> dict | None:
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


def with_images(llm: Any, prompt: str, files: list[str]) -> dict:
    """The prompt with its images in vLLM's shape: its token ids, with one placeholder per
    image after the BOS unless the text already holds the placeholders."""
    image_token = llm.model.config.image_token_id
    if llm.tokenizer is None or image_token is None:
        raise ValueError("--image needs a V4.1 checkpoint with a vision tower and its tokenizer.json")
    from ..io.tokenizer import encode

    ids = encode(llm.tokenizer, prompt)
    if image_token not in ids:
        bos = encode(llm.tokenizer, "")  # what the post-processor puts first; [] if nothing
        head = len(bos) if ids[: len(bos)] == bos else 0
        ids = ids[:head] + [image_token] * len(files) + ids[head:]
    return {"prompt": ids, "multi_modal_data": {"image": list(files)}}
