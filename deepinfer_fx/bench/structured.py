"""Structured output on one GPU: JSON-schema requests beside unconstrained ones, through ``LLM.generate``.

    python -m deepinfer_fx.bench.structured --constrained 64 --free 64 --max-tokens 256

P8 (random weights, bf16) has no tokenizer, so the bench gives it a synthetic byte-level one of
the model's full vocabulary (word-, number- and punctuation-like tokens, as a real 129k BPE vocab
has: xgrammar's mask cost depends on the vocabulary). Two configurations of the same batch size
and prompts, run in alternating rounds (``--rounds``), each after an untimed run that compiles
and captures what it replays: ``free`` (every request unconstrained) and ``mixed`` (the first
``--constrained`` requests under ``SCHEMA``, whose array needs more items than ``--max-tokens``
can hold, so no request leaves the batch early). Reported per configuration: output tokens/s
over the whole ``generate`` (prompts are short), steps, the host's work per step, the turns that
read the previous step first (``synced``), the mask filling per step (host) and how long the
device waited for the masks between a step's forward and its sampler (``mask_wait``; the rest
of the filling was hidden behind the forward: ``mask_hidden``); ``ratio`` = mixed / free
tokens/s (the issue's target: >= 0.85).

``--fill-only`` (no GPU, no model): xgrammar's batched mask filling alone, ``--constrained``
matchers of ``SCHEMA`` walking random allowed tokens over the synthetic vocabulary, per step
and per row (``fill_cost``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import numpy as np
import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from ..engine.llm import LLM
from ..engine.llm_requests import make_seq
from ..engine.sampling import SamplingParams
from ..io.tokenizer import SPECIAL_TOKENS
from .e2e import _model, _prompts
from .p8 import run_info, write_result

SCHEMA = {
    "type": "array",
    "minItems": 400,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 100000},
            "name": {"type": "string", "maxLength": 16},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]}, "maxItems": 3},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "name", "tags", "ok"],
        "additionalProperties": False,
    },
}


def synthetic_tokenizer(vocab: int, seed: int = 0) -> Tokenizer:
    """A byte-level tokenizer of ``vocab`` tokens (specials, the 256 byte symbols, then made-up
    words with and without a leading space, numbers and punctuation runs); no merges, since the
    bench hands the engine token ids and xgrammar reads only the token strings."""
    rng = random.Random(seed)
    byte_syms = pre_tokenizers.ByteLevel.alphabet()
    table = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    for s in sorted(byte_syms):
        table.setdefault(s, len(table))
    letters, punct = "abcdefghijklmnopqrstuvwxyz", ['"', ",", ":", "{", "}", "[", "]", ".", "(", ")", "-", "_", "/"]
    while len(table) < vocab:
        kind = rng.random()
        if kind < 0.75:
            word = "".join(rng.choice(letters) for _ in range(rng.randint(2, 10)))
            word = word.capitalize() if rng.random() < 0.2 else word
            tok = ("Ġ" if rng.random() < 0.5 else "") + word
        elif kind < 0.85:
            tok = str(rng.randint(0, 999))
        else:
            tok = "".join(rng.choice(punct) for _ in range(rng.randint(2, 3))).replace(" ", "Ġ")
        table.setdefault(tok, len(table))
    tok = Tokenizer(models.BPE(vocab=table, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok


def _run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    st = llm.last_stats
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    reasons = [o.outputs[0].finish_reason for o in outs]
    return {
        "tokens_per_s": tokens / wall,
        "wall_s": wall,
        "tokens": tokens,
        "steps": st.steps,
        "synced": st.synced,
        "host_us_per_step": st.host_us_per_step,
        "mask_us_per_step": 1e6 * st.host_mask / max(st.steps, 1),
        # the device's wait between a masked step's forward and its sampler (mask work not hidden, plus the copy)
        "mask_wait_us_per_step": 1e6 * st.mask_wait / max(st.steps, 1),
        "mask_hidden": 1 - st.mask_wait / st.host_mask if st.host_mask else None,
        "finish": {r: reasons.count(r) for r in set(reasons)},
    }


def fill_cost(rows: int, steps: int, vocab: int = 129280, threads: int | None = None, seed: int = 0) -> dict:
    """Seconds per step of ``MaskFiller.fill`` and of feeding the tokens back, for ``rows``
    matchers of ``SCHEMA`` over the synthetic ``vocab``-token tokenizer, each taking a random
    allowed token (not EOS) per step."""
    from ..engine.structured import Grammars, MaskFiller, mask_words
    from ..settings import usable_cores

    threads = threads or usable_cores()
    grammars = Grammars(synthetic_tokenizer(vocab), vocab, (1,), threads=threads)
    spec = SamplingParams(so_args={"schema_type": "json", "schema": SCHEMA}).so_spec
    states = [grammars.state(spec) for _ in range(rows)]
    filler, words, rng = MaskFiller(threads), mask_words(vocab), np.random.default_rng(seed)
    fill_s, accept_s = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        mask, _ = filler.fill(states, words, pinned=False)
        t1 = time.perf_counter()
        bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little").reshape(rows, -1)[:, :vocab]
        bits[:, 1] = 0  # EOS: the walk goes on
        tokens = [int(rng.choice(np.flatnonzero(b))) for b in bits]
        t2 = time.perf_counter()
        assert all(st.accept(t) for st, t in zip(states, tokens))
        fill_s.append(t1 - t0)
        accept_s.append(time.perf_counter() - t2)
    med = statistics.median
    return {
        "rows": rows,
        "vocab": vocab,
        "threads": threads,
        "fill_ms_per_step": {
            "median": 1e3 * med(fill_s),
            "mean": 1e3 * statistics.mean(fill_s),
            "max": 1e3 * max(fill_s),
        },
        "fill_us_per_row": 1e6 * med(fill_s) / rows,
        "accept_us_per_row": 1e6 * med(accept_s) / rows,
    }


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--constrained", type=int, default=64, help="requests under the JSON schema")
    ap.add_argument("--free", type=int, default=64, help="unconstrained requests beside them")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3, help="alternating free / mixed rounds (medians reported)")
    ap.add_argument("--out", default="bench/results/latest")
    ap.add_argument("--name", default="structured")
    ap.add_argument("--fill-only", action="store_true", help="time the mask filling alone (CPU, no model)")
    ap.add_argument("--threads", type=int, default=None, help="--fill-only: the batch matcher's threads")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.fill_only:
        result = {**run_info(argv), **fill_cost(args.constrained, args.max_tokens, threads=args.threads)}
        print(
            f"{result['rows']} rows, {result['threads']} threads: fill {result['fill_ms_per_step']['median']:.2f} "
            f"ms/step ({result['fill_us_per_row']:.1f} us/row), accept {result['accept_us_per_row']:.1f} us/row"
        )
        print(f"wrote {write_result(args.name + '_fill', result, args.out)}")
        return result
    if not torch.cuda.is_available():
        raise SystemExit("bench.structured times CUDA graphs: it needs a GPU")
    n = args.constrained + args.free
    model = _model(args.layers)
    llm = LLM(
        model=model,
        max_num_seqs=n,
        max_num_batched_tokens=4096,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        warmup=False,
    )
    t0 = time.perf_counter()
    llm.tokenizer = synthetic_tokenizer(model.config.vocab_size)
    prompts = _prompts(n, args.prompt_len, 3 + 256, seed=1)

    def params(constrained: int, max_tokens: int) -> list[SamplingParams]:
        return [
            SamplingParams(
                temperature=args.temperature,
                max_tokens=max_tokens,
                ignore_eos=True,
                seq_seed=i,
                so_args={"schema_type": "json", "schema": SCHEMA} if i < constrained else None,
            )
            for i in range(n)
        ]

    make_seq(llm, prompts[0], params(1, 1)[0])  # compiles the grammar (timed here, once)
    compile_s = time.perf_counter() - t0
    configs = {"free": params(0, args.max_tokens), "mixed": params(args.constrained, args.max_tokens)}
    for name in configs:  # untimed: compiles and captures every graph the timed runs replay
        _run(llm, prompts, configs[name])
    rows: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(args.rounds):
        for name in configs:
            rows[name].append(_run(llm, prompts, configs[name]))
    med = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in rows.items()}
    result = {
        **run_info(argv),
        "model": f"P8 random weights, {args.layers} layers, bf16; synthetic {model.config.vocab_size}-token tokenizer",
        "schema": SCHEMA,
        "tokenizer_and_grammar_s": round(compile_s, 3),
        "rounds": rows,
        "median_tokens_per_s": med,
        "ratio": med["mixed"] / med["free"],
        "graphs": llm.runner.steps.report(),
    }
    mixed = rows["mixed"]
    print(
        f"free {med['free']:.0f} tok/s, mixed {med['mixed']:.0f} tok/s, ratio {result['ratio']:.3f}; "
        f"mask fill {statistics.median(r['mask_us_per_step'] for r in mixed):.0f} us/step, device waited "
        f"{statistics.median(r['mask_wait_us_per_step'] for r in mixed):.0f} us/step for masks"
    )
    print(f"wrote {write_result(args.name, result, args.out)}")
    return result


if __name__ == "__main__":
    main()
