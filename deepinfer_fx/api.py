"""Public model-level names: ``load_model``, ``logits``, ``count_params``, ``random_model``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from .config import ModelConfig, config_from_dict
from .graphs.model import forward
from .graphs.random_init import random_params
from .graphs.state import init_state
from .io.loader import load_checkpoint


@dataclass
class Model:
    """A config and its parameter tree. Unpacks as ``config, params = model``."""

    config: ModelConfig
    params: dict
    path: Path | None = None

    def __iter__(self) -> Iterator:
        return iter((self.config, self.params))

    @property
    def dtype(self) -> torch.dtype:
        return self.params["norm"].dtype

    @property
    def device(self) -> torch.device:
        return self.params["norm"].device


def load_model(
    path: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
    fake_quant: bool | None = None,
    experts: Callable | None = None,
    expert_format: str | None = None,
    dense_format: str | None = None,
) -> Model:
    """Load a checkpoint directory (or hub repo id; ``None`` reads ``DEEPINFER_HF_MODEL_DIR``).
    ``fake_quant`` switches the official fake-quant points (default: on). ``experts`` maps a
    stacked expert spec to the expert ids to load (an EP rank's share); default all.
    ``expert_format`` ("auto", "fp8", "fp4", "dequant"; None reads ``DEEPINFER_EXPERT_FORMAT``,
    default auto): whether routed experts stay as stored, block FP8 or MXFP4, or are dequantised
    (``io.loader.held_experts``; auto: both kept on CUDA). ``dense_format`` ("auto", "fp8",
    "dequant"; None reads ``DEEPINFER_DENSE_FORMAT``): whether block-FP8 dense projections stay
    as stored (``io.loader.held_dense``; auto: kept on CUDA with bf16 activations)."""
    c, params, model_dir = load_checkpoint(path, dtype, device, fake_quant, experts, expert_format, dense_format)
    return Model(c, params, model_dir)


def random_model(config: dict | ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device="cpu") -> Model:
    c = config if isinstance(config, ModelConfig) else config_from_dict(config, where="config")
    return Model(c, random_params(c, seed, dtype, device))


@torch.no_grad()
def logits(model: Model | tuple, token_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
    """Teacher-forced fp32 logits ``[T, vocab]`` for one sequence, in one prefill pass."""
    c, params = model
    dev = params["norm"].device
    ids = torch.as_tensor(token_ids, dtype=torch.long, device=dev).reshape(-1)
    if ids.numel() == 0:
        raise ValueError("logits() needs at least one token id")
    if int(ids.min()) < 0 or int(ids.max()) >= c.vocab_size:
        raise ValueError(f"token ids must lie in [0, {c.vocab_size}); got range [{int(ids.min())}, {int(ids.max())}]")
    state = init_state(c, ids.numel(), params["norm"].dtype, dev, mtp=False)
    out, _ = forward(params, state, c, ids, 0)
    return out
