"""L2: teacher-forced logprobs, compact prefill against exact, element by element, on a checkpoint.

    python examples/yoco/l2.py --model /path/to/v41-checkpoint --prompt-len 1000 --decode 64
    python examples/yoco/l2.py --model ckpt --device cuda --dtype bfloat16 --chunk 4096 --out l2.json

A random prompt of ``--prompt-len`` tokens is prefilled twice into fresh states, exact and
compact (KEEP ``--keep``; in chunks of ``--chunk`` tokens where given), then both decode the
same ``--decode`` forced tokens. Per position (the prompt's last row, then each decode step) it
reports the largest logprob difference over the vocabulary, the forced token's logprob
difference and whether the argmax agrees; ``--exact-runs`` prefills exact a second time in the
other chunking as the noise floor of the arithmetic itself. Spec §8.2: not bit-exact. One
device (meshes and DSpark confidences are not covered yet).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from deepinfer_fx.api import load_model
from deepinfer_fx.graphs.batch import make_batch
from deepinfer_fx.graphs.model import forward_batch
from deepinfer_fx.graphs.state import init_state
from deepinfer_fx.graphs.yoco import min_keep_tokens, replay_for


@torch.no_grad()
def teacher_forced(model, ids: torch.Tensor, n_prompt: int, keep: int | None, chunk: int) -> torch.Tensor:
    """Logprobs ``[1 + decode, vocab]`` (fp32): the prompt's last row, then each forced decode step."""
    c, params = model
    state = init_state(c, ids.numel() + 1, model.dtype, device=model.device, mtp=False)
    for start in range(0, n_prompt, chunk):
        b = make_batch([ids[start : min(start + chunk, n_prompt)]], [0], [start], model.device)
        logits, _ = forward_batch(params, state, c, b, replay=None if keep is None else replay_for(b, [n_prompt], keep))
    rows = [logits[-1:]]  # the prompt's last row (the last chunk's)
    for p in range(n_prompt, ids.numel()):
        rows.append(forward_batch(params, state, c, make_batch([ids[p : p + 1]], [0], [p], model.device))[0])
    return torch.cat(rows).float().log_softmax(-1)


def compare(a: torch.Tensor, b: torch.Tensor, forced: torch.Tensor) -> list[dict]:
    """Per position: max |a - b| over the vocabulary, the forced token's difference, same argmax."""
    d = (a - b).abs()
    return [
        {
            "position": i,
            "max_abs": round(d[i].max().item(), 6),
            "forced_abs": round(d[i, forced[i]].item(), 6) if i < forced.numel() else None,
            "same_argmax": bool(a[i].argmax() == b[i].argmax()),
        }
        for i in range(a.shape[0])
    ]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a V4.1 checkpoint directory")
    ap.add_argument("--prompt-len", type=int, default=1000)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--keep", type=int, default=140)
    ap.add_argument("--chunk", type=int, default=0, help="prefill chunk (0: one chunk)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    model = load_model(args.model, dtype=getattr(torch, args.dtype), device=args.device)
    c = model.config
    if not c.is_v41:
        raise SystemExit(f"{args.model}: compact prefill needs a V4.1 model, this is {c.model_type}")
    if args.keep < min_keep_tokens(c):
        raise SystemExit(f"--keep {args.keep} is below the minimum {min_keep_tokens(c)} (the sliding window)")
    n = args.prompt_len
    chunk = args.chunk or n
    ids = torch.randint(3, c.vocab_size, (n + args.decode,), generator=torch.Generator().manual_seed(args.seed)).to(
        args.device
    )
    exact = teacher_forced(model, ids, n, None, chunk)
    compact = teacher_forced(model, ids, n, args.keep, chunk)
    noise = teacher_forced(model, ids, n, None, n if chunk < n else max(1, n // 2))
    forced = ids[n:]
    rows = compare(compact, exact, forced)
    floor = compare(noise, exact, forced)
    print(f"{'pos':>5} {'max|dlp|':>10} {'forced':>10} {'argmax':>6} {'noise':>10}")
    for r, f in zip(rows, floor):
        print(
            f"{n - 1 + r['position']:>5} {r['max_abs']:>10.2e} {r['forced_abs'] or 0:>10.2e} {str(r['same_argmax']):>6} {f['max_abs']:>10.2e}"
        )
    result = {
        "model": args.model,
        "prompt_len": n,
        "decode": args.decode,
        "keep": args.keep,
        "chunk": chunk,
        "dtype": args.dtype,
        "device": args.device,
        "max_abs": max(r["max_abs"] for r in rows),
        "noise_max_abs": max(f["max_abs"] for f in floor),
        "argmax_agree": sum(r["same_argmax"] for r in rows) / len(rows),
        "rows": rows,
        "noise": floor,
    }
    print(
        f"compact vs exact: max |dlogprob| {result['max_abs']:.3e} (noise floor {result['noise_max_abs']:.3e}), "
        f"argmax agrees at {result['argmax_agree']:.0%} of positions"
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
