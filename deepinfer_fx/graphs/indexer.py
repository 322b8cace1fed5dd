"""Lightning indexer of CSA layers: scores compressed entries per query and keeps the top k.

``score_t(w) = sum_h w_h * ReLU(q_h . K_w)`` with per-head weights from the layer input; only
entries whose window is complete are eligible, and at most ``index_topk`` of them are kept.
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..io.state_rows import RowCodec
from .batch import Group
from .compressor import compress, visible_entries
from . import fake_quant as fq
from .norm import held, linear, linear_fp32
from .rope import apply_rope, cos_sin
from .swap import swappable


def select_entries(
    p: dict,
    st: dict,
    c: ModelConfig,
    xg: torch.Tensor,
    g: Group,
    xq: torch.Tensor,
    q_r: torch.Tensor,
    q_pos: torch.Tensor,
    freq: torch.Tensor,
) -> torch.Tensor:
    """Boolean ``[C, Lq, n_entries]``: which compressed entries each query attends. The index
    keys are pooled from the group's chunks ``xg``; the queries are ``xq`` / ``q_r`` at ``q_pos``
    (the group's own rows, or a context-parallel rank's share of them)."""
    ratio = c.csa_ratio
    # the whole pool, read by slot: a gathered copy per chunk would move every slot's index keys
    pool = compress(
        p["compressor"],
        st,
        xg,
        g,
        ratio,
        True,
        freq,
        c.rms_norm_eps,
        lambda k: fq.index_vector(c, k, fq.is_packed(st["entries"])),
        gather=False,
    )
    q = linear(q_r, *held(p, "wq_b")).unflatten(-1, (c.index_n_heads, c.index_head_dim))
    q = fq.index_vector(c, apply_rope(q, *cos_sin(q_pos, freq)))
    head_w = linear_fp32(xq, p["weights_proj"]) * (c.index_head_dim**-0.5 * c.index_n_heads**-0.5)
    visible = visible_entries(q_pos, pool.shape[-2], ratio)
    # a trained-format pool is scored as it lies: the kernel decodes the tiles it reads
    key_rows = fq.codec(c, "index").spec if fq.is_packed(pool) else None
    return score_topk(q, pool, head_w, visible, c.index_topk, g.slots, key_rows)


def read_keys(q: torch.Tensor, keys: torch.Tensor, slots: torch.Tensor | None, key_rows: str | None) -> torch.Tensor:
    """The index keys a scoring of ``q`` reads, as values: ``keys[slots]`` (with slots), unpacked
    into q's dtype from rows of the layout ``key_rows`` (a ``RowCodec.spec``; None: already
    values). Only the rows read are unpacked, never the whole pool."""
    if slots is not None:
        keys = keys[slots]
    if key_rows is not None:
        keys = RowCodec.from_spec(key_rows, q.shape[-1]).unpack(keys, q.dtype)
    return keys


@swappable
def score_topk(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    k: int,
    slots: torch.Tensor | None = None,
    key_rows: str | None = None,
) -> torch.Tensor:
    """Per query the ``k`` visible entries with the highest ``sum_h head_w[t,h] relu(q[t,h] . keys[n])``
    (q ``[..., T, Hi, di]``, keys ``[..., N, di]`` or a pool read by ``slots``, values or packed
    rows, see ``index_scores``; head_w ``[..., T, Hi]``): a bool ``[..., T, N]``."""
    n = visible.shape[-1]
    if n == 0 or k <= 0:
        return torch.zeros_like(visible)
    scores = index_scores(q, keys, head_w, visible, 1.0, slots, key_rows)
    top = scores.topk(min(k, n), dim=-1, sorted=False).indices  # a set: unsorted skips a sort kernel
    # fewer than k visible: topk also returns masked entries; drop them
    return torch.zeros_like(visible).scatter_(-1, top, True) & visible


@swappable
def index_scores(
    q: torch.Tensor,
    keys: torch.Tensor,
    head_w: torch.Tensor,
    visible: torch.Tensor,
    dot_scale: float,
    slots: torch.Tensor | None = None,
    key_rows: str | None = None,
) -> torch.Tensor:
    """fp32 ``[..., T, N]``: ``sum_h head_w[t,h] * dot_scale * relu(q[t,h] . keys[n])`` where
    ``visible``, -inf elsewhere. V4 folds its whole scale into ``head_w`` (``dot_scale`` 1);
    V4.1 (``csa2.py``) applies ``index_head_dim**-0.5`` after the ReLU, in this order. With
    ``slots`` ``[C]`` (q ``[C, T, Hi, di]``), keys is the state's pool ``[S, N, di]`` and chunk c
    scores ``keys[slots[c]]``: the kernel reads the pool in place (the visible tiles only).
    ``key_rows``: keys are a trained-format state's uint8 rows ``[..., N, nbytes]`` of that
    ``RowCodec.spec``, scored as the values they unpack to in q's dtype (``read_keys``); the
    kernel decodes each tile it loads, so no unpacked copy of the pool is made."""
    keys = read_keys(q, keys, slots, key_rows)
    dots = torch.relu(torch.einsum("...thd,...nd->...thn", q.float(), keys.float())) * dot_scale
    return (dots * head_w.float()[..., None]).sum(-2).masked_fill(~visible, float("-inf"))


@swappable
def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Bool like ``scores``: per row its ``k`` largest entries above -inf (all of them where at
    most k are), V4.1's selections (``csa2.py``). A place, so that a kernel can pick them without
    a sort and batch-invariant inference can send ties to the lower index. Unsorted: only the set
    counts, and a sorted top-k is a sort kernel more on CUDA."""
    top = scores.topk(k, dim=-1, sorted=False)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top.indices, top.values > float("-inf"))
