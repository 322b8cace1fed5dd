"""``python -m deepinfer_fx.eval generate | score | ppl`` (README.md beside this file).

Bad input ends with one line naming the file and line at fault, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .errors import EvalError
from .tasks import TASKS, check_task


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, not usage + error
        raise EvalError(message)


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


def _real(low: float, high: float, low_open: bool) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            v = math.nan
        if not math.isfinite(v) or v > high or (v <= low if low_open else v < low):
            raise argparse.ArgumentTypeError(f"must be in {'(' if low_open else '['}{low}, {high}], got {text!r}")
        return v

    return parse


def _seed(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return int(text)


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m deepinfer_fx.eval", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate responses into a JSONL file (resumes)")
    g.add_argument("--task", required=True, help=" | ".join(TASKS))
    g.add_argument("--data", required=True, help="input JSONL in the task's fields")
    g.add_argument("--model", required=True, help="checkpoint directory, or 'demo' (random weights)")
    g.add_argument("--samples", type=_count, default=1, help="samples per item (default 1)")
    g.add_argument("--out", required=True, help="generation JSONL; an existing one is resumed")
    g.add_argument("--temperature", type=_real(0.0, math.inf, False), default=0.6, help="0 = greedy (default 0.6)")
    g.add_argument("--top-p", type=_real(0.0, 1.0, True), default=0.95, help="default 0.95")
    g.add_argument("--max-tokens", type=_count, default=4096, help="per response (default 4096)")
    g.add_argument("--seed", type=_seed, default=0, help="base of every per-sample seed (default 0)")
    g.add_argument("--batch-size", type=_count, default=64, help="samples per engine call; written after each")
    g.add_argument(
        "--num-threads",
        type=_count,
        default=None,
        help="CPU intra-op threads (default: the engine's; 1 is fastest on a shared machine)",
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    s = sub.add_parser("score", help="grade a generation file")
    s.add_argument("--task", required=True, help=" | ".join(TASKS))
    s.add_argument("--gen", required=True, help="generation JSONL from 'generate'")
    s.add_argument("--out", required=True, help="scores JSON")
    q = sub.add_parser("ppl", help="decode-perplexity regression against the committed baseline")
    q.add_argument("--workload", required=True, help="a workload name (eval/workloads.py)")
    q.add_argument("--refresh", action="store_true", help="write this platform's values instead of checking")
    q.add_argument("--baseline", default=None, help="baseline JSON (default tests/models/offline_decode_ppl.json)")
    return p


def _generate(a: argparse.Namespace) -> None:
    from .generation import GenConfig, plan, run
    from .model import open_model
    from .tasks import load_items

    opened = open_model(a.model)
    loaded = load_items(check_task(a.task), a.data, vision=opened.vision)
    if loaded.skipped_images:
        print(f"skipped {loaded.skipped_images} image question(s) (the model has no vision tower)", file=sys.stderr)
    config = GenConfig(a.task, a.model, a.temperature, a.top_p, a.max_tokens, a.seed)
    records = plan(loaded, config, a.samples, opened.template)
    llm = opened.engine(records, a.max_tokens, a.batch_size, a.num_threads)
    images = {item["id"]: item["image"] for item in loaded.items if item.get("image")}
    n = run(
        llm, opened.tokenizer, records, config, Path(a.out), a.batch_size, progress=not a.no_progress, images=images
    )
    print(f"{a.out}: {n} new, {len(records) - n} already there ({len(loaded.items)} items x {a.samples} samples)")


def _score(a: argparse.Namespace) -> None:
    from .scoring import read_gen, score

    result = score(check_task(a.task), read_gen(a.gen, a.task))
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(
        f"{a.task}: pass@1 {result['pass@1']:.4f} ± {result['stderr']:.4f} over {result['items']} items, "
        f"{result['samples']} samples ({result['no_answer']} without an answer)"
    )


def _ppl(a: argparse.Namespace) -> int:
    from .ppl import BASELINE, check, refresh

    path = Path(a.baseline) if a.baseline else BASELINE
    if a.refresh:
        print(refresh(a.workload, path))
        return 0
    ok, message = check(a.workload, path)
    print(message)
    return 0 if ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    try:
        a = parser().parse_args(argv)
        if a.command == "generate":
            _generate(a)
        elif a.command == "score":
            _score(a)
        else:
            return _ppl(a)
    except EvalError as e:
        print(f"deepinfer_fx.eval: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
