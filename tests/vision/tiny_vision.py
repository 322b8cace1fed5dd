"""A tiny V4.1 model with a vision tower (real patch size 14 and 3 x 3 aligner, tiny widths)."""

from __future__ import annotations

import random

import numpy as np
from tiny import tiny_v41

IMAGE_TOKEN = 299
VISION = {
    "model_type": "deepseek_v41_vision",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 2,
    "intermediate_size": 24,
    "patch_size": 14,
    "rope_theta": 10000,
    "downsample_ratio": 3,
    "max_image_tokens": 40,
    "min_pixels": 42 * 42 * 4,
}


def tiny_vision_config(for_writer: bool = False, **text) -> dict:
    """``for_writer``: leave the Engram sizes to ``write_random_checkpoint``, which derives them
    from the tokenizer it writes."""
    cfg = tiny_v41(**text)
    if for_writer:
        del cfg["engram_compressed_vocab_size"], cfg["engram_num_embeddings"]
    return {
        "model_type": "deepseek_v41",
        "text_config": cfg,
        "eos_token_id": [1, 2],
        "image_token_id": IMAGE_TOKEN,
        "vision_config": dict(VISION),
    }


def fresh_seed() -> int:
    return random.SystemRandom().randrange(2**31)


def random_image(width: int, height: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")
