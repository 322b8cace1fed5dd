"""A/B runs of a P8 benchmark: variants that differ only in settings, each run as its own
process, in interleaved rounds on one GPU.

    python -m deepinfer_fx.bench.ab --variant on --variant "off DEEPINFER_PDL=0" --rounds 2 \\
        -- --random-weights --segments decode --batches 1,8 --steps 10

Why: the same P8 decode measured in separate processes moves by 20-30 us at batch 1 and up to
~100 us at batch 8 (the expert GEMMs alone moved 80 us between two processes of one call), so
an A/B taken from two device calls, or one process each, cannot resolve a gain of that size.
Rounds run in ABBA order (the second round reversed, and so on), which cancels a linear drift
across the call (the GPU warming up, the power cap); each variant's figure is the median of its
rounds, and the spread of the rounds is printed beside every difference.

A variant is a name followed by ``KEY=VALUE`` settings: declared ``DEEPINFER_*`` variables
(checked with the engine's own parser before anything runs) or ``TORCHINDUCTOR_*``; and
``TREE=DIR`` runs that variant's bench from another source tree (an export of another commit:
``git archive <commit> | tar -x -C DIR``), for a change no setting switches. The bench
(``--bench``, default ``deepinfer_fx.bench.p8_vs_hf``) is run as ``python -m BENCH ARGS --out
DIR`` and must write one JSON result with ``decode`` rows (``batch``, ``context``, ``ours_ms``)
and/or ``prefill`` rows (``tokens``, ``ours_ms``). The result, with every run's full output,
goes to ``OUT/NAME.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..settings import PREFIX, VARIABLES, setting
from .p8 import run_info, write_result

_BENCH = "deepinfer_fx.bench.p8_vs_hf"
_LOG_TAIL = 4000  # characters of a failed run's output in the error
_TREE = "TREE"


def parse_variant(spec: str) -> tuple[str, dict[str, str]]:
    """``"NAME KEY=VALUE ..."`` -> (name, settings); a bad setting is refused here, with the
    engine parser's message, before any run."""
    words = spec.split()
    if not words or "=" in words[0]:
        raise ValueError(f"variant {spec!r}: the first word is its name, then KEY=VALUE settings")
    name, pairs = words[0], words[1:]
    env: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"variant {name!r}: {pair!r} is not KEY=VALUE")
        if key == _TREE:
            if not Path(value, "deepinfer_fx").is_dir():
                raise ValueError(
                    f"variant {name!r}: TREE={value} holds no deepinfer_fx package; export one with "
                    f"`git archive <commit> | tar -x -C {value}`"
                )
            value = str(Path(value).resolve())
        elif key.startswith(PREFIX):
            if key not in VARIABLES:
                raise ValueError(f"variant {name!r}: {key} is not a deepinfer_fx setting; known: {sorted(VARIABLES)}")
            setting(key, {key: value})  # raises, naming the variable and what it allows
        elif not key.startswith("TORCHINDUCTOR_"):
            raise ValueError(f"variant {name!r}: {key} is neither a {PREFIX}* setting nor TORCHINDUCTOR_*")
        env[key] = value
    return name, env


def metrics(result: dict[str, Any]) -> dict[str, float]:
    """The timed figures of one run: ms per decode step and per prefill chunk."""
    out = {f"decode b{r['batch']} ctx{r['context']} ms": r["ours_ms"] for r in result.get("decode", [])}
    out.update({f"prefill {r['tokens']} ms": r["ours_ms"] for r in result.get("prefill", [])})
    if not out:
        raise ValueError("the bench wrote no decode or prefill rows")
    return out


def _run(bench: str, args: list[str], env: dict[str, str], out_dir: Path) -> dict[str, Any]:
    out_dir.mkdir(parents=True)
    env = {**os.environ, **env}
    tree = env.pop(_TREE, None)
    if tree is not None:  # that tree's package first on the path, and its directory the working one
        env["PYTHONPATH"] = os.pathsep.join(p for p in (tree, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", bench, *args, "--out", str(out_dir.resolve())],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=False,
    )
    (out_dir / "log.txt").write_text(proc.stdout + proc.stderr)
    files = sorted(out_dir.glob("*.json"))
    if proc.returncode != 0 or len(files) != 1:
        raise RuntimeError(
            f"{bench} exited with {proc.returncode} and wrote {len(files)} result files; "
            f"its output ends:\n{(proc.stdout + proc.stderr)[-_LOG_TAIL:]}"
        )
    return json.loads(files[0].read_text())


def summarize(runs: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, Any]]:
    """Per figure and variant: the rounds, their median and spread, and the median's difference
    from the first variant's."""
    table: dict[str, dict[str, Any]] = {}
    for key in runs[0]["metrics"]:
        row: dict[str, Any] = {}
        for name in names:
            values = [r["metrics"][key] for r in runs if r["variant"] == name]
            row[name] = {"values": values, "median": statistics.median(values), "spread": max(values) - min(values)}
        base = row[names[0]]
        for name in names[1:]:
            v = row[name]
            v["vs_" + names[0]] = round(v["median"] - base["median"], 4)
            v["vs_" + names[0] + "_pct"] = round(100 * (v["median"] / base["median"] - 1), 2)
            # A difference inside the rounds' spread is not resolved by this run; one round has no spread.
            v["resolved"] = len(v["values"]) > 1 and abs(v["median"] - base["median"]) > max(
                v["spread"], base["spread"]
            )
        table[key] = row
    return table


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, bench_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", required=True, help='"NAME KEY=VALUE ..." (at least two)')
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bench", default=_BENCH)
    ap.add_argument("--name", default="ab")
    ap.add_argument("--out", default="bench/results/latest")
    args = ap.parse_args(own)
    try:
        variants = dict(parse_variant(v) for v in args.variant)
        if len(variants) != len(args.variant) or len(variants) < 2:
            raise ValueError(f"--variant: give at least two, with distinct names (got {args.variant})")
        if args.rounds < 1:
            raise ValueError(f"--rounds {args.rounds}: at least 1")
        if "--out" in bench_args:
            raise ValueError("the bench's --out is set by this script; pass --out before the --")
    except ValueError as e:
        ap.error(str(e))
    names = list(variants)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                result = _run(args.bench, bench_args, variants[name], Path(tmp, f"{name}-{r}"))
                runs.append({"variant": name, "round": r, "metrics": metrics(result), "result": result})
                print(f"round {r} {name}: {runs[-1]['metrics']}", flush=True)
    table = summarize(runs, names)
    for key, row in table.items():
        cells = [f"{n} {v['median']:.3f} (+-{v['spread'] / 2:.3f})" for n, v in row.items()]
        diffs = [
            f"{n} {v['vs_' + names[0]]:+.3f} ({v['vs_' + names[0] + '_pct']:+.1f} %{'' if v['resolved'] else ', not resolved'})"
            for n, v in row.items()
            if n != names[0]
        ]
        print(f"{key}: " + ", ".join(cells) + " | vs " + names[0] + ": " + ", ".join(diffs), flush=True)
    result = {
        **run_info(argv),
        "bench": args.bench,
        "bench_args": bench_args,
        "variants": variants,
        "rounds": args.rounds,
        "order": [(r["round"], r["variant"]) for r in runs],
        "summary": table,
        "runs": runs,
    }
    write_result(args.name, result, args.out)
    return result


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:  # a failed run: its output, not this script's traceback
        sys.exit(f"ab: {e}")
