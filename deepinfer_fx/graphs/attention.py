"""Attention: one shared K=V latent per token (MQA), per-head sink, grouped output.

Keys for a query are this layer's window (the last ``sliding_window`` positions) plus
compressed entries: none (window-only layers), all complete ones (V4 HCA), the indexer's
top-k (V4 CSA; both ``entries.py``) or a selection over the group's shared cache (V4.1 CSA2,
``csa2.py``). The value's rotary tail is un-rotated on the output, so it carries relative
position only. V4 and V4.1 differ here only in data: the per-head q norm (V4) and where the
compressed entries come from.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch

from ..config import ModelConfig
from . import fake_quant as fq
from .batch import Batch, Group, context_gather, gather_rows, rows_to_packed
from .swap import swappable
from .csa2 import csa2_entries
from .entries import selected_entries, selected_rows, v4_entries
from .norm import held, linear, project_blocks, rms_norm
from .rope import apply_rope, cos_sin, inv_freq, norm_rope
from .window import reads_after_write, ring_positions, window_bias, window_keys, write_window


# Decode groups of at least this many chunks read their keys in place (``mqa_ring``); smaller
# ones gather them. Both run one arithmetic (bit for bit, tests/kernels/test_triton_ring_attention.py),
# so the rule cannot move a request's result. On the H200 (P8, 512-token context) in place was
# 0.089 ms a step faster at 64 requests (no 64 MiB of copied keys) and 0.036 ms slower at one
# (bench/results/ring_mqa_ab_s14.json); with the kernels' spills gone (s15), in place at every
# size against the s14 tree with this rule (at b64 both in place): b1 +0.013, b8 -0.023, b64
# -0.081 ms, none resolved
# (ring_whole_tiles_ab_s15.json). At b1 a ring program waits on its slot and position before
# its first key load, where the gathered path's copies hide under PDL.
RING_MIN_CHUNKS = 64

# fp32 logits the reference materialises at once (1 GiB): an eager 16k-token chunk would
# otherwise need [T, H, N] = 34 GiB (found on a cp2 mesh stepping eagerly).
_LOGITS_BUDGET = 1 << 28


@swappable
def mqa_with_sink(
    q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """q ``[..., T, H, d]``, keys ``[..., N, d]`` (K = V), bias ``[..., T, N]`` (0 / -inf). The sink
    adds ``exp(sink_h)`` to each head's softmax denominator and contributes no value. The values'
    rotary tails come back turned by minus the query's angle (its rope tables cos / sin
    ``[..., T, rd/2]``), so the result carries relative position only. Rows are independent, so
    long ``T`` runs in blocks of queries within ``_LOGITS_BUDGET``."""
    t = q.shape[-3]
    rows = max(1, _LOGITS_BUDGET // max(1, math.prod(q.shape[:-3]) * q.shape[-2] * keys.shape[-2]))
    if t <= rows:
        o = _mqa_rows(q, keys, bias, sink)
    else:
        o = torch.cat(
            [_mqa_rows(q[..., s : s + rows, :, :], keys, bias[..., s : s + rows, :], sink) for s in range(0, t, rows)],
            -3,
        )
    return apply_rope(o, cos, sin, inverse=True)


@swappable
def mqa_ring(
    q: torch.Tensor,
    ring: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    entries: Optional[torch.Tensor],
    entry_rows: Optional[torch.Tensor],
    entry_bias: Optional[torch.Tensor],
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    window: int,
) -> torch.Tensor:
    """Decode attention read in place: chunk c's one query ``q[c]`` (``[C, 1, H, d]``, at
    position ``pos[c]``) over the last ``window`` positions of its window ring ``ring[slots[c]]``
    (``[S, R, d]``, position p at ``p % R``, this step's row written), then, where given, its entries ``entries[slots[c]]`` (``[S, E, d]``), the rows
    ``entry_rows[c]`` of them (``[C, K]``) if given, with their bias ``entry_bias`` ``[C, 1, K]``.
    ``mqa_with_sink`` over those keys; the kernel reads the pools where they lie, where this
    reference gathers (a copy of every key a step: 64 MiB at a 64-request P8 decode)."""
    keys, _, bias = ring_keys(ring, slots, pos, entries, entry_rows, entry_bias, window)
    return mqa_with_sink(q, keys, bias, sink, cos, sin)


def ring_keys(
    ring: torch.Tensor,
    slots: torch.Tensor,
    pos: torch.Tensor,
    entries: Optional[torch.Tensor],
    entry_rows: Optional[torch.Tensor],
    entry_bias: Optional[torch.Tensor],
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``mqa_ring``'s keys gathered: the window ring's rows then the chosen entries ``[C, R + K, d]``,
    the ring rows' positions ``[C, R]`` and the bias of every key."""
    keys, k_pos = ring[slots], ring_positions(pos, ring.shape[1])
    bias = window_bias(pos[:, None], k_pos, window)
    if entries is not None:
        chosen = entries[slots]
        if entry_rows is not None:
            chosen = chosen.gather(1, entry_rows[..., None].expand(-1, -1, chosen.shape[-1]))
        keys = torch.cat([keys, chosen.to(keys.dtype)], 1)
        bias = torch.cat([bias, entry_bias], -1)
    return keys, k_pos, bias


@swappable
def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    k_pos: torch.Tensor,
    bias: torch.Tensor,
    sink: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> torch.Tensor:
    """``mqa_with_sink`` over a group's keys whose first ``k_pos.shape[-1]`` are window keys at
    positions ``k_pos`` ``[..., Nw]`` (negative = empty) and the rest compressed entries in
    ascending order. The positions say which key is which whatever the layout (a prefill
    chunk's ring then its own rows, a decode ring), which batch-invariant inference needs to
    sum the keys in one order (``graphs/batch_invariant.py``); the reference does not read them."""
    return mqa_with_sink(q, keys, bias, sink, cos, sin)


def _mqa_rows(q: torch.Tensor, keys: torch.Tensor, bias: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    scale = q.shape[-1] ** -0.5
    logits = torch.einsum("...thd,...nd->...thn", q.float(), keys.float()) * scale + bias[..., :, None, :]
    sink_col = sink.float()[:, None].expand(*logits.shape[:-1], 1)
    probs = torch.softmax(torch.cat([logits, sink_col], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("...thn,...nd->...thd", probs, keys.float()).to(q.dtype)


def grouped_output(o: torch.Tensor, p: dict, groups: int) -> torch.Tensor:
    """o ``[T, H, d]`` -> heads split in ``groups`` contiguous groups, each projected by its own
    block of ``p["wo_a"]`` ``[G * r, (H/G) * d]``, then mixed by ``p["wo_b"]``."""
    wo_a, scale = held(p, "wo_a")
    return linear(project_blocks(o.flatten(-2), wo_a, groups, scale), *held(p, "wo_b"))


def query(
    p: dict, c: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> ``q_r`` ``[N, q_lora_rank]`` (the indexer reads it too) and rotated heads ``q`` ``[N, H, d]``."""
    eps = c.rms_norm_eps
    q_r = rms_norm(linear(x, *held(p, "wq_a")), p["q_norm"], eps)
    q = linear(q_r, *held(p, "wq_b")).unflatten(-1, (c.num_attention_heads, c.head_dim))
    if c.is_v41:
        return q_r, apply_rope(q, cos, sin)
    return q_r, norm_rope(q, None, eps, cos, sin)  # V4 normalises each query head


def latent_kv(p: dict, c: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The K = V latent of each token as its window ring stores it: normed, rotated, fake-quantised.
    The DSpark drafter builds its context windows with this same map from projected target states."""
    return fq.window_kv(c, norm_rope(linear(x, *held(p, "wkv")), p["kv_norm"], c.rms_norm_eps, cos, sin))


def attention(
    p: dict,
    states: list,
    c: ModelConfig,
    x: torch.Tensor,
    batch: Batch,
    layer: int,
    ratio: int,
    ctx: dict,
    keys_x: torch.Tensor | None = None,
) -> torch.Tensor:
    """One attention sublayer over the packed tokens ``x`` ``[N, D]`` (already normed).
    ``states`` holds every layer's pooled state (V4.1 layers read their KV source's);
    ``ctx`` carries per-forward results shared across layers (V4.1 selections).
    Projections run on all tokens; the cache-reading core runs per group of chunks ``[C, L]``:
    the cache side (window ring, compressor, index keys) on the whole chunks, the query side on
    this batch's rows of them (all of them, except on a context-parallel rank, or where the
    caller gives the key side's rows ``keys_x`` for a ``QuerySubset``: V4.1 compact prefill)."""
    freq = inv_freq(c, ratio != 0, x.device)
    cos, sin = _per_forward(
        ctx, ("rope", ratio != 0), batch.positions, lambda: cos_sin(batch.positions, freq, shared=True)
    )
    q_r, q = query(p, c, x, cos, sin)
    keys_batch = batch.keys
    xk, k_cos, k_sin = x, cos, sin
    if batch.split is not None:  # the cache side needs every token of the chunks
        xk = context_gather(x, batch.split) if keys_x is None else keys_x
        k_cos, k_sin = _per_forward(
            ctx,
            ("key rope", ratio != 0),
            keys_batch.positions,
            lambda: cos_sin(keys_batch.positions, freq, shared=True),
        )
    kv = latent_kv(p, c, xk, k_cos, k_sin)

    outs = []
    st = states[layer]
    for gi, (g, qs) in enumerate(zip(keys_batch.groups, batch.queries)):
        xg, kv_g = gather_rows(xk, g), gather_rows(kv, g)
        xq, q_rq, q_pos = gather_rows(x, qs), gather_rows(q_r, qs), qs.positions
        packed = fq.is_packed(st["window"])  # a trained-format state: rows are read through fq.read
        if (
            not packed
            and kv_g.shape[1] == 1  # one-token chunks: mqa_ring takes each chunk's start as its query's position
            and reads_after_write(st["window"], kv_g, c.sliding_window)
            and q_pos.shape[-1] == 1
            and g.slots.shape[0] >= RING_MIN_CHUNKS
            and g.floor is None
        ):
            outs.append(
                (
                    qs,
                    _decode(
                        p,
                        states,
                        c,
                        st,
                        kv_g,
                        xg,
                        g,
                        xq,
                        q_rq,
                        q_pos,
                        gather_rows(q, qs),
                        gather_rows(cos, qs),
                        gather_rows(sin, qs),
                        layer,
                        ratio,
                        freq,
                        ctx.setdefault(gi, {}),
                    ),
                )
            )
            continue
        keys, k_pos = window_keys(st["window"], fq.window_kv(c, kv_g, packed) if packed else kv_g, g, c.sliding_window)
        keys = fq.read(c, "window", keys, kv.dtype)
        # every layer's ring holds the same positions, so every layer sees the same window
        bias = _per_forward(
            ctx, ("window bias", gi, k_pos.shape[-1]), qs, lambda: window_bias(q_pos, k_pos, c.sliding_window)
        )
        if ratio:
            if c.is_v41:  # every V4.1 compressed layer attends a top-k selection
                entries, chosen = csa2_entries(
                    p, states, c, xg, g, xq, q_rq, q_pos, layer, freq, ctx.setdefault(gi, {})
                )
            else:
                entries, chosen = v4_entries(p, st, c, xg, g, xq, q_rq, q_pos, ratio, freq)
            if (c.is_v41 or ratio == c.csa_ratio) and chosen.shape[-2] == 1 and entries.shape[1] > c.index_topk:
                entries, chosen = selected_entries(entries, chosen, c.index_topk)
            keys = torch.cat([keys, fq.read(c, "entry", entries, keys.dtype)], 1)
            bias = torch.cat([bias, torch.zeros(chosen.shape, device=x.device).masked_fill(~chosen, float("-inf"))], -1)
        o = attend(gather_rows(q, qs), keys, k_pos, bias, p["attn_sink"], gather_rows(cos, qs), gather_rows(sin, qs))
        outs.append((qs, o))
    return grouped_output(rows_to_packed(outs, q.shape[0]), p, c.o_groups)


def _decode(
    p,
    states,
    c: ModelConfig,
    st,
    kv_g,
    xg,
    g: Group,
    xq,
    q_rq,
    q_pos,
    q,
    cos,
    sin,
    layer: int,
    ratio: int,
    freq,
    group_ctx: dict,
) -> torch.Tensor:
    """One-token chunks of a large group: the window and the compressed entries are read from
    their pools by ``mqa_ring`` (no gathered copy of the keys, no window bias tensor)."""
    write_window(st["window"], kv_g, g)
    entries = rows = bias = None
    if ratio:
        if c.is_v41:
            entries, chosen = csa2_entries(p, states, c, xg, g, xq, q_rq, q_pos, layer, freq, group_ctx, gather=False)
        else:
            entries, chosen = v4_entries(p, st, c, xg, g, xq, q_rq, q_pos, ratio, freq, gather=False)
        if (c.is_v41 or ratio == c.csa_ratio) and entries.shape[1] > c.index_topk:
            rows, chosen = selected_rows(chosen, c.index_topk)
        bias = torch.zeros(chosen.shape, device=q.device).masked_fill(~chosen, float("-inf"))
    # a one-token chunk's position is its start, a step input (q_pos[:, 0] was a copy a layer)
    return mqa_ring(q, st["window"], g.slots, g.starts, entries, rows, bias, p["attn_sink"], cos, sin, c.sliding_window)


def _per_forward(ctx: dict, key: tuple, owner: object, build: Callable[[], Any]) -> Any:
    """``build()`` once per forward for ``owner`` (the tensor or group it is computed from):
    what every layer of a kind shares (rope tables, the window bias) is traced once. Where it is
    a real buffer (the rope tables: ``cos_sin(shared=True)``) a compiled step computes it once;
    Inductor still copies an unrealised pointwise result (the bias) for each custom op reading it."""
    got = ctx.get(key)
    if got is None or got[0] is not owner:
        got = ctx[key] = (owner, build())
    return got[1]
