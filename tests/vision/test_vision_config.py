"""vision_config parsing: the released values, defaults, and one-line errors."""

from __future__ import annotations

import pytest
from tiny_vision import tiny_vision_config

from deepinfer_fx.config import ConfigError, config_from_dict, load_config
from deepinfer_fx.config import released_config
from deepinfer_fx.graphs.params import count_params, param_specs


def test_released_vision_config() -> None:
    c = load_config(released_config("deepseek_v41_flash"))
    v = c.vision
    assert (v.num_hidden_layers, v.hidden_size, v.num_attention_heads, v.intermediate_size) == (32, 1024, 16, 2816)
    assert (v.patch_size, v.downsample_ratio, v.max_image_tokens, v.min_pixels, v.max_wh_ratio) == (
        14,
        3,
        1024,
        295936,
        None,
    )
    assert c.image_token_id == 129264 and v.patch_dim == 588 and v.merged_dim == 9216
    vision = count_params(c, vision=True) - count_params(c)
    # ViT 32 x (qkv + wo + mlp + norms) + patch embed + aligner (9216 -> 5120 -> 5120) + 3 span embeddings
    block = 3 * 1024 * 1024 + 3 * 1024 + 1024 * 1024 + 1024 + 2 * 2816 * 1024 + 2816 * 1024 + 2 * 1024
    want = 32 * block + 1024 * 588 + 1024 + 1024 + 5120 * 9216 + 5120 + 5120 * 5120 + 5120 + 3 * 5120
    assert vision == want
    assert (
        sum(s.numel for s in param_specs(c, mtp=False) if s.path.startswith(("vision.", "aligner.", "image_"))) == want
    )


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"num_attention_heads": 3}, r"hidden_size 32 / num_attention_heads 3 must be a head width divisible by 4"),
        ({"max_image_tokens": 3}, r"'max_image_tokens' is 3"),
        ({"patch_size": 0}, r"'patch_size' must be positive"),
        ({"model_type": "siglip"}, r"model_type is 'siglip'"),
    ],
)
def test_bad_vision_config_is_one_line(change, match) -> None:
    cfg = tiny_vision_config()
    cfg["vision_config"].update(change)
    with pytest.raises(ConfigError, match=match) as e:
        config_from_dict(cfg)
    assert "\n" not in str(e.value) and "vision_config" in str(e.value)


def test_vision_needs_an_image_token() -> None:
    cfg = tiny_vision_config()
    del cfg["image_token_id"]
    with pytest.raises(ConfigError, match=r"'image_token_id' is missing"):
        config_from_dict(cfg)
