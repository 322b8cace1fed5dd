"""Shared helpers for the deepinfer_fx.graphs primitive tests (test_rope_primitives,
test_mhc_primitives, test_compressor_window, test_router_attention): the tiny config, a seeded
generator, a float64 closeness check and the complex-number RoPE reference. Not a test module;
the `seed` fixture lives in tests/unit/conftest.py."""

from __future__ import annotations

import copy

import torch
from tiny import tiny_v4

from deepinfer_fx.config import config_from_dict

YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}
# The models' tiny V4 (every layer kind) at smaller widths, a rope tail of 8 and a 1M-position YaRN.
TINY = tiny_v4(
    vocab_size=64,
    hidden_size=32,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=16,
    o_lora_rank=8,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
    rope_scaling=YARN,
    max_position_embeddings=1048576,
    moe_intermediate_size=16,
)


def tiny_config(**changes):
    d = copy.deepcopy(TINY)
    d.update(changes)
    return config_from_dict(d)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def close(a: torch.Tensor, b: torch.Tensor, msg: str, atol: float = 1e-5, rtol: float = 1e-5) -> None:
    a, b = a.double(), b.double()
    assert a.shape == b.shape, f"{msg}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert torch.allclose(a, b, atol=atol, rtol=rtol), f"{msg}: max abs err {err:.3g}"


def rope_ref(x: torch.Tensor, pos: torch.Tensor, freq: torch.Tensor, sign: float = 1.0) -> torch.Tensor:
    """Complex-number reference: pairs (2i, 2i+1) of the last 2*len(freq) channels as
    x_{2i} + j x_{2i+1}, multiplied by exp(j * pos * f_i). x is [T, ..., d], float64 math."""
    rd = 2 * freq.shape[0]
    xd = x.double()
    tail = xd[..., -rd:]
    z = torch.complex(tail[..., 0::2], tail[..., 1::2])
    ang = pos.double()[:, None] * freq.double()[None, :] * sign
    rot = torch.polar(torch.ones_like(ang), ang).reshape(pos.shape[0], *([1] * (x.dim() - 2)), rd // 2)
    zr = z * rot
    out = xd.clone()
    out[..., -rd:] = torch.stack([zr.real, zr.imag], dim=-1).flatten(-2)
    return out
