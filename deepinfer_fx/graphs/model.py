"""The backbone as pure functions: ``(params, state, batch) -> logits``.

``params`` is the nested tree built from the parameter specs (``layers`` is a list);
``state`` is the explicit cache of ``state.init_state``, updated in place. A call processes a
``Batch``: one chunk per sequence (a whole prompt, a prefill chunk or one decode token), packed
into one token dimension. ``forward`` is the one-sequence form (slot 0).

V4 and V4.1 share every block; they differ in data: V4 collapses the streams at each mHC site
with that site's own ``pre`` and ends with a learned ``hc_head``; V4.1 is single-pass (each
site collapses with the previous site's ``pre``, the head with the last one) and adds Engram
lookups before some layers.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..config import ModelConfig
from .attention import attention
from .batch import Batch, ContextSplit, gather_rows, make_batch, owned_rows, scatter_rows
from .engram import engram_apply
from .engram_hash import DEAD, EngramLayout, engram_hash, engram_layout
from .mhc import first_stream, hc_head, mhc_collapse, mhc_expand, mhc_site
from .moe import moe
from .norm import linear_fp32, rms_norm
from .state import check_room, write_rows
from .yoco import Kept, Replay, kept_rows


def embed(params: dict, c: ModelConfig, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Token embeddings copied into the ``hc_mult`` residual streams: ``[T, N, D]``."""
    e = params["embed"][token_ids].to(dtype)
    return e[:, None, :].expand(-1, c.hc_mult, -1).contiguous()


def _site(lp: dict, name: str, c: ModelConfig, X: torch.Tensor, pre_in: torch.Tensor | None):
    return mhc_site(
        X,
        lp[f"hc_{name}_fn"],
        lp[f"hc_{name}_base"],
        lp[f"hc_{name}_scale"],
        c.rms_norm_eps,
        c.hc_eps,
        c.hc_sinkhorn_iters,
        pre_in,
    )


def block(
    lp: dict,
    states: list,
    c: ModelConfig,
    X: torch.Tensor,
    batch: Batch,
    layer: int,
    ratio: int,
    ctx: dict | None = None,
    pre_prev: torch.Tensor | None = None,
    attn: Callable = attention,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder block (attention site, FFN site) on the streams ``X`` ``[N, hc, D]``.
    ``pre_prev`` given (V4.1, single-pass mHC): the attention input collapses with it and the
    FFN input with the attention site's ``pre``; otherwise each site uses its own.
    ``attn`` replaces the attention sublayer (same signature as ``attention``): the DSpark
    drafter's stages attend their context windows without writing them.
    ``rows`` (V4.1 compact prefill's first decoder layer, ``yoco.py``): every row of ``X`` feeds
    attention's cache side, and the block goes on with these rows only; ``batch`` is then their
    ``QuerySubset`` batch. Returns the new streams and the FFN site's ``pre`` (the next block's ``pre_prev``)."""
    eps = c.rms_norm_eps
    pre_a, post, comb, u = _site(lp, "attn", c, X, pre_prev)
    x = rms_norm(u, lp["attn_norm"], eps)
    ctx = ctx if ctx is not None else {}
    if rows is None:
        a = attn(lp["attn"], states, c, x, batch, layer, ratio, ctx)
    else:
        a = attention(lp["attn"], states, c, x[rows], batch, layer, ratio, ctx, keys_x=x)
        X, pre_a, post, comb = X[rows], pre_a[rows], post[rows], comb[rows]
    X = mhc_expand(X, a, post, comb)
    pre_f, post, comb, u = _site(lp, "ffn", c, X, None if pre_prev is None else pre_a)
    f = moe(lp["ffn"], c, rms_norm(u, lp["ffn_norm"], eps), batch.token_ids, batch.real_rows, batch.image_rows)
    return mhc_expand(X, f, post, comb), pre_f


_LAYOUTS: dict[ModelConfig, EngramLayout] = {}


def cached_engram_layout(c: ModelConfig) -> EngramLayout:
    # A plain dict, not lru_cache: the layout is built with numpy, which a traced step cannot
    # run; the eager warm-up of a compiled step fills the dict and the trace reads a constant.
    got = _LAYOUTS.get(c)
    if got is None:
        got = _LAYOUTS.setdefault(c, engram_layout(c))
    return got


def engram_hashes(params: dict, state: dict, c: ModelConfig, batch: Batch) -> list[torch.Tensor]:
    """Hash ids ``[N, columns]`` of every Engram layer for the packed batch, computed once per
    forward; each slot's history (the last N-1 compressed ids) is read and advanced. Image-span
    rows (``batch.image_rows``) enter it as DEAD (-1): no n-gram reaches across them."""
    layout = cached_engram_layout(c)
    if batch.image_rows is None:
        comp = params["engram_vocab"][batch.token_ids]
    else:  # span rows carry image_token_id, which may lie past a tiny model's vocabulary
        comp = params["engram_vocab"][torch.where(batch.image_rows, 0, batch.token_ids)]
        comp = torch.where(batch.image_rows, DEAD, comp)
    pad = params["engram_vocab"][c.engram_pad_token_id]
    hist_pool = state["engram"]["history"]  # a ring: position p's id at p % ring
    n_hist, ring = layout.max_ngram_size - 1, hist_pool.shape[1]
    out = [
        torch.zeros(comp.shape[0] + 1, layout.n_columns, dtype=torch.long, device=comp.device)
        for _ in c.engram_layer_ids
    ]
    for g in batch.groups:
        ids = gather_rows(comp, g)
        before = g.starts[:, None] - n_hist + torch.arange(n_hist, device=ids.device)  # [C, n_hist]
        held = hist_pool[g.slots[:, None], torch.remainder(before, ring)]
        hist = torch.where(before >= 0, held, pad)
        for i in range(len(c.engram_layer_ids)):
            scatter_rows(out[i], g, engram_hash(ids, hist, layout, i, pad))
        # each chunk's last `ring` ids, for the chunks after it
        write_rows(
            hist_pool,
            g.slots,
            torch.remainder(g.positions, ring),
            ids,
            g.valid & (g.positions >= g.ends[:, None] - ring),
        )
    return [h[:-1] for h in out]


def run_layers(
    params: dict,
    state: dict,
    c: ModelConfig,
    X: torch.Tensor,
    batch: Batch,
    layers: range,
    ctx: dict,
    pre: torch.Tensor | None,
    hashes: list[torch.Tensor] | None,
    captured: dict | None = None,
    kept: Kept | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Layers ``layers`` on the streams of the batch's rows. ``kept`` (V4.1 compact prefill):
    from the first decoder layer on, only those rows go on (``yoco.py``). Layers listed in
    ``captured`` (a dict of layer -> None) get their input streams (after Engram) stored
    there: the DSpark drafter reads them (with ``kept``: the kept rows' only, every layer in
    ``kept.rows``' layout, as the later layers have no others)."""
    first_decoder = c.decoder_layers[0] if kept is not None else None
    live = None if batch.image_rows is None else ~batch.image_rows  # Engram leaves span rows as they are
    for layer in layers:
        lp = params["layers"][layer]
        if "engram" in lp:
            X = engram_apply(lp["engram"], X, hashes[c.engram_layer_ids.index(layer)], c.rms_norm_eps, live)
        if captured is not None and layer in captured:
            captured[layer] = X[kept.rows] if first_decoder is not None and layer <= first_decoder else X
        if layer == first_decoder:
            X, pre_f = block(
                lp, state["layers"], c, X, kept.queries, layer, c.compress_ratios[layer], ctx, pre, rows=kept.rows
            )
            batch, hashes = kept.batch, None if hashes is None else [h[kept.rows] for h in hashes]
        else:
            X, pre_f = block(lp, state["layers"], c, X, batch, layer, c.compress_ratios[layer], ctx, pre)
        if c.is_v41:
            pre = pre_f
    return X, pre


def hidden_streams(
    params: dict,
    state: dict,
    c: ModelConfig,
    batch: Batch,
    captured: dict | None = None,
    replay: Replay | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Residual streams after the last layer: ``[N, hc, D]`` (with ``replay``, V4.1's compact
    prefill: of the kept rows, ``yoco.kept_rows``' layout), and (V4.1) the last site's ``pre``.
    ``captured``: see ``run_layers``."""
    if replay is not None and not c.is_v41:
        raise ValueError(f"compact prefill replays V4.1's decoder; this config is {c.model_type}")
    if replay is not None and batch.split is not None:
        raise ValueError("compact prefill with context parallelism is not built; run these forwards exact")
    for ch in batch.keys.chunks:
        check_room(state, ch.slot, ch.start, ch.length)
    if batch.embeds is None:
        X = embed(params, c, batch.token_ids, params["norm"].dtype)
    else:  # merged text and image-span embeddings (vision.merge.input_embeddings)
        X = batch.embeds.to(params["norm"].dtype)[:, None, :].expand(-1, c.hc_mult, -1).contiguous()
    pre = None
    if c.is_v41:  # the first site collapses stream 0 alone
        pre = first_stream(X)
    hashes = None
    if c.engram_layer_ids:  # n-gram hashes need every token of the chunks, then this batch's rows
        hashes = engram_hashes(params, state, c, batch.keys)
        if batch.split is not None:
            hashes = [h[batch.split.rows] for h in hashes]
    kept = None if replay is None else kept_rows(batch, replay)
    return run_layers(params, state, c, X, batch, range(c.num_hidden_layers), {}, pre, hashes, captured, kept)


# Rows up to which a draft step reads the block-FP8 copy of the output head (``draft_head``):
# the decode domain of the skinny FP8 kernel (``kernels/ops_linear.FP8_MAX_ROWS``). A larger
# draft step reads the head as stored, where cuBLAS reuses each weight tile over its rows.
DRAFT_HEAD_FP8_ROWS = 64


def output_head(params: dict, u: torch.Tensor, draft: bool = False) -> torch.Tensor:
    """fp32 logits of the normed hidden ``u`` ``[..., D]``. A draft step (``draft``) of at most
    ``DRAFT_HEAD_FP8_ROWS`` rows reads ``params["draft_head"]`` where the engine made one
    (``speculative_config["draft_head"] = "fp8"``: half the bytes a draft streams); else the head."""
    if draft and "draft_head" in params and u[..., 0].numel() <= DRAFT_HEAD_FP8_ROWS:
        return linear_fp32(u, params["draft_head"], params["draft_head_scale"])
    return linear_fp32(u, params["head"])


def head(
    params: dict,
    c: ModelConfig,
    X: torch.Tensor,
    head_prefix: dict | None = None,
    pre: torch.Tensor | None = None,
    draft: bool = False,
) -> torch.Tensor:
    """Collapse the streams (a learned ``hc_head``, or V4.1's last ``pre``), norm, and project
    to fp32 logits. ``head_prefix`` is the tree holding ``hc_head_*`` and ``norm``; ``draft``
    as in ``output_head``."""
    hp = params if head_prefix is None else head_prefix
    if pre is not None:
        u = mhc_collapse(X, pre)
    else:
        u = hc_head(X, hp["hc_head_fn"], hp["hc_head_base"], hp["hc_head_scale"], c.rms_norm_eps, c.hc_eps)
    u = rms_norm(u, hp["norm"], c.rms_norm_eps)
    return output_head(params, u, draft)


def forward_batch(
    params: dict,
    state: dict,
    c: ModelConfig,
    batch: Batch,
    captured: dict | None = None,
    rows: torch.Tensor | None = None,
    replay: Replay | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[N, vocab]`` (fp32) for every packed token (or only for packed ``rows``: the
    head is a large share of a prefill step), and the final streams (MTP input).
    ``captured``: layer -> None entries to fill with those layers' input streams (DSpark).
    ``replay``: V4.1 compact prefill; rows (and the captured streams) are then the kept rows
    (``yoco.kept_rows``). On a context-parallel rank (``batch.split``) ``rows`` are rows of the
    whole chunks, whose streams come from the ranks that own them (every rank: the same logits)."""
    X, pre = hidden_streams(params, state, c, batch, captured, replay)
    if rows is None:
        return head(params, c, X, pre=pre), X
    picked = _pick_rows(X, batch, rows), None if pre is None else _pick_rows(pre, batch, rows)
    return head(params, c, picked[0], pre=picked[1]), X


def _pick_rows(t: torch.Tensor, batch: Batch, rows: torch.Tensor) -> torch.Tensor:
    """``t``'s ``rows``; on a context-parallel rank, rows of the whole chunks, from their owners."""
    return owned_rows(t, batch.split, rows) if isinstance(batch.split, ContextSplit) else t[rows]


def forward(
    params: dict, state: dict, c: ModelConfig, token_ids: torch.Tensor, start: int, slot: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk at ``start`` in state ``slot``: logits ``[T, vocab]`` and streams."""
    return forward_batch(params, state, c, make_batch([token_ids], [slot], [start], token_ids.device))
