"""The engine's step functions: the pieces that are compiled and captured (eager: run as they are).

A step is its model part (``decode_logits`` / ``prefill_logits``) followed by ``sample_rows``,
which samples every sampled row on the device and writes each token to ``next_token[slot]``
(``graph_runner.StepGraphs`` puts them together over a step's input buffer,
``step_inputs.Layout``). Every input is a tensor of a fixed shape per bucket, so one compiled graph (and one CUDA graph)
serves every step of that bucket; padding requests use the state's scratch slot and length 0,
padding rows of a chunk sit past its length (``graphs/batch.py`` says why both are harmless).

- ``decode_logits``: one token per request, read on the device from ``next_token[slot]`` (the
  sampler's output buffer), so the host never handles a sampled token between steps.
- ``prefill_logits``: ``C`` chunks of up to ``L`` prompt tokens, packed ``[C * L]``; logits only for
  ``rows`` (each chunk's last token, or every row when prompt logprobs are asked for). With
  ``kept`` (V4.1 compact prefill, ``graphs/yoco.py``) the decoder replays only each chunk's rows
  from ``keep_from`` on, ``kept`` of them at most (and DSpark's context comes from those rows).
- A verify step (speculative decoding): ``prefill_logits`` over chunks of a request's last token
  and its drafts (exact, every row's logits), then ``spec_accept.accept_rows`` (and with ``k``
  every row's logprobs, of which the host keeps the emitted tokens'), then ``verify_out``.
- ``n_drafts`` > 0 (speculative decoding with the model's drafter): after sampling or
  acceptance, ``propose_drafts`` runs the drafter over the step's rows and returns each chunk's
  next drafts (``StepOut.drafts``), so the drafter costs no step of its own: the MTP-1 block
  (V4) over the rows whose next token is now known, or DSpark (V4.1, V4-Flash-0731) writing its
  context for the verified rows and drafting a block after each chunk's newest token.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ..config import ModelConfig
from ..graphs.argmax import first_argmax
from ..graphs.batch import Batch, Group
from ..graphs.dspark import draft_blocks
from ..graphs.dspark_context import context_rows, dspark_capture
from ..graphs.model import forward_batch
from ..graphs.mtp import mtp_draft
from ..graphs.yoco import Replay, first_kept
from .sampler import apply_token_mask, logprobs, sample_mode
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
    drafts: torch.Tensor | None = None  # [R, n_drafts]: each row's (chunk's) next drafts
    confidence: torch.Tensor | None = None  # [R, n_drafts]: DSpark's confidence of each draft (None: MTP-1)


def sample_rows(
    logits: torch.Tensor,
    next_token: torch.Tensor,
    sampling: torch.Tensor,
    mode: str,
    k: int | None,
    vocab_ids: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
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
    drafts: torch.Tensor | None = None  # [C, n_drafts]: each chunk's next drafts
    confidence: torch.Tensor | None = None  # [C, n_drafts]: DSpark's confidence of each draft (None: MTP-1)
    logprob: torch.Tensor | None = None  # with k: [C * L] each row's target token's logprob
    top_ids: torch.Tensor | None = None  # [C * L, k]
    top_logprobs: torch.Tensor | None = None  # [C * L, k]


def verify_out(accepted: tuple, logits: torch.Tensor) -> VerifyOut:
    """``accept_rows``' results (tokens, accepted[, logprob, top ids, top logprobs]) as a ``VerifyOut``."""
    tokens, n, *lp = accepted
    return VerifyOut(tokens, n, logits, None, None, *lp)


def propose_drafts(
    params: dict,
    state: dict,
    c: ModelConfig,
    layout: Layout,
    buf: torch.Tensor,
    feats,
    tokens: torch.Tensor,
    n_drafts: int,
    accepted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The model's drafter after a step of ``layout``: ``feats`` what the step's forward kept
    for it (``_forward``), ``tokens`` its sampled tokens (verify: every row's target token, and
    ``accepted``). Returns drafts ``[R, n_drafts]``, one row per decode row or chunk, and their
    confidences (DSpark's head; None for MTP-1)."""
    if c.dspark_stages:
        return dspark_drafts(params, state, c, layout, buf, feats, tokens, n_drafts, accepted)
    return mtp_drafts(params, state, c, layout, buf, feats, tokens, n_drafts, accepted), None


def dspark_drafts(
    params: dict,
    state: dict,
    c: ModelConfig,
    layout: Layout,
    buf: torch.Tensor,
    captured: tuple,
    tokens: torch.Tensor,
    n_drafts: int,
    accepted: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DSpark after a step: the context of every verified row (a decode row, every prompt row,
    a verify chunk's token and accepted drafts), then a block drafted greedily after each
    chunk's newest token (its sample, or its bonus token), of which the first ``n_drafts``.
    Compact prefill (``layout.kept``): the captured streams are the kept rows' only, so each
    chunk's context is its rows from ``keep_from`` on; KEEP covers the window
    (``yoco.min_keep_tokens``), so the last chunk's draft reads only rows it has."""
    model = layout.split_model(layout.model_part(buf))
    slots, starts, lens = model if layout.kind == "decode" else model[1:4]
    width = layout.length
    if layout.kept:  # chunk c's kept rows are captured rows c * kept .. (yoco.kept_rows)
        first = first_kept(starts, lens, model[5])
        starts, lens, width = first, starts + lens - first, layout.kept
    C = slots.shape[0]
    group = Group(torch.arange(C * width, device=slots.device).view(C, width), slots, starts, lens, packed=True)
    verified = lens if accepted is None else torch.minimum(accepted + 1, lens)
    context_rows(params, state, c, dict(zip(c.dspark_target_layer_ids, captured)), group, verified)
    newest = tokens if accepted is None else tokens.gather(1, accepted[:, None]).squeeze(1)
    draft = draft_blocks(
        params, state, c, newest.clamp(min=0), starts + verified, slots, verified > 0, first_argmax, n_drafts
    )
    return draft.tokens, draft.confidences


def mtp_drafts(
    params: dict,
    state: dict,
    c: ModelConfig,
    layout: Layout,
    buf: torch.Tensor,
    X: torch.Tensor,
    tokens: torch.Tensor,
    n_drafts: int,
    accepted: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MTP drafter after a step of ``layout`` (``graphs/mtp.mtp_draft``): ``X`` the step's
    final streams. A row's next token is known up to: a decode row's sample; a prompt chunk's
    last prompt token, or its sample where it samples; a verify chunk's accepted drafts and its
    bonus token."""
    model = layout.split_model(layout.model_part(buf))
    no = torch.zeros_like(model[1 if layout.kind != "decode" else 0], dtype=torch.bool)
    if layout.kind == "decode":
        slots, starts, lens = model
        nexts = tokens.clamp(min=0)[:, None]
        return mtp_draft(params, state, c, X, slots, starts, lens, nexts[:, 0], nexts, lens, no, n_drafts)
    token_ids, slots, starts, lens = model[:4]
    ids = token_ids.view(slots.shape[0], -1)
    if layout.kind == "verify":
        known = torch.minimum(accepted + 1, lens)
        return mtp_draft(params, state, c, X, slots, starts, lens, ids[:, 0], tokens.clamp(min=0), known, no, n_drafts)
    _, write, _ = sampling_tensors(layout.sampling_part(buf))
    samples = (write != state["slots"]).long()  # a chunk that samples nothing writes to the scratch slot
    last = (lens - 1).clamp(min=0)[:, None]
    nexts = torch.cat([ids[:, 1:], ids[:, :1]], dim=1).scatter(1, last, tokens.clamp(min=0)[:, None])
    known = (lens - 1 + samples).clamp(min=0)
    return mtp_draft(params, state, c, X, slots, starts, lens, ids[:, 0], nexts, known, starts > 0, n_drafts)


def decode_logits(
    params: dict,
    state: dict,
    c: ModelConfig,
    next_token: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    streams: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[B, vocab]`` of one decode token for each of ``B`` requests at positions ``starts``
    (``streams``: and the final streams ``[B, hc, D]``, the MTP drafter's input)."""
    index = torch.arange(slots.shape[0], device=slots.device)[:, None]
    batch = Batch(next_token[slots], starts, (Group(index, slots, starts, lens, packed=True),))
    return _forward(params, state, c, batch, streams)


def _forward(params: dict, state: dict, c: ModelConfig, batch: Batch, streams: bool, **kw):
    """``forward_batch``'s logits, and with ``streams`` what the model's drafter reads of the
    step (``propose_drafts``): the final streams (MTP-1), or DSpark's target layers' input streams."""
    captured = dspark_capture(c) if streams and c.dspark_stages else None
    logits, X = forward_batch(params, state, c, batch, captured=captured, **kw)
    if not streams:
        return logits
    return logits, (tuple(captured[layer] for layer in c.dspark_target_layer_ids) if captured is not None else X)


def bucket_batch(token_ids: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor) -> Batch:
    """``C`` chunks packed ``[C * L]`` (rows past a chunk's length: padding) as one packed group."""
    n_chunks = slots.shape[0]
    length = token_ids.shape[0] // n_chunks
    index = torch.arange(n_chunks * length, device=slots.device).view(n_chunks, length)
    group = Group(index, slots, starts, lens, packed=True)
    return Batch(token_ids, group.positions.reshape(-1), (group,))


def prefill_logits(
    params: dict,
    state: dict,
    c: ModelConfig,
    token_ids: torch.Tensor,
    slots: torch.Tensor,
    starts: torch.Tensor,
    lens: torch.Tensor,
    rows: torch.Tensor,
    keep_from: torch.Tensor | None = None,
    kept: int = 0,
    streams: bool = False,
    split: Callable[[Batch], Batch] | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[R, vocab]`` at packed ``rows`` for ``C`` prompt chunks packed ``[C * L]``; with
    ``kept``, compact prefill from each chunk's ``keep_from`` (a row before it has no logits:
    its result is that chunk's first kept row's, which nothing reads). ``streams``: and the
    final streams of every row ``[C * L, hc, D]`` (of the kept rows with ``kept``). ``split``:
    context parallelism, the bucket -> this rank's static share (``sharding.cp.split_bucket``);
    the logits are still every ``rows``' (from their owner ranks), the streams the rank's rows'."""
    batch = bucket_batch(token_ids, slots, starts, lens)
    if split is not None:
        batch = split(batch)
    if not kept:
        return _forward(params, state, c, batch, streams, rows=rows)
    length = token_ids.shape[0] // slots.shape[0]
    # packed row r = c * L + j -> kept row c * kept + j - (first kept position - start)
    chunk = torch.div(rows, length, rounding_mode="floor")
    skipped = (first_kept(starts, lens, keep_from) - starts)[chunk]
    kept_rows = chunk * kept + (rows - chunk * length - skipped).clamp(min=0, max=kept - 1)
    return _forward(params, state, c, batch, streams, rows=kept_rows, replay=Replay((keep_from,), (kept,)))
