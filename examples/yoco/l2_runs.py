"""The runs ``l2.py`` compares (one process and every rank of ``l2_mesh.py`` alike): one
teacher-forced pass over a prompt and its forced decode tokens, exact or compact, with the
DSpark drafter after every row where the model has one, and the per-position comparison."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer_fx.api import Model
from deepinfer_fx.graphs.batch import make_batch
from deepinfer_fx.graphs.dspark import dspark_propose
from deepinfer_fx.graphs.dspark_context import context_rows, dspark_capture
from deepinfer_fx.graphs.model import forward_batch
from deepinfer_fx.graphs.state import init_state
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.graphs.yoco import kept_rows, replay_for


@dataclass(frozen=True)
class Run:
    """One teacher-forced pass: a row per position (the prompt's last, then each decode step)."""

    logprobs: torch.Tensor  # [1 + decode, vocab] fp32
    drafts: torch.Tensor | None = None  # [1 + decode, block]: the greedy DSpark block drafted after the row
    confidences: torch.Tensor | None = None  # [1 + decode, block] fp32: its confidence head's scores


def has_dspark(model: Model) -> bool:
    """The config names DSpark stages and the checkpoint held their weights (``mtp.0.main_proj``)."""
    mtp = model.params.get("mtp") or [{}]
    return bool(model.config.dspark_stages) and "main_proj" in mtp[0]


def forced_ids(vocab: int, n_prompt: int, decode: int, seed: int, device: str | torch.device) -> torch.Tensor:
    """A random prompt, its ``decode`` forced tokens and one more: the token the last row predicts,
    which the drafter after that row starts its block from (ids 0..2 are BOS, EOS, Engram's pad)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n_prompt + decode + 1,), generator=gen).to(device)


@torch.no_grad()
def teacher_forced(
    model: Model,
    ids: torch.Tensor,
    n_prompt: int,
    keep: int | None,
    chunk: int,
    dspark: bool = False,
    swaps: dict[str, Callable] | None = None,
) -> Run:
    """Prefill ``ids[:n_prompt]`` in chunks of ``chunk`` (compact with KEEP ``keep``; None: exact)
    into a fresh state, then decode ``ids[n_prompt:-1]`` one token a step. ``dspark``: after every
    row, write the drafter's context for the step's rows and draft a block from the forced next
    token, as the engine does after each step (``engine/steps.dspark_drafts``). ``swaps`` stand in
    for model functions during the target forwards only (a mesh's expert-parallel MoE): the
    drafter keeps its own experts whole on every rank, so it runs outside them."""
    c, params = model
    state = init_state(c, ids.numel() + 1, model.dtype, device=model.device, mtp=dspark)
    drafts, confidences = [], []

    def step(start: int, end: int, replay: bool) -> torch.Tensor:
        b = make_batch([ids[start:end]], [0], [start], model.device)
        rp = replay_for(b, [n_prompt], keep) if replay else None
        captured = dspark_capture(c) if dspark else None
        with swapped(swaps or {}):
            logits, _ = forward_batch(params, state, c, b, captured=captured, replay=rp)
        if dspark:
            # compact: the captured streams are the kept rows' only, laid out as yoco.kept_rows' batch
            g = b.groups[0] if rp is None else kept_rows(b, rp).batch.groups[0]
            context_rows(params, state, c, captured, g, g.lens)
        return logits

    def draft(position: int) -> None:  # the block from the forced token at ``position`` (context up to the one before)
        if dspark:
            d = dspark_propose(params, state, c, ids[position : position + 1], torch.tensor([position]), [0])
            drafts.append(d.tokens)
            confidences.append(d.confidences)

    for start in range(0, n_prompt, chunk):
        logits = step(start, min(start + chunk, n_prompt), keep is not None)
    rows = [logits[-1:]]  # the prompt's last row (the last chunk's)
    draft(n_prompt)
    for p in range(n_prompt, ids.numel() - 1):
        rows.append(step(p, p + 1, False))
        draft(p + 1)
    lp = torch.cat(rows).float().log_softmax(-1)
    if not dspark:
        return Run(lp)
    return Run(lp, torch.cat(drafts), torch.cat(confidences))


def bitwise(a: Run, b: Run) -> bool:
    """Every compared quantity identical, bit for bit."""
    same = torch.equal(a.logprobs, b.logprobs)
    if a.drafts is not None and b.drafts is not None:
        same = same and torch.equal(a.drafts, b.drafts) and torch.equal(a.confidences, b.confidences)
    return same


def _sig(x: float) -> float:
    return float(f"{x:.3g}")  # 3 significant digits: the drift can be 1e-7, which rounding to places would zero


def compare(a: Run, b: Run, forced: torch.Tensor) -> list[dict]:
    """Per position: max |a - b| over the vocabulary, the forced token's difference, same argmax;
    with drafts: the same greedy block, and max |confidence a - confidence b| over it."""
    d = (a.logprobs - b.logprobs).abs()
    rows = []
    for i in range(d.shape[0]):
        row = {
            "position": i,
            "max_abs": _sig(d[i].max().item()),
            "forced_abs": _sig(d[i, forced[i]].item()),
            "same_argmax": bool(a.logprobs[i].argmax() == b.logprobs[i].argmax()),
        }
        if a.drafts is not None and b.drafts is not None:
            row["same_drafts"] = torch.equal(a.drafts[i], b.drafts[i])
            row["conf_abs"] = _sig((a.confidences[i] - b.confidences[i]).abs().max().item())
        rows.append(row)
    return rows


def summary(rows: list[dict]) -> dict:
    """The worst position and the share of positions that agree."""
    out = {
        "max_abs": max(r["max_abs"] for r in rows),
        "argmax_agree": sum(r["same_argmax"] for r in rows) / len(rows),
    }
    if "same_drafts" in rows[0]:
        out["drafts_agree"] = sum(r["same_drafts"] for r in rows) / len(rows)
        out["conf_max_abs"] = max(r["conf_abs"] for r in rows)
    return out


def rank_result(rank: int, seed: int, dspark: bool, compact: Run, exact: Run, ref: Run, forced: torch.Tensor) -> dict:
    """One rank's L2 result: compact against exact per position, and ``ref`` against exact as the
    reference (the other chunking's noise floor in one process; one process on a mesh)."""
    rows, refs = compare(compact, exact, forced), compare(ref, exact, forced)
    return {
        "rank": rank,
        "seed": seed,
        "dspark": dspark,
        **summary(rows),
        "reference_max_abs": summary(refs)["max_abs"],
        "reference_summary": summary(refs),
        "bitwise": bitwise(compact, exact),
        "rows": rows,
        "reference": refs,
    }


def print_rows(first: int, rows: list[dict], ref: list[dict], ref_name: str) -> None:
    """The per-position table: compact vs exact, beside a reference comparison's max |dlogprob|."""
    dspark = "same_drafts" in rows[0]
    head = f"{'pos':>5} {'max|dlp|':>10} {'forced':>10} {'argmax':>6}"
    print(head + (f" {'drafts':>6} {'max|dconf|':>10}" if dspark else "") + f" {ref_name:>10}")
    for r, f in zip(rows, ref):
        line = f"{first + r['position']:>5} {r['max_abs']:>10.2e} {r['forced_abs']:>10.2e} {str(r['same_argmax']):>6}"
        if dspark:
            line += f" {str(r['same_drafts']):>6} {r['conf_abs']:>10.2e}"
        print(line + f" {f['max_abs']:>10.2e}")
