"""The MTP-1 block (``mtp.{s}``) of V4-Flash / V4-Pro: predicts token t+2 from the target's
final streams at t and the embedding of token t+1. A window-only block with its own
``hc_head`` and norm, sharing the target's embedding and output head.

``mtp_draft`` is the block as speculative decoding's drafter (``engine/spec_decode.py``),
run after every target step over that step's rows: a row at position p whose next token is
known (a prompt token, the step's sample, or an accepted draft) writes the block's window
entry at p, and the last such row of each chunk drafts greedily, chained through the same
block for further drafts. A chunk's last row may have no known next token (a prompt chunk
before the prompt's end): its streams wait in ``state["mtp"][0]["pending"]`` and run as the
next chunk's first row. The chained rows sit at positions a later verify may reject, so their
window rows are put back once the chain is done: the block's window only ever holds verified
positions, and rejected drafts leave nothing in it to roll back.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .argmax import first_argmax
from .batch import Batch, Group, make_batch
from .model import block, head
from .norm import held, linear, rms_norm


def mtp_forward_batch(
    params: dict,
    state: dict,
    c: ModelConfig,
    X: torch.Tensor,
    batch: Batch,
    stage: int = 0,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """X ``[N, hc, D]``: target streams at the batch's positions; ``batch.token_ids``: the token
    after each position. Returns fp32 logits ``[N, vocab]`` (or at packed ``rows`` only) for the
    token after that, and the block's output streams (fed back as X to chain further steps)."""
    mp, ms = params["mtp"][stage], state["mtp"][stage]
    eps = c.rms_norm_eps
    e = rms_norm(params["embed"][batch.token_ids].to(X.dtype), mp["enorm"], eps)
    Y = linear(rms_norm(X, mp["hnorm"], eps), *held(mp, "h_proj")) + linear(e, *held(mp, "e_proj"))[:, None, :]
    Y, _ = block(mp, [ms], c, Y, batch, 0, 0)
    return head(params, c, Y if rows is None else Y[rows], head_prefix=mp, draft=True), Y


def mtp_forward(
    params: dict,
    state: dict,
    c: ModelConfig,
    X: torch.Tensor,
    next_ids: torch.Tensor,
    start: int,
    stage: int = 0,
    slot: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's form of ``mtp_forward_batch`` (positions ``start..``, state ``slot``)."""
    return mtp_forward_batch(params, state, c, X, make_batch([next_ids], [slot], [start], X.device), stage)


def mtp_draft(
    params: dict,
    state: dict,
    c: ModelConfig,
    X: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    first: torch.Tensor,
    nexts: torch.Tensor,
    known: torch.Tensor,
    pending: torch.Tensor,
    n_drafts: int,
) -> torch.Tensor:
    """Greedy drafts ``[C, n_drafts]`` after a target step of ``C`` chunks of ``L`` rows.

    ``X`` ``[C * L, hc, D]``: the step's final streams, chunk c's rows at positions
    ``starts[c] ..`` (``lens[c]`` of them); ``first`` ``[C]``: each chunk's first input token;
    ``nexts`` ``[C, L]``: the token after each row; ``known`` ``[C]``: how many leading rows have
    that token (the last of them drafts); ``pending`` ``[C]`` bool: the chunk's position
    ``start - 1`` still waits for its block row (its streams in ``pending``, its next token
    ``first``). Padding chunks (scratch slot, length 0) draft from row 0 and write nothing real."""
    ms = state["mtp"][0]
    C, L = nexts.shape
    hc, D = X.shape[-2:]
    # rows of each chunk: the pending one (if any), then the chunk's own, packed from index 0
    shift = (~pending).long()
    src = (torch.arange(L + 1, device=X.device)[None] + shift[:, None]).clamp(max=L)
    Xc = torch.cat([ms["pending"][slots][:, None].to(X.dtype), X.view(C, L, hc, D)], dim=1)
    Xc = Xc.gather(1, src[:, :, None, None].expand(C, L + 1, hc, D))
    tokens = torch.cat([first[:, None], nexts], dim=1).gather(1, src)
    n_rows = pending.long() + known
    group = Group(
        torch.arange(C * (L + 1), device=X.device).view(C, L + 1), slots, starts - pending.long(), n_rows, packed=True
    )
    batch = Batch(tokens.reshape(-1), group.positions.reshape(-1), (group,))
    last = (n_rows - 1).clamp(min=0)
    logits, Y = mtp_forward_batch(
        params, state, c, Xc.reshape(-1, hc, D), batch, rows=torch.arange(C, device=X.device) * (L + 1) + last
    )
    # the streams of each chunk's last row wait for the next chunk (used when this one samples nothing)
    ms["pending"][slots] = X.view(C, L, hc, D)[torch.arange(C, device=X.device), (lens - 1).clamp(min=0)].to(
        ms["pending"].dtype
    )
    drafts = [first_argmax(logits)]
    if n_drafts == 1:
        return drafts[0][:, None]
    # the chain: one row per chunk at the positions after its last known row's next token
    ring = ms["window"]
    at = starts - pending.long() + last + 1
    idx = torch.remainder(at[:, None] + torch.arange(n_drafts - 1, device=X.device)[None], ring.shape[1])
    saved = ring[slots[:, None], idx].clone()
    Yc = Y.view(C, L + 1, hc, D)[torch.arange(C, device=X.device), last]
    live = (n_rows > 0).long()
    for j in range(n_drafts - 1):
        step = Group(torch.arange(C, device=X.device)[:, None], slots, at + j, live, packed=True)
        logits, Yc = mtp_forward_batch(params, state, c, Yc, Batch(drafts[-1], at + j, (step,)))
        drafts.append(first_argmax(logits))
    ring[slots[:, None], idx] = saved
    return torch.stack(drafts, dim=1)
