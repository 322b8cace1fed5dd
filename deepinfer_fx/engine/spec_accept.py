"""Lossless acceptance of draft tokens, on the device, with the sampler's per-position noise.

A verify chunk is a request's last token followed by its drafts ``d_1 .. d_m``; row j of its
logits is the target's distribution ``p_j`` for the token after row j. Acceptance walks the
rows in order: draft ``d_{j+1}`` is accepted with probability ``min(1, p_j(d) / q_j(d))``; the
first rejection emits a token from the residual ``max(0, p_j - q_j)`` (normalised) and stops;
when every draft survives, row m's token is the bonus. That keeps each emitted token
distributed as the target alone would sample it (Leviathan et al., Chen et al.).

Drafters without a distribution (n-gram lookup) propose a point mass, ``q = 1`` at ``d``. Then
``min(1, p/q) = p(d)`` and the residual is ``p`` with ``d`` removed, and both come at once from
the sampler's own race: the row's token ``t`` (``sampler.sample_mode``, keyed by the request's
seed and the token's position) equals ``d`` with probability ``p(d)``, and given ``t != d`` it
is distributed as the residual. So acceptance is ``t == d`` and the emitted token is ``t``:
a speculating request samples exactly the tokens it samples without speculation, at any
acceptance, greedy (the argmax) or not. ``accept`` with ``q`` given is the general rule, for
drafters with a distribution; its uniform is drawn from the same counter hash.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..graphs.argmax import first_argmax
from .sampler import SamplingTensors, apply_token_mask, exponentials, hash_bits, logprobs, row_key, sample_mode
from .step_inputs import sampling_tensors


def uniform(seed: Tensor, position: Tensor, vocab: int) -> Tensor:
    """One U(0, 1) float32 per row, from the counter hash at index ``vocab`` (the race's
    exponentials use indices ``0 .. vocab-1``, so the two draws are independent)."""
    key = row_key(seed, position)
    bits = hash_bits(key, torch.full_like(key, vocab))
    k = (bits >> 40) & ((1 << 24) - 1)
    return (k.to(torch.float32) + 0.5) * (2.0**-24)


def accept(
    p: Tensor, q: Tensor, draft: Tensor, seed: Tensor, position: Tensor, vocab_ids: Tensor
) -> tuple[Tensor, Tensor]:
    """The general rule for one draft per row: ``p``, ``q`` ``[R, V]`` probabilities, ``draft``
    ``[R]``. Returns (accepted ``[R]`` bool, token ``[R]``: the draft, or a residual sample)."""
    pd = p.gather(-1, draft[:, None]).squeeze(-1)
    qd = q.gather(-1, draft[:, None]).squeeze(-1)
    ok = uniform(seed, position, p.shape[-1]) * qd < pd  # u < p/q without dividing by a zero q
    residual = (p - q).clamp_min(0)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)  # p == q: never rejected
    key = row_key(seed, position).unsqueeze(-1)
    resampled = first_argmax(residual / exponentials(key, vocab_ids.unsqueeze(0)))
    return ok, torch.where(ok, draft, resampled)


def accept_rows(
    logits: Tensor,
    next_token: Tensor,
    token_ids: Tensor,
    lens: Tensor,
    sampling: Tensor,
    mode: str,
    vocab_ids: Tensor | None = None,
    k: int | None = None,
    mask: Tensor | None = None,
) -> tuple[Tensor, ...]:
    """Point-mass drafts of ``C`` verify chunks of ``L`` rows: ``logits`` ``[C * L, V]``,
    ``token_ids`` ``[C * L]`` (row 0 of a chunk its last token, rows 1.. its drafts), ``lens``
    ``[C]``, a sampling part ``[8, C]``. Returns (tokens ``[C, L]``: row j's target token, -1
    where its logits are not finite; accepted ``[C]``: how many drafts survive; with ``k``, every
    row's target token's logprob ``[C * L]``, top ``k`` ids and logprobs ``[C * L, k]``,
    ``sampler.logprobs``) and writes each chunk's bonus token (row ``accepted``'s) to
    ``next_token[write slot]``. ``mask``: structured output's token bitmask of every row
    ``[C * L, words]`` (row j: after the chunk's first j drafts), applied before the race, so a
    draft the grammar refuses is never the target's token; logprobs stay the model's own."""
    C = lens.shape[0]
    L = token_ids.shape[0] // C
    _, write, t = sampling_tensors(sampling)
    # row offsets from the caller's arange (``sampler.sample_mode`` says why not one made here)
    j = (vocab_ids if vocab_ids is not None else torch.arange(L, device=lens.device))[:L]

    def rows(x: Tensor) -> Tensor:
        return x.repeat_interleave(L)

    per_row = SamplingTensors(
        rows(t.temperature),
        rows(t.top_k),
        rows(t.top_p),
        rows(t.min_p),
        rows(t.seed),
        (t.position[:, None] + 1 + j).reshape(-1),
    )  # row j samples position start + j + 1
    finite = torch.isfinite(logits).all(dim=-1)
    allowed = (
        logits
        if mask is None
        else apply_token_mask(
            logits, mask, vocab_ids if vocab_ids is not None else torch.arange(logits.shape[-1], device=logits.device)
        )
    )
    target = torch.where(finite, sample_mode(allowed, per_row, mode, vocab_ids), -1).view(C, L)
    drafts = token_ids.view(C, L)[:, 1:]
    match = (drafts == target[:, :-1]) & (j[None, 1:] < lens[:, None])
    accepted = match.long().cumprod(dim=1).sum(dim=1)
    bonus = target.gather(1, accepted[:, None]).squeeze(1)
    next_token[write] = bonus.clamp_min(0)  # a non-finite row feeds token 0 on; the host ends it
    if k is None:
        return target, accepted
    return (target, accepted, *logprobs(logits, target.view(-1).clamp_min(0), k))
