"""Rotary embedding on the tail of each head: adjacent channel pairs, optional YaRN.

Only the last ``rope_dim`` channels of a vector rotate; pairs are (2i, 2i+1) read as one
complex number. Window-only layers use ``rope_theta`` without scaling; layers with a
compressor use ``compress_rope_theta`` with YaRN (and no mscale), for every tensor they rotate.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from ..config import ModelConfig, Yarn
from .norm import rms_norm
from .swap import swappable


@lru_cache(maxsize=32)
def _inv_freq(rope_dim: int, theta: float, yarn: Yarn | None, device: torch.device | None = None) -> torch.Tensor:
    # built on the device it is used on: a host->device copy inside a step would not replay in a CUDA graph
    freq = 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float32, device=device) / rope_dim)
    if yarn is None:
        return freq

    def corr(rotations: float) -> float:
        return (
            rope_dim
            * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(theta))
        )

    low = max(math.floor(corr(yarn.beta_fast)), 0)
    high = min(math.ceil(corr(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 1e-3
    ramp = ((torch.arange(rope_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    return freq / yarn.factor * ramp + freq * (1 - ramp)


def inv_freq(c: ModelConfig, compressed: bool, device: torch.device | str | None = None) -> torch.Tensor:
    """Per-pair frequencies for a layer: ``compressed`` layers (ratio != 0) use the YaRN table."""
    device = torch.device(device) if device is not None else None
    # traced steps compute the table in the graph (a cached tensor would be a hidden input)
    table = _inv_freq.__wrapped__ if torch.compiler.is_compiling() else _inv_freq
    if compressed:
        return table(c.rope_dim, c.compress_rope_theta, c.yarn, device)
    return table(c.rope_dim, c.rope_theta, None, device)


@swappable
def cos_sin(positions: torch.Tensor, freq: torch.Tensor, shared: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 tables ``[*positions.shape, rope_dim // 2]``. ``shared``: the tables serve a whole
    forward (every attention layer of a kind rotates by them), so a compiled step should hold
    them in one buffer whatever their size (the ``rope_table_op`` swap)."""
    angles = positions.float()[..., None] * freq.to(positions.device)
    return angles.cos(), angles.sin()


@swappable
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the last ``2 * cos.shape[-1]`` channels of x. x is ``[*P, ..., d]``; cos/sin are
    ``[*P, rd/2]`` (one row per position) and broadcast over the middle dims. ``inverse``
    rotates by the negative angle."""
    rd = 2 * cos.shape[-1]
    mid = [1] * (x.dim() - cos.dim())
    cos = cos.reshape(*cos.shape[:-1], *mid, cos.shape[-1])
    sin = sin.reshape(*sin.shape[:-1], *mid, sin.shape[-1])
    if inverse:
        sin = -sin
    tail = x[..., -rd:].float().unflatten(-1, (rd // 2, 2))
    a, b = tail[..., 0], tail[..., 1]
    rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], rotated.to(x.dtype)], dim=-1)


@swappable
def norm_rope(
    x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """``apply_rope(rms_norm(x, weight, eps), cos, sin)``: the normed query heads and K = V
    latent, rotated. One place, so a kernel can norm and rotate a row in one pass
    (``passes/swaps.py``) where the compiled step ran a norm, a rotation of the tail and a
    concatenation of the two halves as three launches."""
    return apply_rope(rms_norm(x, weight, eps), cos, sin)
