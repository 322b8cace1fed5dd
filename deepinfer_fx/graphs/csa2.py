"""V4.1 CSA2: compressed KV and index keys shared across layers, two-level top-k.

Only KV-source layers own a compressor; the layers after a source read its compressed cache
(ratio 2 in the encoder half, ratio 1 = one latent per token in the decoder half). Index keys
are derived from the source's latents (``wk``, ``k_norm``). Index-source layers score queries
against those keys and publish a top-k selection that the following layers reuse; the
candidate-source layer also publishes a block mask (top blocks of ``candidate_block_size``
entries) that restricts every later index source ("reindex").
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from . import fake_quant as fq
from .batch import Group
from .compressor import entry_rope, new_latents, store_entries, visible_entries
from .indexer import index_scores, top_k_mask
from .norm import held, linear, linear_fp32, rms_norm
from .rope import apply_rope, cos_sin


def _publish(
    p: dict, st: dict, c: ModelConfig, x: torch.Tensor, g: Group, ratio: int, freq: torch.Tensor
) -> torch.Tensor:
    """A KV source pools the chunks and stores new compressed entries and their index keys.
    Index keys come from the latent before RoPE; both are then rotated to the entry position.
    Returns ``[C]`` bool: whether any group closed in each chunk."""
    w, complete, lat = new_latents(p["compressor"], st, x, g, ratio, False, c.rms_norm_eps)
    keys = rms_norm(linear(lat, p["indexer"]["wk"]), p["indexer"]["k_norm"], c.rms_norm_eps)
    packed = fq.is_packed(st["entries"])
    store_entries(st["index_keys"], g, w, complete, fq.index_vector(c, entry_rope(keys, w, ratio, freq), packed))
    store_entries(
        st["entries"], g, w, complete, fq.compressed_entry(c, entry_rope(lat, w, ratio, freq), packed, x.dtype)
    )
    return complete.any(-1)


def candidate_blocks(scores: torch.Tensor, n_visible: torch.Tensor, top_blocks: int, block: int) -> torch.Tensor:
    """Level one of the two-level top-k: per query keep the ``top_blocks`` blocks of ``block``
    entries with the highest max score, always including the block of the newest visible
    entry; blocks with no visible entry are dropped. -> bool mask shaped like ``scores``."""
    n = scores.shape[-1]
    padded = torch.nn.functional.pad(scores, (0, -n % block), value=float("-inf"))
    blk = padded.unflatten(-1, (-1, block)).amax(-1)
    newest = torch.div(n_visible - 1, block, rounding_mode="floor")
    ids = torch.arange(blk.shape[-1], device=scores.device)
    blk = blk.masked_fill(ids == newest[..., None], float("inf"))
    keep = top_k_mask(blk, min(top_blocks, blk.shape[-1]))
    return keep.repeat_interleave(block, dim=-1)[..., :n]


def _select(
    p: dict,
    c: ModelConfig,
    keys: torch.Tensor,
    key_slots: torch.Tensor | None,
    key_rows: str | None,
    x,
    q_r,
    q_pos,
    layer: int,
    ratio: int,
    freq,
    group_ctx: dict,
) -> torch.Tensor:
    """An index source's selection: ``[C, L, n_entries]`` bool. ``keys``: each chunk's index keys
    ``[C, n, di]``, or the pool ``[S, n, di]`` that ``key_slots`` reads; a trained-format state's
    rows ``[..., n, nbytes]`` of the layout ``key_rows`` (``indexer.index_scores``)."""
    ip = p["indexer"]
    q = linear(q_r, *held(ip, "wq_b")).unflatten(-1, (c.index_n_heads, c.index_head_dim))
    q = fq.index_vector(c, apply_rope(q, *cos_sin(q_pos, freq)))
    head_w = linear_fp32(x, ip["weights_proj"]) * c.index_n_heads**-0.5
    n = keys.shape[-2]
    visible = visible_entries(q_pos, n, ratio)
    scores = index_scores(q, keys, head_w, visible, c.index_head_dim**-0.5, key_slots, key_rows)
    if c.is_candidate_source(layer):
        n_vis = torch.div(q_pos + 1, ratio, rounding_mode="floor").clamp(max=n)
        group_ctx["candidates"] = candidate_blocks(scores, n_vis, c.candidate_topk_blocks, c.candidate_block_size)
    elif c.uses_candidates(layer) and "candidates" in group_ctx:
        scores = scores.masked_fill(~group_ctx["candidates"], float("-inf"))
    return top_k_mask(scores, min(c.index_topk, n)) & visible


def csa2_entries(
    p: dict,
    states: list,
    c: ModelConfig,
    xg,
    g: Group,
    xq,
    q_r,
    q_pos,
    layer: int,
    freq,
    group_ctx: dict,
    gather: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The compressed entries ``[C, n, d]`` a V4.1 layer attends to (its KV source's, which a
    source pools from the group's chunks ``xg``; without ``gather`` the whole pool, read by
    ``g.slots``) and the selection ``[C, Lq, n]`` of the queries ``xq`` / ``q_r`` at ``q_pos``."""
    src = c.kv_source(layer)
    ratio = c.compress_ratios[src]
    st = states[src]["comp"]
    closed = _publish(p, st, c, xg, g, ratio, freq) if layer == src else None
    entries = st["entries"][g.slots] if gather else st["entries"]
    if c.is_index_source(layer):
        keys, key_slots = st["index_keys"], g.slots  # the pool, read by slot
        if c.index_key_quirk and layer == src and ratio > 1:
            # The official reference republishes an owner's keys only when it closes a group; in
            # between, the owner scores against the last keys published, the last KV source's
            # (ratio 1, written every token by the previous step). Spec §11.1. Whole rows are
            # chosen, so this holds for a trained-format state's bytes as for values.
            last = states[c.kv_source_layer_ids[-1]]["comp"]["index_keys"][g.slots]
            keys, key_slots = torch.where(closed[:, None, None], keys[g.slots], last[:, : keys.shape[1]]), None
        # a trained-format state's keys are scored as they lie: the kernel decodes the tiles it reads
        key_rows = fq.codec(c, "index").spec if fq.is_packed(keys) else None
        group_ctx["selection"] = _select(p, c, keys, key_slots, key_rows, xq, q_r, q_pos, layer, ratio, freq, group_ctx)
    return entries, group_ctx["selection"]
