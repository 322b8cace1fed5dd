"""Parameter specs of the vision tower, the aligner and the span embeddings, in the
checkpoint's own names (``vision.*``, ``aligner.*``, ``image_start/end/newline``). A bias lives
beside its weight in the tree as ``<name>_bias``. All are replicated (no logical axes)."""

from __future__ import annotations

from ..config import ModelConfig
from ..graphs.param_spec import ParamSpec

VISION_ROOTS = ("vision", "aligner", "image_start", "image_end", "image_newline")


def _linear(path: str, out: int, inp: int, bias: bool) -> list[ParamSpec]:
    specs = [ParamSpec(path, f"{path}.weight", (out, inp), (None, None))]
    if bias:
        specs.append(ParamSpec(f"{path}_bias", f"{path}.bias", (out,), (None,), init="zeros"))
    return specs


def _norm(path: str, dim: int) -> ParamSpec:
    return ParamSpec(path, f"{path}.weight", (dim,), (None,), init="ones")


def vision_specs(c: ModelConfig) -> list[ParamSpec]:
    """The specs of ``c``'s vision path (none for a text-only config)."""
    v = c.vision
    if v is None:
        return []
    d, inter, text = v.hidden_size, v.intermediate_size, c.hidden_size
    specs = _linear("vision.patch_embed.proj", d, v.patch_dim, bias=True)
    for i in range(v.num_hidden_layers):
        b = f"vision.blocks.{i}"
        specs += [_norm(f"{b}.norm1", d), _norm(f"{b}.norm2", d)]
        specs += _linear(f"{b}.attn.wqkv", 3 * d, d, bias=True) + _linear(f"{b}.attn.wo", d, d, bias=True)
        specs += _linear(f"{b}.mlp.w1", 2 * inter, d, bias=False) + _linear(f"{b}.mlp.w2", d, inter, bias=False)
    specs.append(_norm("vision.norm", d))
    specs += _linear("aligner.w1", text, v.merged_dim, bias=True) + _linear("aligner.w2", text, text, bias=True)
    specs += [ParamSpec(name, name, (text,), (None,)) for name in ("image_start", "image_end", "image_newline")]
    return specs


def is_vision_path(path: str) -> bool:
    return path.split(".", 1)[0] in VISION_ROOTS
