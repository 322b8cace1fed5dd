"""The engine's step functions: the units that are compiled and captured, each also the eager twin.

Every input is a tensor of a fixed shape per bucket, so one compiled graph (and one CUDA graph)
serves every step of that bucket; padding requests use the state's scratch slot and length 0,
padding rows of a chunk sit past its length (``graphs/batch.py`` says why both are harmless).

- ``decode_step``: one token per request, read on the device from ``next_token[slot]`` (the
  sampler's output buffer), so the host never handles a sampled token between steps.
- ``prefill_step``: ``C`` chunks of up to ``L`` prompt tokens, packed ``[C * L]``; logits only for
  ``rows`` (each chunk's last token, or every row when prompt logprobs are asked for).
"""

from __future__ import annotations

import torch

from ..config import ModelConfig
from ..graphs.batch import Batch, Group
from ..graphs.model import forward_batch


def decode_step(
    params: dict, state: dict, c: ModelConfig, next_token: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """Logits ``[B, vocab]`` of one decode token for each of ``B`` requests at positions ``starts``."""
    index = torch.arange(slots.shape[0], device=slots.device)[:, None]
    batch = Batch(next_token[slots], starts, (Group(index, slots, starts, lens, packed=True),))
    return forward_batch(params, state, c, batch)[0]


def prefill_step(
    params: dict, state: dict, c: ModelConfig, token_ids: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
    lens: torch.Tensor, rows: torch.Tensor,
) -> torch.Tensor:
    """Logits ``[R, vocab]`` at packed ``rows`` for ``C`` prompt chunks packed ``[C * L]``."""
    n_chunks = slots.shape[0]
    length = token_ids.shape[0] // n_chunks
    index = torch.arange(n_chunks * length, device=slots.device).view(n_chunks, length)
    group = Group(index, slots, starts, lens, packed=True)
    batch = Batch(token_ids, group.positions.reshape(-1), (group,))
    return forward_batch(params, state, c, batch, rows=rows)[0]
