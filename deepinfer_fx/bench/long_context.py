"""``python -m deepinfer_fx.bench.long_context``: the long-context case (16,389 in, 4,096 out)
at P8 widths on the GPU, random bf16 weights; ``--nextn 5`` adds an MTP-1 block (random: it
drafts what a random block drafts) and speculates with it, as DeepInfer runs the case. JSON under
bench/results/ with the command, GPU and commit (``DEEPINFER_COMMIT`` wins over git)."""

from __future__ import annotations

import argparse
import sys

import torch

from ..engine import LLM
from ..eval.long_context import INPUT_TOKENS, OUTPUT_TOKENS, run_case
from .e2e import _model
from .p8 import run_info, write_result


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="P8 layers kept (default all 8)")
    ap.add_argument("--input-tokens", type=int, default=INPUT_TOKENS)
    ap.add_argument("--output-tokens", type=int, default=OUTPUT_TOKENS)
    ap.add_argument("--nextn", type=int, default=0, help="MTP-1 drafts per step (0: no speculation)")
    ap.add_argument("--out", default="bench/results/latest")
    ap.add_argument("--name", default="long_context_p8")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit(
            "bench.long_context runs at P8 widths: it needs a GPU (the CPU case is tests/eval/test_long_context.py)"
        )
    spec = {"method": "mtp", "num_speculative_tokens": args.nextn} if args.nextn else None
    llm = LLM(
        model=_model(args.layers, mtp=spec is not None),
        max_num_seqs=1,
        max_num_batched_tokens=4096,
        max_model_len=args.input_tokens + args.output_tokens,
        speculative_config=spec,
    )
    result = {
        **run_info(argv),
        "model": f"P8 random weights, {args.layers} layers" + (" and an MTP-1 block" if spec else "") + ", bf16",
        "case": run_case(llm, args.input_tokens, args.output_tokens),
    }
    print(f"wrote {write_result(args.name, result, args.out)}")
    return result


if __name__ == "__main__":
    main()
