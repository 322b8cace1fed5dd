"""The argument parser of ``python -m deepinfer_fx.generate``, with the argparse types that check
each value as it is parsed (standard library and torch-free modules only: ``--help`` stays instant)."""

from __future__ import annotations

import argparse
import math
from typing import Callable

from ..settings import usable_cores
from ..sharding.mesh import parse_mesh


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
        help="e.g. ep8, ep2,dp4, cp2,ep2; more than one rank: launch under torchrun (default: one rank)",
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
        "dequantise on load (default: DEEPINFER_EXPERT_FORMAT, auto = both kept as stored on CUDA)",
    )
    e.add_argument(
        "--dense-format",
        choices=["auto", "fp8", "dequant"],
        default=None,
        help="block-FP8 dense projections of quantised checkpoints: keep them as stored (fp8: half the bytes) "
        "or dequantise on load (default: DEEPINFER_DENSE_FORMAT, auto = kept as stored on CUDA in bf16)",
    )
    e.add_argument(
        "--kv-format",
        choices=["auto", "model", "trained"],
        default=None,
        help="how the cache holds window kv, compressed entries and index keys: trained = the fp8 / fp4 codes "
        "and scales of the model's fake-quant points (the same values, 2-4x fewer bytes), model = values in "
        "the model dtype (default: DEEPINFER_KV_FORMAT, auto = model)",
    )
    sp = ap.add_argument_group("speculative decoding")
    sp.add_argument(
        "--speculative-method",
        choices=["ngram", "mtp", "dspark"],
        default=None,
        help="draft tokens and verify them in one target forward (ngram: prompt lookup, no weights; mtp: the "
        "checkpoint's MTP-1 block, V4-Flash and V4-Pro; dspark: the DSpark drafter, V4.1-Flash and V4-Flash-0731; "
        "default: off)",
    )
    sp.add_argument(
        "--num-speculative-tokens",
        type=_int_from(1),
        default=None,
        help="drafts per verify step (default: 3; DEEPINFER_USE_NEXTN_DECODE caps it)",
    )
    sp.add_argument(
        "--draft-head",
        choices=["model", "fp8"],
        default=None,
        help="the output head the mtp / dspark drafter reads: model = as stored (default), fp8 = a block-FP8 "
        "copy made at load (half the bytes a draft streams; outputs are the target's either way)",
    )
    return ap
