"""The image processor against plans computed by hand from the reference's formulas."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from tiny_vision import fresh_seed, random_image

from deepinfer_fx.config import load_config
from deepinfer_fx.config import released_config
from deepinfer_fx.vision import preprocess, resize_plan
from deepinfer_fx.vision.processor import pad_offsets
from deepinfer_fx.vision.spans import span_length

PIL = pytest.importorskip("PIL")
from PIL import Image, ImageOps


@pytest.fixture(scope="module")
def released():
    return load_config(released_config("deepseek_v41_flash")).vision


def test_small_image_is_upscaled_to_min_pixels(released) -> None:
    # 300 x 200: scale sqrt(295936 / 60000) = 2.22087..., int() of 666.26 and 444.17; both
    # sides rounded up to whole 14-pixel patches: 672 x 448, patch grid 32 x 48
    plan = resize_plan(300, 200, released)
    assert (plan.width, plan.height) == (672, 448)
    assert plan.grid == (32, 48) and plan.tokens == (11, 16)
    assert span_length(*plan.tokens) == 11 * 17 + 2


def test_large_image_fits_the_box_without_solving(released) -> None:
    # 1000 x 700 is above min_pixels; its box 1008 x 700 costs 17 x 24 tokens = 427 positions
    plan = resize_plan(1000, 700, released)
    assert (plan.width, plan.height, plan.tokens) == (1008, 700, (17, 24))


def test_budget_shrink_keeps_the_float64_floor(released) -> None:
    """1920 x 1062: the box 1932 x 1064 would cost 26 x 46 tokens (1224 > 1024 positions), so
    the plan solves w = sqrt(1022 / r + 1/4) - 1/2 = 42.49, h = w r = 23.50 (r = 1062 / 1920);
    beta = min(42 * 42 / 1920, 23 * 42 / 1062) = 0.90960...; the height side is
    1062 * beta / 14, which is 69 exactly but 68.99999999999999 in float64: the reference's
    floor gives 68 patches (952 px), not 69 (966 px)."""
    w, h = 1920, 1062
    r = h / w
    w_max = math.sqrt(1022 / r + 0.25) - 0.5
    h_max = w_max * r
    assert math.floor(w_max) == 42 and math.floor(h_max) == 23
    beta = min(42 * 42 / w, 23 * 42 / h)
    assert h * beta / 14 == 68.99999999999999
    exact = Fraction(h) * Fraction(23 * 42, h) / 14
    assert exact == 69  # the rational answer the float64 order misses
    plan = resize_plan(w, h, released)
    assert (plan.height, plan.width) == (68 * 14, math.floor(w * beta / 14) * 14) == (952, 1736)
    assert plan.tokens == (23, 42) and span_length(*plan.tokens) == 991  # within the 1024 budget


def test_padding_offsets_round_half_to_even() -> None:
    # a square image into boxes 5 and 7 pixels wider: offsets round(2.5) = 2, round(3.5) = 4
    assert pad_offsets(100, 100, 105, 100) == (2, 0)
    assert pad_offsets(100, 100, 107, 100) == (4, 0)
    assert pad_offsets(100, 100, 100, 109) == (0, 4)  # round(4.5) = 4
    white = Image.new("RGB", (100, 100), (255, 255, 255))
    for box_w, left in ((105, 2), (107, 4)):
        out = np.asarray(ImageOps.pad(white, (box_w, 100), color=(127, 127, 127)))
        cols = np.nonzero(out[50, :, 0] == 255)[0]
        assert cols[0] == left and cols[-1] == left + 99


def test_preprocess_against_a_plain_pipeline(released) -> None:
    """Letterbox with ImageOps.pad, scale to [-1, 1], patch (i, j) element c*196 + y*14 + x =
    pixel (14 i + y, 14 j + x, c): written here element by element for one patch per image."""
    seed = fresh_seed()
    images = [random_image(700, 460, seed), random_image(500, 650, seed + 1).convert("L")]
    pixel_values, grids = preprocess(images, released)
    at = 0
    for im, grid in zip(images, grids):
        plan = resize_plan(im.width, im.height, released)
        assert grid == plan.grid
        boxed = ImageOps.pad(
            im.convert("RGB"), (plan.width, plan.height), method=Image.Resampling.BICUBIC, color=(127, 127, 127)
        )
        x = (np.asarray(boxed, dtype=np.float32) / 255.0 - 0.5) / 0.5
        rows, cols = grid
        i, j = rows // 2, cols - 1
        want = np.empty(588, dtype=np.float32)
        for c in range(3):
            for y in range(14):
                for xx in range(14):
                    want[c * 196 + y * 14 + xx] = x[14 * i + y, 14 * j + xx, c]
        got = pixel_values[at + i * cols + j].numpy()
        assert np.array_equal(got, want)
        at += rows * cols
    assert pixel_values.shape == (at, 588) and pixel_values.dtype == torch.float32


def test_letterbox_pads_with_gray(released) -> None:
    # 1000 x 300 into its box 1008 x 308: fitted 1008 x 302 (round(302.4)), 3 gray rows on top
    im = Image.new("RGB", (1000, 300), (255, 0, 0))
    assert pad_offsets(1000, 300, 1008, 308) == (0, 3)
    pixel_values, _ = preprocess(im, released)
    first_patch = pixel_values[0].view(3, 14, 14)
    gray = (127 / 255 - 0.5) / 0.5
    assert torch.allclose(first_patch[:, :3], torch.full((3, 3, 14), gray))
    assert torch.allclose(first_patch[:, 4:], torch.tensor([1.0, -1.0, -1.0])[:, None, None].expand(3, 10, 14))


def test_corrupt_file_is_one_line(tmp_path) -> None:
    bad = tmp_path / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    with pytest.raises(ValueError, match=r"images\[0\]: not a readable image") as e:
        preprocess([str(bad)], load_config(released_config("deepseek_v41_flash")))
    assert "\n" not in str(e.value)
