"""The MTP-1 block (``mtp.{s}``) of V4-Flash / V4-Pro: predicts token t+2 from the target's
final streams at t and the embedding of token t+1. A window-only block with its own
``hc_head`` and norm, sharing the target's embedding and output head."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .batch import Batch, make_batch
from .model import block, head
from .norm import linear, rms_norm


def mtp_forward_batch(
    params: dict, state: dict, c: ModelConfig, X: torch.Tensor, batch: Batch, stage: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """X ``[N, hc, D]``: target streams at the batch's positions; ``batch.token_ids``: the token
    after each position. Returns fp32 logits ``[N, vocab]`` for the token after that, and the
    block's output streams (fed back as X to chain further steps)."""
    mp, ms = params["mtp"][stage], state["mtp"][stage]
    eps = c.rms_norm_eps
    e = rms_norm(params["embed"][batch.token_ids].to(X.dtype), mp["enorm"], eps)
    Y = linear(rms_norm(X, mp["hnorm"], eps), mp["h_proj"]) + linear(e, mp["e_proj"])[:, None, :]
    Y, _ = block(mp, [ms], c, Y, batch, 0, 0)
    return head(params, c, Y, head_prefix=mp), Y


def mtp_forward(
    params: dict, state: dict, c: ModelConfig, X: torch.Tensor, next_ids: torch.Tensor, start: int, stage: int = 0, slot: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's form of ``mtp_forward_batch`` (positions ``start..``, state ``slot``)."""
    return mtp_forward_batch(params, state, c, X, make_batch([next_ids], [slot], [start], X.device), stage)
