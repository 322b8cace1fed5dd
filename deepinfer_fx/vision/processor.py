"""The image processor: resize plan, letterbox, normalisation and 14 x 14 patches.

The plan is the reference ``image_processor.py``'s, computed in Python floats (float64) in its
order of operations, since a floor of a product that lands a hair under an integer moves the
grid by a whole patch: upscale to ``min_pixels``, round both sides up to whole patches, and if
the span would cost more than ``max_image_tokens`` solve for the largest aspect-preserving size
that fits. The image is then fitted into the planned box with PIL's bicubic ``ImageOps.pad`` on
gray 127 (offsets rounded half to even, as Python's ``round``), scaled to [-1, 1] and cut into
patches in raster order, each flattened channel-major ``(c, y, x)``.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..config import VisionConfig
from .spans import span_length


@dataclass(frozen=True)
class Plan:
    """Where one image goes: its pixel box ``height x width`` (whole patches) and its grids."""

    height: int
    width: int
    patch: int
    ratio: int

    @property
    def grid(self) -> tuple[int, int]:
        """ViT patch grid ``(rows, columns)``."""
        return self.height // self.patch, self.width // self.patch

    @property
    def tokens(self) -> tuple[int, int]:
        """Aligner grid ``(H, W)``: the patch grid in ``ratio x ratio`` windows, rounded up."""
        gh, gw = self.grid
        return -(-gh // self.ratio), -(-gw // self.ratio)


def _solve(height: int, width: int, patch: int, ratio: int, max_tokens: int) -> tuple[int, int]:
    """The largest aspect-preserving box whose span fits ``max_tokens``: the span of an
    ``h x w`` token grid is ``h (w + 1) + 2``, so with ``h = w r`` the widest ``w`` solves
    ``r w^2 + w = max_tokens - 2``."""
    r = height / width
    w_max = math.sqrt((max_tokens - 2) / r + 0.25) - 0.5
    h_max = w_max * r
    cell = patch * ratio
    if w_max < 1.0:  # too tall for one full column: one column of the most rows that fit
        return (max_tokens - 2) // 2 * cell, cell
    if h_max < 1.0:  # too wide for one full row: one row of the most columns that fit
        return cell, (max_tokens - 3) * cell
    beta = min(math.floor(w_max) * cell / width, math.floor(h_max) * cell / height)
    # the reference's order: (side * beta) / patch, then floor (a float64 product, not a rational)
    return math.floor(height * beta / patch) * patch, math.floor(width * beta / patch) * patch


def resize_plan(width: int, height: int, v: VisionConfig) -> Plan:
    """The box an image of ``width x height`` pixels is letterboxed into."""
    if width <= 0 or height <= 0:
        raise ValueError(f"an image of {width} x {height} pixels has no area")
    patch, ratio = v.patch_size, v.downsample_ratio
    w, h = width, height
    if v.max_wh_ratio is not None and w > h * v.max_wh_ratio:
        w = h * v.max_wh_ratio
    if w * h < v.min_pixels:
        scale = (v.min_pixels / (w * h)) ** 0.5
        w, h = int(w * scale), int(h * scale)
    box_w, box_h = math.ceil(w / patch) * patch, math.ceil(h / patch) * patch
    plan = Plan(box_h, box_w, patch, ratio)
    if span_length(*plan.tokens) > v.max_image_tokens:
        box_h, box_w = _solve(h, w, patch, ratio, v.max_image_tokens)
        plan = Plan(box_h, box_w, patch, ratio)
        if span_length(*plan.tokens) > v.max_image_tokens:
            raise ValueError(f"no box of an image of {width} x {height} fits {v.max_image_tokens} image tokens")
    return plan


def fit_size(width: int, height: int, box_w: int, box_h: int) -> tuple[int, int]:
    """``ImageOps.contain``'s size: the image scaled into the box, one side exact, the other
    rounded (Python's round, half to even)."""
    image_ratio, box_ratio = width / height, box_w / box_h
    if image_ratio > box_ratio:
        return box_w, round(height / width * box_w)
    if image_ratio < box_ratio:
        return round(width / height * box_h), box_h
    return box_w, box_h


def pad_offsets(width: int, height: int, box_w: int, box_h: int) -> tuple[int, int]:
    """``(left, top)`` of the fitted image inside the box, as ``ImageOps.pad`` centres it."""
    w, h = fit_size(width, height, box_w, box_h)
    if w != box_w:
        return round((box_w - w) * 0.5), 0
    return 0, round((box_h - h) * 0.5)


def load_image(image: Any, where: str) -> Any:
    """A PIL RGB image from a PIL image, a path or bytes; a file PIL cannot read is a
    ``ValueError`` naming ``where``."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, (str, os.PathLike)):
        source: Any = os.fspath(image)
    elif isinstance(image, (bytes, bytearray)):
        source = io.BytesIO(bytes(image))
    else:
        # ValueError, as every bad input of a request (engine/inputs.py): the CLI prints it as one line
        raise ValueError(f"{where} is {type(image).__name__}; pass a PIL image, a file path or the file's bytes")  # noqa: TRY004
    try:
        with Image.open(source) as im:
            return im.convert("RGB")  # convert() decodes the whole file, so truncation shows here
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file {source!r}") from None
    except (UnidentifiedImageError, OSError, SyntaxError) as e:
        raise ValueError(f"{where}: not a readable image ({e})") from None


def letterbox(image: Any, plan: Plan, v: VisionConfig) -> Any:
    """The image in its planned box: squeezed into it past ``max_wh_ratio``, else fitted with
    PIL's bicubic ``ImageOps.pad`` on gray."""
    from PIL import Image, ImageOps

    if v.max_wh_ratio is not None and image.width >= v.max_wh_ratio * image.height:
        return image.resize((plan.width, plan.height), Image.Resampling.BICUBIC)
    gray = (v.pad_value,) * 3
    return ImageOps.pad(
        image, (plan.width, plan.height), method=Image.Resampling.BICUBIC, color=gray, centering=(0.5, 0.5)
    )


def patchify(pixels: np.ndarray, patch: int) -> np.ndarray:
    """``[H, W, 3]`` floats -> ``[rows * cols, 3 * patch * patch]``: raster order of patches,
    each flattened channel-major (the patch projection's input layout)."""
    h, w, c = pixels.shape
    grid = pixels.reshape(h // patch, patch, w // patch, patch, c)
    return grid.transpose(0, 2, 4, 1, 3).reshape((h // patch) * (w // patch), c * patch * patch)


def preprocess_one(image: Any, v: VisionConfig, where: str = "image") -> tuple[np.ndarray, tuple[int, int]]:
    """One image -> its patches ``[rows * cols, 588]`` (float32) and patch grid ``(rows, cols)``."""
    rgb = load_image(image, where)
    plan = resize_plan(rgb.width, rgb.height, v)
    boxed = letterbox(rgb, plan, v)
    x = np.asarray(boxed, dtype=np.float32) / 255.0
    x = (x - 0.5) / 0.5  # mean 0.5, std 0.5 per channel
    return patchify(x, v.patch_size), plan.grid


def preprocess(images: Any | Sequence[Any], config: Any) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """Images (one, or a list) -> ``pixel_values`` ``[patches, 588]`` float32, every image's
    patches in turn, and each image's patch grid ``(rows, cols)``. ``config``: a
    ``ModelConfig`` with a vision tower, or its ``VisionConfig``."""
    v = config if isinstance(config, VisionConfig) else getattr(config, "vision", None)
    if v is None:
        raise ValueError("this model has no vision tower (its config has no vision_config); it takes no images")
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    if not items:
        raise ValueError("preprocess() needs at least one image")
    parts, grids = [], []
    for i, im in enumerate(items):
        patches, grid = preprocess_one(im, v, f"images[{i}]")
        parts.append(patches)
        grids.append(grid)
    return torch.from_numpy(np.concatenate(parts)), grids
