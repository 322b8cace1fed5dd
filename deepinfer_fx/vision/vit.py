"""The DeepSeek ViT as pure functions over ``params["vision"]``.

Patches ``[P, 588]`` of several images, packed one image after another, go through a linear
patch projection, pre-norm blocks (RMSNorm; fused qkv with bias; 2-D rotate-half RoPE on the
patch's row and column; softmax attention within each image only; output projection with bias;
RMSNorm; bias-free SwiGLU) and a final RMSNorm. Projections and the MLP run on all packed
patches at once; attention runs image by image, so a batch of images gives each image's rows
as it alone would (up to the GEMMs' blocking by row count). A block is its two halves around
the attention, which ``vision/compiled.py`` compiles.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..graphs.norm import rms_norm
from ..config import VisionConfig


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, w.to(x.dtype), None if b is None else b.to(x.dtype))


def rope_tables(
    grids: Sequence[tuple[int, int]], head_dim: int, theta: float, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos``, ``sin`` ``[P, head_dim / 2]`` for the packed patches of ``grids``: a head's
    first ``head_dim / 4`` angles turn with the patch's row, the next with its column, at
    frequencies ``theta ** (-j / (head_dim / 4))``."""
    quarter = head_dim // 4
    inv = 1.0 / (theta ** (torch.arange(quarter, dtype=torch.float32, device=device) / quarter))
    rows, cols = [], []
    for gh, gw in grids:
        rows.append(torch.arange(gh, device=device).repeat_interleave(gw))
        cols.append(torch.arange(gw, device=device).repeat(gh))
    r = torch.cat(rows).float()[:, None] * inv
    c = torch.cat(cols).float()[:, None] * inv
    angles = torch.cat([r, c], dim=-1)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on ``x`` ``[P, heads, head_dim]`` in fp32: channel i pairs with
    channel ``i + head_dim / 2`` and turns by angle i."""
    x1, x2 = x.float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def attention_inputs(
    p: dict, v: VisionConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A block up to its attention: RMSNorm, fused qkv, RoPE on q and k -> q, k, v ``[P, heads, head_dim]``."""
    n, heads, hd = x.shape[0], v.num_attention_heads, v.head_dim
    h = rms_norm(x, p["norm1"], v.rms_norm_eps)
    q, k, val = _linear(h, p["attn"]["wqkv"], p["attn"]["wqkv_bias"]).view(n, 3, heads, hd).unbind(1)
    return rotate(q, cos, sin), rotate(k, cos, sin), val


def attend(q: torch.Tensor, k: torch.Tensor, val: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Softmax attention of each image's rows ``[a:b]`` among themselves (``bounds``)."""
    out = torch.empty_like(q)
    for a, b in bounds:  # one image at a time: no mask, and each image's result is its own
        # [1, heads, rows, head_dim]: the fused (flash) kernels take 4-D inputs only, 3-D ones fall back to math
        out[a:b] = F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1)[None] for t in (q, k, val)))[0].transpose(
            0, 1
        )
    return out


def block_rest(p: dict, v: VisionConfig, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
    """A block after its attention: output projection and residual, RMSNorm, SwiGLU and residual."""
    x = x + _linear(attended.reshape(x.shape[0], -1), p["attn"]["wo"], p["attn"]["wo_bias"])
    return x + mlp(p["mlp"], rms_norm(x, p["norm2"], v.rms_norm_eps))


def mlp(p: dict, x: torch.Tensor) -> torch.Tensor:
    """Bias-free SwiGLU: ``w1`` holds the gate rows, then the up rows."""
    gate, up = _linear(x, p["w1"]).chunk(2, dim=-1)
    return _linear(F.silu(gate) * up, p["w2"])


@dataclass(frozen=True)
class BlockParts:
    """The two halves of a block around its per-image attention, as they run: these functions
    (``EAGER``), or compiled (``vision/compiled.py``)."""

    attention_inputs: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = attention_inputs
    block_rest: Callable[..., torch.Tensor] = block_rest


EAGER = BlockParts()


def block(
    p: dict,
    v: VisionConfig,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    bounds: Sequence[tuple[int, int]],
    parts: BlockParts = EAGER,
) -> torch.Tensor:
    q, k, val = parts.attention_inputs(p, v, x, cos, sin)
    return parts.block_rest(p, v, x, attend(q, k, val, bounds))


def image_bounds(grids: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``(first, end)`` packed row of each image's patches."""
    out, at = [], 0
    for gh, gw in grids:
        out.append((at, at + gh * gw))
        at += gh * gw
    return out


def vit(
    p: dict,
    v: VisionConfig,
    pixel_values: torch.Tensor,
    grids: Sequence[tuple[int, int]],
    parts: BlockParts = EAGER,
) -> torch.Tensor:
    """Packed patches ``[P, 3 * patch**2]`` of images with patch grids ``grids`` -> the
    final-normed patch tokens ``[P, hidden]`` in the weights' dtype (``parts``: how the blocks run)."""
    bounds = image_bounds(grids)
    if pixel_values.dim() != 2 or pixel_values.shape != (bounds[-1][1], v.patch_dim):
        raise ValueError(
            f"pixel_values is {list(pixel_values.shape)}; grids {list(grids)} need [{bounds[-1][1]}, {v.patch_dim}]"
        )
    w = p["patch_embed"]["proj"]
    x = _linear(pixel_values.to(device=w.device, dtype=w.dtype), w, p["patch_embed"]["proj_bias"])
    cos, sin = rope_tables(grids, v.head_dim, v.rope_theta, device=x.device)
    for bp in p["blocks"]:
        x = block(bp, v, x, cos, sin, bounds, parts)
    return rms_norm(x, p["norm"], v.rms_norm_eps)
