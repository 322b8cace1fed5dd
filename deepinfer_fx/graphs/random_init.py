"""Random parameter trees of any config, from the same specs that drive loading."""

from __future__ import annotations

import torch

from ..config import ModelConfig
from .params import build_tree, init_param, param_specs


def random_flat(c: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, mtp: bool = True) -> dict[str, torch.Tensor]:
    """Flat ``{tree path: tensor}`` with every parameter drawn from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return {s.path: init_param(s, gen, dtype, c.n_routed_experts) for s in param_specs(c, mtp=mtp)}


def random_params(c: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.float32, device=None, mtp: bool = True) -> dict:
    flat = random_flat(c, seed, dtype, mtp)
    return build_tree({k: v.to(device) for k, v in flat.items()})
