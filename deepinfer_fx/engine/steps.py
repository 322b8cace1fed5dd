"""The engine's step functions: the units that are compiled and captured, each also the eager twin.

A step is its model part (``decode_logits`` / ``prefill_logits``) followed by ``sample_rows``,
which samples every sampled row on the device and writes each token to ``next_token[slot]``;
``decode_step`` / ``prefill_step`` are the two together over a step's input buffer
(``step_inputs.Layout``). Every input is a tensor of a fixed shape per bucket, so one compiled graph (and one CUDA graph)
serves every step of that bucket; padding requests use the state's scratch slot and length 0,
padding rows of a chunk sit past its length (``graphs/batch.py`` says why both are harmless).

- ``decode_logits``: one token per request, read on the device from ``next_token[slot]`` (the
  sampler's output buffer), so the host never handles a sampled token between steps.
- ``prefill_logits``: ``C`` chunks of up to ``L`` prompt tokens, packed ``[C * L]``; logits only for
  ``rows`` (each chunk's last token, or every row when prompt logprobs are asked for). With
  ``kept`` (V4.1 compact prefill, ``graphs/yoco.py``) the decoder replays only each chunk's rows
  from ``keep_from`` on, ``kept`` of them at most.
- ``verify_step``: speculative decoding's step: ``prefill_logits`` over chunks of a request's
  last token and its drafts (exact, every row's logits), then ``spec_accept.accept_rows``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..config import ModelConfig
from ..graphs.batch import Batch, Group
from ..graphs.model import forward_batch
from ..graphs.yoco import Replay
from .sampler import apply_token_mask, logprobs, sample_mode
from .spec_accept import accept_rows
from .step_inputs import Layout, sampling_tensors


class StepOut(NamedTuple):
    """A step's results on the device: a token per sampled row, and with ``logprobs`` the
    chosen token's logprob and the top ``k``; ``logits`` are the step's logit rows (prompt
    logprobs read them)."""

    tokens: torch.Tensor  # [R] int64
    logprob: torch.Tensor | None  # [R]
    top_ids: torch.Tensor | None  # [R, k]
    top_logprobs: torch.Tensor | None  # [R, k]
    logits: torch.Tensor  # [rows, vocab] fp32


def sample_rows(
    logits: torch.Tensor, next_token: torch.Tensor, sampling: torch.Tensor, mode: str, k: int | None,
    vocab_ids: torch.Tensor | None = None, mask: torch.Tensor | None = None,
) -> tuple:
    """Sample the rows a sampling part ``[8, R]`` names from ``logits`` in ``mode``
    (``sampler.MODES``), write each token to ``next_token[write slot]`` and return (tokens,
    logprob, top ids, top logprobs); the last three are None unless ``k`` is given. A token is
    -1 where its row's logits were not finite. ``mask``: structured output's token bitmask
    ``[R, ceil(V / 32)]`` (``engine/structured.py``), applied before sampling; logprobs stay
    those of the model's own distribution, as for every other filter."""
    row, write, t = sampling_tensors(sampling)
    picked = logits[row]
    # a row whose logits are not all finite returns -1 (the host ends its request with an
    # error) and feeds token 0 on, so that a step already launched after it stays in range
    finite = torch.isfinite(picked).all(dim=-1)
    allowed = picked
    if mask is not None:
        ids = vocab_ids if vocab_ids is not None else torch.arange(picked.shape[-1], device=picked.device)
        allowed = apply_token_mask(picked, mask, ids)
    tokens = torch.where(finite, sample_mode(allowed, t, mode, vocab_ids), 0)
    next_token[write] = tokens
    flagged = torch.where(finite, tokens, -1)
    if k is None:
        return flagged, None, None, None
    return (flagged, *logprobs(picked, tokens, k))


class VerifyOut(NamedTuple):
    """A verify step's results on the device: each row's target token ``[C, L]`` and each
    chunk's count of accepted drafts ``[C]``."""

    tokens: torch.Tensor
    accepted: torch.Tensor
    logits: torch.Tensor  # [C * L, vocab] fp32


def verify_step(params: dict, state: dict, c: ModelConfig, next_token: torch.Tensor, layout: Layout, buf: torch.Tensor,
                mode: str, k: int | None = None, vocab_ids: torch.Tensor | None = None) -> VerifyOut:
    """One verify step over its input buffer: every row's logits, then acceptance (``k`` unused:
    requests that ask for logprobs are not speculated)."""
    token_ids, slots, starts, lens, rows, _ = layout.split_model(layout.model_part(buf))
    logits = prefill_logits(params, state, c, token_ids, slots, starts, lens, rows)
    return VerifyOut(*accept_rows(logits, next_token, token_ids, lens, layout.sampling_part(buf), mode, vocab_ids), logits)


def decode_step(params: dict, state: dict, c: ModelConfig, next_token: torch.Tensor, layout: Layout, buf: torch.Tensor,
                mode: str, k: int | None = None, vocab_ids: torch.Tensor | None = None,
                mask: torch.Tensor | None = None) -> StepOut:
    """One decode step over its input buffer: logits, then the sampled tokens."""
    logits = decode_logits(params, state, c, next_token, *layout.split_model(layout.model_part(buf)))
    return StepOut(*sample_rows(logits, next_token, layout.sampling_part(buf), mode, k, vocab_ids, mask), logits)


def prefill_step(params: dict, state: dict, c: ModelConfig, next_token: torch.Tensor, layout: Layout, buf: torch.Tensor,
                 mode: str, k: int | None = None, vocab_ids: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None) -> StepOut:
    """One prefill step over its input buffer: logits at its rows, then the sampled tokens."""
    logits = prefill_logits(params, state, c, *layout.split_model(layout.model_part(buf)), kept=layout.kept)
    return StepOut(*sample_rows(logits, next_token, layout.sampling_part(buf), mode, k, vocab_ids, mask), logits)


def decode_logits(
    params: dict, state: dict, c: ModelConfig, next_token: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """Logits ``[B, vocab]`` of one decode token for each of ``B`` requests at positions ``starts``."""
    index = torch.arange(slots.shape[0], device=slots.device)[:, None]
    batch = Batch(next_token[slots], starts, (Group(index, slots, starts, lens, packed=True),))
    return forward_batch(params, state, c, batch)[0]


def prefill_logits(
    params: dict, state: dict, c: ModelConfig, token_ids: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
    lens: torch.Tensor, rows: torch.Tensor, keep_from: torch.Tensor | None = None, kept: int = 0,
) -> torch.Tensor:
    """Logits ``[R, vocab]`` at packed ``rows`` for ``C`` prompt chunks packed ``[C * L]``; with
    ``kept``, compact prefill from each chunk's ``keep_from`` (a row before it has no logits:
    its result is that chunk's first kept row's, which nothing reads)."""
    n_chunks = slots.shape[0]
    length = token_ids.shape[0] // n_chunks
    index = torch.arange(n_chunks * length, device=slots.device).view(n_chunks, length)
    group = Group(index, slots, starts, lens, packed=True)
    batch = Batch(token_ids, group.positions.reshape(-1), (group,))
    if not kept:
        return forward_batch(params, state, c, batch, rows=rows)[0]
    # packed row r = c * L + j -> kept row c * kept + j - (first kept position - start)
    chunk = torch.div(rows, length, rounding_mode="floor")
    skipped = (torch.minimum(torch.maximum(starts, keep_from), starts + lens) - starts)[chunk]
    kept_rows = chunk * kept + (rows - chunk * length - skipped).clamp(min=0, max=kept - 1)
    return forward_batch(params, state, c, batch, rows=kept_rows, replay=Replay((keep_from,), (kept,)))[0]
