"""The DeepSeek-V4 backbone as pure functions: ``(params, state, token_ids, start) -> logits``.

``params`` is the nested tree built from the parameter specs (``layers`` is a list);
``state`` is the explicit cache of ``state.init_state``, updated in place. A call processes a
``Batch``: one chunk per sequence (a whole prompt, a prefill chunk or one decode token), packed
into one token dimension. ``forward`` is the one-sequence form (slot 0).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .attention import attention
from .batch import Batch, make_batch
from .mhc import hc_head, mhc_coeffs, mhc_collapse, mhc_expand
from .moe import moe
from .norm import linear, rms_norm
from .state import check_room


def embed(params: dict, c: ModelConfig, token_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Token embeddings copied into the ``hc_mult`` residual streams: ``[T, N, D]``."""
    e = params["embed"][token_ids].to(dtype)
    return e[:, None, :].expand(-1, c.hc_mult, -1).contiguous()


def _site(lp: dict, name: str, c: ModelConfig, X: torch.Tensor):
    return mhc_coeffs(
        X, lp[f"hc_{name}_fn"], lp[f"hc_{name}_base"], lp[f"hc_{name}_scale"], c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters
    )


def block(lp: dict, ls: dict, c: ModelConfig, X: torch.Tensor, batch: Batch, ratio: int) -> torch.Tensor:
    """One decoder block (attention site, FFN site) on the streams ``X`` ``[N, hc, D]``."""
    pre, post, comb = _site(lp, "attn", c, X)
    a = attention(lp["attn"], ls, c, rms_norm(mhc_collapse(X, pre), lp["attn_norm"], c.rms_norm_eps), batch, ratio)
    X = mhc_expand(X, a, post, comb)
    pre, post, comb = _site(lp, "ffn", c, X)
    f = moe(lp["ffn"], c, rms_norm(mhc_collapse(X, pre), lp["ffn_norm"], c.rms_norm_eps), batch.token_ids)
    return mhc_expand(X, f, post, comb)


def hidden_streams(params: dict, state: dict, c: ModelConfig, batch: Batch) -> torch.Tensor:
    """Residual streams after the last layer (before ``hc_head``): ``[N, hc, D]``."""
    for ch in batch.chunks:
        check_room(state, ch.slot, ch.start, ch.length)
    X = embed(params, c, batch.token_ids, params["norm"].dtype)
    for layer, (lp, ls) in enumerate(zip(params["layers"], state["layers"])):
        X = block(lp, ls, c, X, batch, c.compress_ratios[layer])
    return X


def head(params: dict, c: ModelConfig, X: torch.Tensor, head_prefix: dict | None = None) -> torch.Tensor:
    """Collapse the streams with a learned ``hc_head``, norm, and project to fp32 logits.
    ``head_prefix`` is the tree holding ``hc_head_*`` and ``norm`` (the backbone or an MTP block)."""
    hp = params if head_prefix is None else head_prefix
    u = hc_head(X, hp["hc_head_fn"], hp["hc_head_base"], hp["hc_head_scale"], c.rms_norm_eps, c.hc_eps)
    u = rms_norm(u, hp["norm"], c.rms_norm_eps)
    return linear(u.float(), params["head"])


def forward_batch(params: dict, state: dict, c: ModelConfig, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[N, vocab]`` (fp32) for every packed token, and the final streams (MTP input)."""
    X = hidden_streams(params, state, c, batch)
    return head(params, c, X), X


def forward(
    params: dict, state: dict, c: ModelConfig, token_ids: torch.Tensor, start: int, slot: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's chunk at ``start`` in state ``slot``: logits ``[T, vocab]`` and streams."""
    return forward_batch(params, state, c, make_batch([token_ids], [slot], [start], token_ids.device))
