"""V4 attention: one shared K=V latent per token (MQA), per-head sink, grouped output.

Keys for a query are this layer's window (the last ``sliding_window`` positions) plus
compressed entries: none (SWA), all complete ones (HCA) or the indexer's top-k (CSA).
The value's rotary tail is un-rotated on the output, so it carries relative position only.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .batch import Batch
from .compressor import compress, visible_entries
from .fake_quant import kv_fake_quant
from .indexer import select_entries
from .norm import linear, rms_norm
from .rope import apply_rope, cos_sin, inv_freq
from .state import slot_view
from .window import window_bias, window_keys


def mqa_with_sink(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """q ``[T, H, d]``, keys ``[N, d]`` (K = V), bias ``[T, N]`` (0 / -inf). The sink adds
    ``exp(sink_h)`` to each head's softmax denominator and contributes no value."""
    scale = q.shape[-1] ** -0.5
    logits = torch.einsum("thd,nd->thn", q.float(), keys.float()) * scale + bias[:, None, :]
    sink_col = sink.float()[None, :, None].expand(q.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("thn,nd->thd", probs, keys.float()).to(q.dtype)


def grouped_output(o: torch.Tensor, wo_a: torch.Tensor, wo_b: torch.Tensor, groups: int) -> torch.Tensor:
    """o ``[T, H, d]`` -> heads split in ``groups`` contiguous groups, each projected by its own
    block of ``wo_a`` ``[G * r, (H/G) * d]``, then mixed by ``wo_b``."""
    t = o.shape[0]
    og = o.reshape(t, groups, -1)
    wa = wo_a.to(o.dtype).unflatten(0, (groups, -1))
    z = torch.einsum("tgi,gri->tgr", og, wa).reshape(t, -1)
    return linear(z, wo_b)


def attention(p: dict, st: dict, c: ModelConfig, x: torch.Tensor, batch: Batch, ratio: int) -> torch.Tensor:
    """One attention sublayer over the packed tokens ``x`` ``[N, D]`` (already normed).
    Projections run on all tokens; the cache-reading core runs per chunk on its state slot."""
    eps = c.rms_norm_eps
    freq = inv_freq(c, compressed=ratio != 0)
    cos, sin = cos_sin(batch.positions, freq)

    q_r = rms_norm(linear(x, p["wq_a"]), p["q_norm"], eps)
    q = linear(q_r, p["wq_b"]).unflatten(-1, (c.num_attention_heads, c.head_dim))
    q = apply_rope(rms_norm(q, None, eps), cos, sin)
    kv = apply_rope(rms_norm(linear(x, p["wkv"]), p["kv_norm"], eps), cos, sin)
    if c.fake_quant:
        kv = kv_fake_quant(kv, c.rope_dim)

    o = torch.empty_like(q)
    for ch in batch.chunks:
        rows = ch.rows
        o[rows] = _attend(p, slot_view(st, ch.slot), c, x[rows], q_r[rows], q[rows], kv[rows], batch.positions[rows], ch.start, ratio, freq)
    o = apply_rope(o, cos, sin, inverse=True)
    return grouped_output(o, p["wo_a"], p["wo_b"], c.o_groups)


def _attend(
    p: dict, st: dict, c: ModelConfig, x, q_r, q, kv, q_pos: torch.Tensor, start: int, ratio: int, freq: torch.Tensor
) -> torch.Tensor:
    """One sequence's chunk: window keys, compressed entries (all, or the indexer's top-k), softmax."""
    keys, k_pos = window_keys(st["window"], kv, start)
    bias = window_bias(q_pos, k_pos, c.sliding_window)
    if ratio:
        finish = (lambda e: kv_fake_quant(e, c.rope_dim)) if c.fake_quant else None
        overlap = ratio == c.csa_ratio
        entries = compress(p["compressor"], st["comp"], x, start, ratio, overlap, freq, c.rms_norm_eps, finish)
        if overlap:
            chosen = select_entries(p["indexer"], st["index"], c, x, q_r, start, freq)
        else:
            chosen = visible_entries(q_pos, entries.shape[0], ratio)
        keys = torch.cat([keys, entries.to(keys.dtype)])
        bias = torch.cat([bias, torch.zeros(chosen.shape, device=x.device).masked_fill(~chosen, float("-inf"))], dim=1)
    return mqa_with_sink(q, keys, bias, p["attn_sink"])
