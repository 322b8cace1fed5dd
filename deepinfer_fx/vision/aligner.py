"""The aligner: ``r x r`` windows of ViT tokens (pixel-unshuffle) into one text-width token.

Each image's token grid is zero-padded on the bottom and right to multiples of ``r``, cut into
``r x r`` windows in raster order, each window flattened channel-major ``(c, dy, dx)`` as
``F.unfold`` lays it out, then ``w2(gelu(w1 x))`` (exact GELU, both projections with bias)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ..config import VisionConfig
from .vit import _linear, image_bounds


def unshuffle(x: torch.Tensor, gh: int, gw: int, r: int) -> torch.Tensor:
    """One image's tokens ``[gh * gw, C]`` -> ``[ceil(gh / r) * ceil(gw / r), C * r * r]``."""
    grid = x.reshape(gh, gw, -1).permute(2, 0, 1)
    grid = F.pad(grid, (0, -gw % r, 0, -gh % r))
    return F.unfold(grid[None], r, stride=r)[0].transpose(0, 1)


def aligner(p: dict, v: VisionConfig, tokens: torch.Tensor, grids: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
    """Packed ViT tokens of images with patch grids ``grids`` -> one ``[H * W, text hidden]``
    tensor per image, in raster order of its aligner grid."""
    r = v.downsample_ratio
    merged = [unshuffle(tokens[a:b], gh, gw, r) for (a, b), (gh, gw) in zip(image_bounds(grids), grids)]
    y = _linear(F.gelu(_linear(torch.cat(merged), p["w1"], p["w1_bias"])), p["w2"], p["w2_bias"])
    return list(y.split([m.shape[0] for m in merged]))
