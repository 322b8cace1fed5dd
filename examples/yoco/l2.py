"""L2: teacher-forced logprobs, compact prefill against exact, element by element, on a checkpoint.

    python examples/yoco/l2.py --model /path/to/v41-checkpoint --prompt-len 1000 --decode 64
    python examples/yoco/l2.py --model ckpt --device cuda --dtype bfloat16 --chunk 4096 --out l2.json
    python examples/yoco/l2.py --model ckpt --mesh ep2 --prompt-len 200 --decode 8

A random prompt of ``--prompt-len`` tokens is prefilled twice into fresh states, exact and
compact (KEEP ``--keep``; in chunks of ``--chunk`` tokens where given), then both decode the
same ``--decode`` forced tokens. Per position (the prompt's last row, then each decode step) it
reports the largest logprob difference over the vocabulary, the forced token's logprob
difference and whether the argmax agrees, beside a reference: in one process, exact prefilled
a second time in another chunking (the noise floor of the arithmetic itself).

DSpark (a checkpoint with ``mtp.*`` DSpark stages; ``--no-dspark`` skips it): after the prompt
and after each decode step both runs write the drafter's context and draft a greedy block from
the next forced token; per position, whether the blocks agree and max |confidence difference|.

``--mesh epN``: the same runs on N expert-parallel ranks (``l2_mesh.py``), each with its own
prompt (seed + rank); the reference is then exact on the mesh against exact in one process.
Other meshes (cp, dp) are refused.

Spec §8.2: compact is not bit-exact in general. A prompt no longer than KEEP keeps every row,
so there it is exact by construction: logprobs, drafts and confidences must be equal bit for
bit, and the script exits non-zero where they are not.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
from l2_mesh import mesh_spec, run_mesh
from l2_runs import forced_ids, has_dspark, print_rows, rank_result, teacher_forced

from deepinfer_fx.api import load_model
from deepinfer_fx.config import ModelConfig, load_config
from deepinfer_fx.graphs.yoco import min_keep_tokens


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a V4.1 checkpoint directory")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--keep", type=int, default=140)
    ap.add_argument("--chunk", type=int, default=0, help="prefill chunk (0: one chunk)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--mesh", default=None, help="epN: run on N expert-parallel ranks")
    ap.add_argument("--no-dspark", action="store_true", help="skip the DSpark drafts even if the checkpoint has them")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    return ap.parse_args(argv)


def check_config(c: ModelConfig, args: argparse.Namespace) -> None:
    if not c.is_v41:
        raise SystemExit(f"{args.model}: compact prefill needs a V4.1 model, this is {c.model_type}")
    if args.keep < min_keep_tokens(c):
        raise SystemExit(f"--keep {args.keep} is below the minimum {min_keep_tokens(c)} (the sliding window)")


def one_process(args: argparse.Namespace) -> dict:
    """Exact, compact, and exact again in the other chunking (the noise floor), on one device."""
    model = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    dspark = has_dspark(model) and not args.no_dspark
    n = args.prompt_len
    chunk = args.chunk or n
    ids = forced_ids(model.config.vocab_size, n, args.decode, args.seed, args.device)
    exact = teacher_forced(model, ids, n, None, chunk, dspark)
    compact = teacher_forced(model, ids, n, args.keep, chunk, dspark)
    noise = teacher_forced(model, ids, n, None, n if chunk < n else max(1, n // 2), dspark)
    return rank_result(0, args.seed, dspark, compact, exact, noise, ids[n:])


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    spec = mesh_spec(args.mesh, args.device)  # refuse a mesh before loading anything
    check_config(load_config(args.model), args)
    n, chunk = args.prompt_len, args.chunk or args.prompt_len
    threads = torch.get_num_threads()
    if args.device == "cpu":  # one thread: 2 were seen to be nondeterministic under load (l2_mesh.py)
        torch.set_num_threads(1)
    try:
        ranks = [one_process(args)] if spec.world_size == 1 else run_mesh(args, spec)
    finally:
        torch.set_num_threads(threads)
    ref_name = "noise" if spec.world_size == 1 else "vs 1 proc"
    for r in ranks:
        print(f"rank {r['rank']} (seed {r['seed']}): compact vs exact, and {ref_name}")
        print_rows(n - 1, r["rows"], r["reference"], ref_name)
    dspark = ranks[0]["dspark"]
    result = {
        "model": args.model,
        "prompt_len": n,
        "decode": args.decode,
        "keep": args.keep,
        "chunk": chunk,
        "dtype": args.dtype,
        "device": args.device,
        "mesh": str(spec),
        "dspark": dspark,
        "exact_bound": n <= args.keep,  # every prompt row kept: compact must equal exact bit for bit
        "max_abs": max(r["max_abs"] for r in ranks),
        "reference_max_abs": max(r["reference_max_abs"] for r in ranks),
        "argmax_agree": sum(r["argmax_agree"] for r in ranks) / len(ranks),
        "bitwise": all(r["bitwise"] for r in ranks),
        "ranks": ranks,
    }
    if spec.world_size == 1:  # the one-process names: the rows, and the noise floor as the reference
        result.update(rows=ranks[0]["rows"], noise=ranks[0]["reference"], noise_max_abs=result["reference_max_abs"])
    line = f"compact vs exact: max |dlogprob| {result['max_abs']:.3e} ({ref_name} {result['reference_max_abs']:.3e}), "
    line += f"argmax agrees at {result['argmax_agree']:.0%} of positions"
    if dspark:
        result["drafts_agree"] = sum(r["drafts_agree"] for r in ranks) / len(ranks)
        result["conf_max_abs"] = max(r["conf_max_abs"] for r in ranks)
        line += f"; DSpark blocks agree at {result['drafts_agree']:.0%}, max |dconf| {result['conf_max_abs']:.3e}"
    print(line)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    if result["exact_bound"]:
        bad = [r["rank"] for r in ranks if not r["bitwise"]]
        if bad:
            raise SystemExit(
                f"FAIL: prompt_len {n} <= KEEP {args.keep} keeps every row, so compact must equal exact bit for bit; "
                f"it differs on rank(s) {bad}"
            )
        print(f"exact bound (prompt_len {n} <= KEEP {args.keep}): compact == exact bit for bit")
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
