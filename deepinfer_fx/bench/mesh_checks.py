"""The correctness half of ``bench/mesh.py``: requests served in two ``generate`` calls (an EPLB
shuffle between them), compared with the one-process reference; the expert counts and how the steps ran."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..engine.llm import LLM
from ..engine.sampling import SamplingParams
from ..sharding.eplb import ExpertPlacement


def _imbalance(placement: ExpertPlacement, loads: torch.Tensor) -> float:
    """Busiest EP rank's share of the measured loads over the mean rank's, under ``placement``."""
    per_rank = placement.rank_loads(loads.cpu())
    return round(float(per_rank.max() / per_rank.mean()), 4)


def serve(llm: LLM, prompts: list[list[int]], params: SamplingParams, rebalance: bool) -> tuple[list, dict | None]:
    """(token ids, logprobs) per request, served in two ``generate`` calls; with ``rebalance``
    the experts are re-placed between them (every rank calls this alike)."""
    half = len(prompts) // 2
    outs = llm.generate(prompts[:half], params)
    shuffle = None
    if rebalance:
        ep = llm.ranks.ep
        loads = ep.loads.clone()
        dist.all_reduce(loads, group=ep.process_group)  # what rebalance plans from: the EP group's sum
        before = ep.placement
        llm.rebalance_experts()
        after = llm.ranks.ep.placement
        shuffle = {
            "slots_moved": sum(a != b for a, b in zip(before.phys_to_logical, after.phys_to_logical)),
            "rank_load_imbalance_before": _imbalance(before, loads),
            "rank_load_imbalance_after": _imbalance(after, loads),
        }
    outs += llm.generate(prompts[half:], params)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], shuffle


def compare(got: list, want: list, tol: float) -> dict[str, Any]:
    """Greedy outputs against the reference, as vLLM's ``check_logprobs_close`` judges them:
    logprobs are compared on the entries both hold up to and including each request's first
    differing token (after it the contexts differ); a differing token passes only as a near-tie
    flip, where each run holds the other's token among its top entries and the reference's two
    candidates lie within ``tol`` of each other (a random-weight model has many such ties, and
    bf16 on a different batch split breaks them either way)."""
    mismatched, diff = [], 0.0
    for i, ((ids, lps), (ref_ids, ref_lps)) in enumerate(zip(got, want)):
        first = next((j for j, (a, b) in enumerate(zip(ids, ref_ids)) if a != b), min(len(ids), len(ref_ids)))
        for a, b in zip(lps[: first + 1], ref_lps[: first + 1]):
            diff = max([diff] + [abs(a[k] - b[k]) for k in a.keys() & b.keys()])
        if ids != ref_ids:
            tie = first < min(len(ids), len(ref_ids)) and _near_tie(
                lps[first], ref_lps[first], ids[first], ref_ids[first], tol
            )
            mismatched.append({"request": i, "first_differing_token": first, "near_tie": tie})
    ties = sum(m["near_tie"] for m in mismatched)
    return {
        "tokens_equal": not mismatched,
        "near_tie_flips": ties,
        "mismatched": mismatched,
        "max_logprob_diff": diff,
        "logprob_tol": tol,
        "ok": ties == len(mismatched) and len(got) == len(want) and diff <= tol,
    }


def _near_tie(lp: dict, ref_lp: dict, tok: int, ref_tok: int, tol: float) -> bool:
    return tok in ref_lp and ref_tok in lp and ref_lp[ref_tok] - ref_lp[tok] <= tol and lp[tok] - lp[ref_tok] <= tol


def expert_counts(llm: LLM) -> dict[str, Any]:
    p, extra = llm.ranks.ep.placement, llm.settings.extra_experts
    return {
        "n_logical": p.n_logical,
        "extra_asked": extra,
        "n_physical": p.n_physical,
        "ep": p.ep_degree,
        "slots_per_rank": p.slots_per_rank,
        "rounded_to_ep": p.n_physical % p.ep_degree == 0
        and p.n_logical + extra <= p.n_physical < p.n_logical + extra + p.ep_degree,
    }


def steps_kind(llm: LLM) -> str:
    """How the engine steps: "compiled" or "eager" (the reference math)."""
    return "compiled" if llm.options.steps.compiled else "eager"
