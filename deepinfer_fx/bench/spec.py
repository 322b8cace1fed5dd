"""Speculative decoding on one GPU: the verify step's cost, and drafting end to end.

    python -m deepinfer_fx.bench.spec --batches 1,8,64 --drafts 1,2,3,4,5 --name spec_s31
    python -m deepinfer_fx.bench.spec --method mtp --name spec_mtp
    python -m deepinfer_fx.bench.spec --method dspark --name spec_dspark   # the V4.1-width bench model
    python -m deepinfer_fx.bench.spec --method dspark --yoco-mode off --name spec_dspark_exact
    python -m deepinfer_fx.bench.spec --method dspark --config v41_deep --expert-format fp4 --dense-format fp8 \
        --drafts 3 --batches 1,8,64 --e2e-batches '' --lean   # the released depth: the drafter's real share
    python -m deepinfer_fx.bench.spec --method mtp --config p8_deep --expert-format fp4 --dense-format fp8 \
        --drafts 3 --batches 1,8,64 --e2e-batches '' --lean   # MTP-1 at V4-Flash's depth
    python -m deepinfer_fx.bench.spec --method dspark --config v41_deep --expert-format fp4 --dense-format fp8 \
        --drafts 3 --batches 1 --e2e-batches '' --lean --draft-head model,fp8   # the head as stored, then in FP8

Verify cost: for each draft count k (an engine built with ``num_speculative_tokens=k``, whose
verify chunks are padded to k + 1 rows) and batch b, the captured verify step of b chunks of k + 1
rows against the plain captured decode step of b requests and of b * (k + 1) requests, each its own
text (the issue's target: verify <= 1.1x decode of b * (k + 1) rows). A rejection costs nothing more: the
state's rings keep room for the rejected rows (``graphs/state.py``), so there is no snapshot and no re-run.
With ``--method ngram`` the drafter is not in these numbers (it runs on the host); with
``--method mtp`` (P8 with an MTP-1 block) or ``dspark`` (``bench/configs.py``'s V4.1 widths, its
default compact prefill, or ``--yoco-mode off``) the verify step carries the model's drafter
(``steps.propose_drafts``), timed with and without it (``verify_ms`` / ``verify_no_drafter_ms``);
the decode baselines run without it. ``--profile`` lists each row's kernels (verify with and
without the drafter, and the plain decode of b * (k + 1) rows): where the difference goes.

End to end: ``generate`` with and without ``speculative_config={"method": ...}`` on a
repetitive workload, tokens/s of each and the measured acceptance. Random weights never
repeat themselves, so ``--workload cycling`` (the default) gives the model a head that follows
each token t by 3 * (t // 3) + (t + 1) % 3 (its greedy text cycles, as in the tests), and the
prompts a pattern that is not that cycle; for ``mtp`` the MTP block's next-token embedding
path, for ``dspark`` the Markov head, is set to draft that cycle (``drafting``: a synthetic
drafter, as in ``tests/engine/test_spec_drafters.py``); ``--workload random`` runs the random model
and its own drafter on random prompts instead, where nearly every draft is rejected: what
speculation costs when it fails; ``--model`` runs a real checkpoint on ``--prompt`` text. Both DeepInfer's formula (steps/s x batch x (1 + nextn) / cp: full acceptance)
and the measured rate are reported, named as such.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
import sys
import time

import torch

from ..api import Model, random_model
from ..engine.llm import LLM
from ..engine.request import Sequence
from ..engine.sampling import SamplingParams
from ..engine.spec_decode import SpecStats
from ..engine.step_arena import DecodeRow, VerifyChunk
from .configs import bench_config, check_held_to_fit, held_as_released
from .e2e import _prompts
from .p8 import run_info, write_result
from .timing import kernel_table, timed


def cycling(model: Model) -> Model:
    """``model`` whose greedy text cycles through three tokens (see the module docstring)."""
    c, params = model
    params = {**params, "embed": params["embed"] * 20}
    t = torch.arange(c.vocab_size, device=params["embed"].device)
    # the last vocab_size % 3 ids map to themselves: a cycle of three needs three ids
    after = torch.where(t < 3 * (c.vocab_size // 3), 3 * (t // 3) + (t + 1) % 3, t)
    inverse = torch.empty_like(after)
    inverse[after] = t
    params["head"] = params["embed"][inverse].contiguous()
    return Model(c, params)


def drafting(model: Model) -> Model:
    """``cycling(model)`` whose drafter drafts the cycle: MTP-1's next-token embedding path scaled
    up (``e_proj`` 20 I) and its streams path off; DSpark's Markov head scoring the cycle's next
    token at 1000 (unit embeddings, so a token's own row scores highest)."""
    c, params = cycling(model)
    if not c.dspark_stages:
        e = params["mtp"][0]["e_proj"]
        mp = {
            **params["mtp"][0],
            "e_proj": torch.eye(c.hidden_size, dtype=e.dtype, device=e.device) * 20,
            "h_proj": torch.zeros_like(params["mtp"][0]["h_proj"]),
        }
        return Model(c, {**params, "mtp": [mp]})
    last = dict(params["mtp"][-1])
    E = last["markov_head"]["embed"]
    t = torch.arange(c.vocab_size, device=E.device)
    after = torch.where(t < 3 * (c.vocab_size // 3), 3 * (t // 3) + (t + 1) % 3, t)
    inverse = torch.empty_like(after)
    inverse[after] = t
    unit = torch.nn.functional.normalize(E.float(), dim=-1).to(E.dtype)
    last["markov_head"] = {"embed": unit, "head": unit[inverse] * 1000}
    return Model(c, {**params, "mtp": params["mtp"][:-1] + [last]})


# the bench models each method drafts on: P8's layouts (V4), or V4.1's with the DSpark head
_FAMILY = {"ngram": "p8", "mtp": "p8", "dspark": "v41"}


def bench_model(
    method: str, layers: int | None, expert_format: str = "bf16", config: str | None = None, dense_format: str = "bf16"
) -> Model:
    """The bench model ``config`` (``bench/configs.py``; default ``p8``, or ``v41`` for
    ``dspark``) cut to ``layers``, with an MTP-1 block for ``mtp`` (the V4.1 models carry their
    DSpark head); ``expert_format`` "fp4": routed experts (the drafter's too) held as MXFP4, as
    released; ``dense_format`` "fp8": dense projections in block FP8."""
    c = bench_config(config or _FAMILY[method], layers, mtp=method == "mtp")
    return random_model(held_as_released(c, expert_format, dense_format), seed=0, dtype=torch.bfloat16, device="cuda")


def _top_kernels(fn: Callable[[], object], steps: int, top: int = 25) -> dict:
    """The ``top`` kernels of one call of ``fn`` by time (``timing.kernel_table``), and their sum."""
    rows, step_us, launches = kernel_table(fn, steps)
    return {"kernel_us": round(step_us, 1), "launches": launches, "kernels": rows[:top]}


def verify_rows(
    llm: LLM, batch: int, k: int, prompt_len: int, iters: int, profile: bool = False, lean: bool = False
) -> dict:
    """The verify step of ``batch`` chunks of ``k`` drafts against plain decode steps. ``lean``:
    the steps read the slots' states as allocated (zeros) rather than prompts' (every read is by
    position, so the same bytes and work; no prefill graph to compile), and the plain decode of
    ``batch`` rows is left out: the fewest graphs, for depths where each compiles for minutes."""
    c = llm.model.config
    if not lean:  # states to read: one request a row of the widest decode, each row its own text
        prompts = _prompts(batch * (k + 1), prompt_len, c.vocab_size, seed=batch)
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    probe = Sequence(-1, None, [0], SamplingParams(temperature=0.0), 7)
    steps = llm.runner.steps

    # a plain decode row's input is its slot's last sampled token; each timed step first sets
    # them to random ids, as the verify chunks' rows are, so both route like independent
    # tokens (with the random model's own tokens the plain step's experts ran 13 % shorter on
    # the same rows: docs/decisions.md, session 46)
    ids_by_slot = torch.randint(0, c.vocab_size, (batch * (k + 1),), device=llm.runner.next_token.device)

    def plain(n: int) -> Callable[[], object]:  # plain decode of n requests: without the drafter
        dec = [DecodeRow(i, prompt_len, probe.controls) for i in range(n)]

        def run() -> object:
            llm.runner.next_token[:n].copy_(ids_by_slot[:n])
            return steps.step(dec, (), "greedy", draft=False)

        return run

    def decode(n: int) -> float:
        return timed(plain(n), iters) * 1e3

    base = None if lean else decode(batch)
    # a token and k drafts of random ids a chunk: rows of one text, routed as such
    ids = torch.randint(0, c.vocab_size, (batch, k + 1), generator=torch.Generator().manual_seed(k)).tolist()
    chunks = [VerifyChunk(s, prompt_len, ids[s], probe.controls) for s in range(batch)]
    verify = timed(lambda: steps.verify(chunks, "greedy"), iters) * 1e3
    bare = timed(lambda: steps.verify(chunks, "greedy", draft=False), iters) * 1e3 if steps.n_drafts else verify
    wide = decode(batch * (k + 1))
    row = {
        "batch": batch,
        "drafts": k,
        "verify_ms": round(verify, 3),
        "decode_wide_ms": round(wide, 3),
        "verify_over_decode_wide": round(verify / wide, 3),
    }
    if base is not None:
        row.update(decode_ms=round(base, 3), verify_over_decode=round(verify / base, 3))
    if steps.n_drafts:
        row["verify_no_drafter_ms"] = round(bare, 3)
    print(row, flush=True)
    if profile:  # where the verify step's time goes against the plain step of as many rows
        row["profile"] = {
            "verify": _top_kernels(lambda: steps.verify(chunks, "greedy", draft=False), iters),
            "decode_wide": _top_kernels(plain(batch * (k + 1)), iters),
        }
        if steps.n_drafts:
            row["profile"]["verify_with_drafter"] = _top_kernels(lambda: steps.verify(chunks, "greedy"), iters)
    return row


def e2e_rows(model: Model, batch: int, spec: dict, prompts: list, max_tokens: int, seqs: int, yoco: dict) -> dict:
    """Tokens/s of ``generate`` on ``prompts[:batch]`` without and with ``speculative_config=spec``."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    k = spec["num_speculative_tokens"]
    out = {"batch": batch, "nextn": k, "method": spec["method"], "draft_head": spec.get("draft_head", "model")}
    for name, cfg in (("plain", None), ("spec", spec)):
        llm = LLM(
            model=model,
            max_num_seqs=seqs,
            max_num_batched_tokens=4096,
            max_model_len=2048,
            warmup=False,
            speculative_config=cfg,
            **yoco,
        )
        llm.generate(prompts[:batch], params)  # compiles and captures what the timed run replays
        if llm.speculator is not None:
            llm.speculator.stats = SpecStats()  # the timed run's acceptance only
        t0 = time.perf_counter()
        outs = llm.generate(prompts[:batch], params)
        wall = time.perf_counter() - t0
        first = max(o.metrics.first_token_time for o in outs)
        last = max(o.metrics.finished_time for o in outs)
        st = llm.last_stats
        decode_steps = st.steps - 1  # the prefill step
        row = {
            "measured_tok_s": round(batch * (max_tokens - 1) / (last - first), 1),
            "steps": st.steps,
            "wall_s": round(wall, 3),
            "host_us_per_step": round(st.host_us_per_step, 1),
        }
        if cfg is not None:
            s = llm.speculator.stats
            steps_s = decode_steps / (last - first)
            row.update(
                {
                    "acceptance": round(s.accepted_tokens / max(s.draft_tokens, 1), 3),
                    "mean_accepted_length": round(s.mean_accepted_length, 3),
                    "accepted_per_position": [round(a / p, 3) for a, p in zip(s.accepted_at, s.proposed_at)],
                    "deepinfer_formula_tok_s": round(steps_s * batch * (1 + k), 1),
                    "summary": s.summary(),
                }
            )
        out[name] = row
        del llm
        torch.cuda.empty_cache()
    out["speedup_measured"] = round(out["spec"]["measured_tok_s"] / out["plain"]["measured_tok_s"], 3)
    print(out, flush=True)
    return out


@torch.no_grad()
def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--drafts", default="1,2,3,4,5", help="bare verify rows per draft count ('': end to end only)")
    ap.add_argument(
        "--method",
        choices=["ngram", "mtp", "dspark"],
        default="ngram",
        help="the drafter (mtp: P8's MTP-1 block; dspark: the V4.1-width model's DSpark head)",
    )
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--layers", type=int, default=None, help="a cut of the --config model (default: all its layers)")
    ap.add_argument(
        "--config",
        choices=["p8", "p8_deep", "v41", "v41_deep"],
        default=None,
        help="the bench model (bench/configs.py): ngram and mtp run p8 (default, 8 layers) or p8_deep (V4-Flash's "
        "43-layer layout), dspark v41 (default, 10 layers) or v41_deep (the released 40-layer layout); the deep ones "
        "held as released",
    )
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--e2e-batches", default="1,8", help="end-to-end batches ('': the verify rows only)")
    ap.add_argument("--nextn", type=int, default=4, help="drafts per step end to end")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument(
        "--workload",
        choices=["cycling", "random"],
        default="cycling",
        help="cycling: drafts that follow the text; random: the random model's own drafts, nearly all rejected",
    )
    ap.add_argument("--model", default=None, help="a checkpoint for the end-to-end part (default: P8 random, cycling)")
    ap.add_argument("--prompt", default="1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4,", help="with --model: the repeated prompt")
    ap.add_argument(
        "--yoco-mode", choices=["compact", "off"], default=None, help="V4.1's prefill (default: compact, as the engine)"
    )
    ap.add_argument(
        "--expert-format",
        choices=["bf16", "fp4"],
        default="bf16",
        help="fp4: routed experts (the drafter's too) held as MXFP4, as the checkpoints store them",
    )
    ap.add_argument(
        "--dense-format",
        choices=["bf16", "fp8"],
        default="bf16",
        help="fp8 holds the dense projections in block FP8, as the checkpoints store them",
    )
    ap.add_argument(
        "--draft-head",
        default="model",
        help="mtp / dspark: the output heads the drafter reads, each a run of every row (model, fp8 or "
        "model,fp8; fp8: a block-FP8 copy, speculative_config['draft_head'])",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="also list each verify row's kernels: the verify step (with and without the drafter) and the plain "
        "decode of as many rows",
    )
    ap.add_argument(
        "--lean",
        action="store_true",
        help="verify rows: no prompts prefilled (the states as allocated, read by position as filled ones are) and "
        "no plain decode of b rows: the fewest graphs to compile, for the released depth",
    )
    ap.add_argument("--out", default="bench/results/latest")
    ap.add_argument("--name", default="spec")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    family = _FAMILY[args.method]
    config = args.config or family
    if config not in (family, f"{family}_deep"):
        ap.error(f"--method {args.method} drafts on the {family} bench models (--config {family} or {family}_deep)")
    heads = args.draft_head.split(",")
    if not heads or any(h not in ("model", "fp8") for h in heads) or len(set(heads)) < len(heads):
        ap.error(f"--draft-head: model, fp8 or model,fp8, got {args.draft_head!r}")
    if heads != ["model"] and args.method == "ngram":
        ap.error("--draft-head: the n-gram drafter reads no head; use --method mtp or dspark")
    specs = [{"method": args.method} if h == "model" else {"method": args.method, "draft_head": h} for h in heads]
    try:
        check_held_to_fit(config, args.expert_format, args.dense_format)
        bench_config(config, args.layers)
    except ValueError as e:
        ap.error(str(e))
    if not torch.cuda.is_available():
        raise SystemExit("bench.spec times CUDA graphs: it needs a GPU")
    drafter = {"ngram": "", "mtp": " and an MTP-1 block", "dspark": " with its DSpark head"}[args.method]
    result = {
        **run_info(argv),
        "model": f"bench_config({config!r}, {args.layers}) random weights{drafter}, bf16"
        + (f", {args.yoco_mode or 'compact'} prefill" if args.method == "dspark" else "")
        + (", MXFP4 experts" if args.expert_format == "fp4" else "")
        + (", FP8 dense" if args.dense_format == "fp8" else "")
        + ("" if heads == ["model"] else f", draft heads {args.draft_head}"),
    }
    yoco = {} if args.yoco_mode is None else {"yoco_mode": args.yoco_mode}
    batches, drafts = [int(b) for b in args.batches.split(",")], [int(k) for k in args.drafts.split(",") if k]
    model = bench_model(args.method, args.layers, args.expert_format, config, args.dense_format)
    result["method"] = args.method
    result["verify"], result["graphs"] = [], []
    # one engine a draft count and head: its verify chunks are padded to k + 1 rows (the target's
    # graphs of a second head are the saved steps of the first, where DEEPINFER_CACHE_DIR keeps them)
    for spec in specs:
        for k in drafts:
            llm = LLM(
                model=model,
                max_num_seqs=max(batches) * (k + 1),
                max_num_batched_tokens=4096,
                max_model_len=args.prompt_len + 64,
                warmup=False,
                speculative_config={**spec, "num_speculative_tokens": k},
                **yoco,
            )
            for b in batches:
                row = verify_rows(llm, b, k, args.prompt_len, args.iters, args.profile, args.lean)
                result["verify"].append({"draft_head": spec.get("draft_head", "model"), **row})
                write_result(args.name, result, args.out)  # what is measured survives a stop
            result["graphs"] += llm.runner.steps.report()
            del llm
            torch.cuda.empty_cache()
    e2e_batches = [int(b) for b in args.e2e_batches.split(",") if b]
    if not e2e_batches:
        print(f"wrote {write_result(args.name, result, args.out)}")
        return result
    if args.model is None and args.workload == "random":
        e2e_model = model
        prompts = _prompts(max(e2e_batches), 128, model.config.vocab_size, seed=1)
        result["e2e_workload"] = result["model"] + ", its own drafter; random 128-token prompts"
    elif args.model is None:
        e2e_model = cycling(model) if args.method == "ngram" else drafting(model)
        prompts = [([5, 6, 7, 8] * 32 + [7]) for _ in range(max(e2e_batches))]
        result["e2e_workload"] = (
            result["model"]
            + ", the cycling head"
            + (", a drafting " + args.method if args.method != "ngram" else "")
            + "; prompts [5, 6, 7, 8] * 32 + [7]"
        )
    else:
        probe = LLM(args.model, max_model_len=2048, warmup=False)
        e2e_model, prompts = probe.model, [args.prompt] * max(e2e_batches)
        result["e2e_workload"] = f"{args.model}, prompt {args.prompt!r}"
        del probe
    result["e2e"] = []
    for spec in specs:
        for b in e2e_batches:
            e2e_spec = {**spec, "num_speculative_tokens": args.nextn}
            result["e2e"].append(e2e_rows(e2e_model, b, e2e_spec, prompts, args.max_tokens, max(e2e_batches), yoco))
            write_result(args.name, result, args.out)
    print(f"wrote {write_result(args.name, result, args.out)}")
    return result


if __name__ == "__main__":
    main()
