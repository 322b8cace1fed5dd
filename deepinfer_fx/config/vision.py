"""The vision tower's configuration: the composite V4.1 config's ``vision_config``, parsed into
a frozen dataclass that ``ModelConfig.vision`` carries (None: a text-only model)."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import ConfigError, _num

# HF DeepseekV41VisionConfig's defaults, which are the released model's values (spec §1.2).
RELEASED = {
    "num_hidden_layers": 32,
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "intermediate_size": 2816,
    "patch_size": 14,
    "rope_theta": 10000.0,
    "downsample_ratio": 3,
    "max_image_tokens": 1024,
    "min_pixels": 295936,
}


@dataclass(frozen=True)
class VisionConfig:
    num_hidden_layers: int
    hidden_size: int
    num_attention_heads: int
    intermediate_size: int
    patch_size: int
    rope_theta: float
    downsample_ratio: int
    max_image_tokens: int
    min_pixels: int
    max_wh_ratio: float | None = None  # None: no cap on width / height (the released value)
    rms_norm_eps: float = 1e-6  # the reference ViT's RMSNorm eps, not in config.json
    pad_value: int = 127  # letterbox gray, per channel

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def patch_dim(self) -> int:
        """Inputs of the patch projection: 3 channels x patch x patch (588 at patch 14)."""
        return 3 * self.patch_size**2

    @property
    def merged_dim(self) -> int:
        """Aligner input width: ``downsample_ratio**2`` ViT tokens concatenated."""
        return self.hidden_size * self.downsample_ratio**2


def parse_vision(d: dict | None, where: str) -> VisionConfig | None:
    """``vision_config`` of a composite config (absent: None); missing fields take the released
    values, as HF's config class does."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: 'vision_config' must be an object, got {type(d).__name__}")
    where = f"{where} (vision_config)"
    mt = d.get("model_type", "deepseek_v41_vision")
    if mt != "deepseek_v41_vision":
        raise ConfigError(f"{where}: model_type is {mt!r}; expected 'deepseek_v41_vision'")
    ints = {k: _num(d, k, where, int, v) for k, v in RELEASED.items() if k != "rope_theta"}
    ratio = d.get("max_wh_ratio")
    v = VisionConfig(
        rope_theta=_num(d, "rope_theta", where, float, RELEASED["rope_theta"]),
        max_wh_ratio=None if ratio is None else _num(d, "max_wh_ratio", where, float),
        **ints,
    )
    for k in (
        "num_hidden_layers",
        "hidden_size",
        "num_attention_heads",
        "intermediate_size",
        "patch_size",
        "downsample_ratio",
        "min_pixels",
    ):
        if getattr(v, k) < 1:
            raise ConfigError(f"{where}: '{k}' must be positive, got {getattr(v, k)}")
    if v.hidden_size % v.num_attention_heads or v.head_dim % 4:
        # 2-D RoPE splits each head into a row half and a column half of rotated pairs
        raise ConfigError(
            f"{where}: hidden_size {v.hidden_size} / num_attention_heads {v.num_attention_heads} "
            "must be a head width divisible by 4 (2-D RoPE)"
        )
    if v.max_image_tokens < 4:
        raise ConfigError(f"{where}: 'max_image_tokens' is {v.max_image_tokens}; a span needs at least 4 tokens")
    if v.max_wh_ratio is not None and v.max_wh_ratio <= 0:
        raise ConfigError(f"{where}: 'max_wh_ratio' must be positive or null")
    return v
