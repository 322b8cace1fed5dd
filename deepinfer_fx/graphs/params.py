"""Parameter specs: every parameter declared once.

A spec names the tree path the model functions read, the checkpoint key (DeepSeek's own
spelling), the logical shape, the storage class, the logical axes the sharding rules map to
mesh axes, the initialiser for random models and the quantised format the checkpoint uses.
The same list builds random models, counts parameters without allocating, and drives loading.
The spec class is ``param_spec.ParamSpec``; one block's specs come from ``block_params.py``.
"""

from __future__ import annotations

from ..config import ModelConfig
from ..vision.params import is_vision_path, vision_specs
from .block_params import block_specs, hc_head_specs, hold_dense, linear_spec, norm_spec
from .param_spec import ParamSpec


def backbone_specs(c: ModelConfig) -> list[ParamSpec]:
    v, d = c.vocab_size, c.hidden_size
    specs = [
        ParamSpec("embed", "embed.weight", (v, d), ("vocab", "embed")),
        ParamSpec(
            "head", "head.weight", (v, d), ("vocab", "embed")
        ),  # fp32 accumulation, not storage: norm.linear_fp32
        norm_spec("norm", d),
    ]
    if not c.is_v41:  # V4.1 collapses the streams with the last site's pre: no learned hc_head
        specs += hc_head_specs("", c)
    for layer, ratio in enumerate(c.compress_ratios):
        specs += block_specs(f"layers.{layer}", c, ratio, layer < c.num_hash_layers, layer)
    return hold_dense(specs, c)


def engram_specs(c: ModelConfig) -> list[ParamSpec]:
    return [s for s in backbone_specs(c) if ".engram." in s.path]


def mtp_specs(c: ModelConfig) -> list[ParamSpec]:
    """Everything under ``mtp.*``: the DSpark drafter when the config has one, else the MTP-1
    blocks. Loading, writing and counting treat both alike as "the draft model"."""
    if c.dspark_stages:
        return hold_dense(dspark_specs(c), c)
    specs: list[ParamSpec] = []
    d = c.hidden_size
    for s in range(c.num_nextn_predict_layers):
        p = f"mtp.{s}"
        specs += block_specs(p, c, 0, False)
        specs += [
            linear_spec(f"{p}.e_proj", d, d, ("embed", None), "fp8"),
            linear_spec(f"{p}.h_proj", d, d, ("embed", None), "fp8"),
            norm_spec(f"{p}.enorm", d),
            norm_spec(f"{p}.hnorm", d),
            norm_spec(f"{p}.norm", d),
        ] + hc_head_specs(p, c)
    return hold_dense(specs, c)


def dspark_stage_config(c: ModelConfig) -> ModelConfig:
    """The config a DSpark stage runs its block with: the trunk's, but with the drafter's own
    routed-expert count and top-k (V4.1: 128 / top-3; V4-0731: the trunk's 256 / top-6). The
    MoE functions read both from the config, so the stages share them with the backbone."""
    return c.replace(n_routed_experts=c.dspark_n_routed_experts, num_experts_per_tok=c.dspark_num_experts_per_tok)


def dspark_specs(c: ModelConfig) -> list[ParamSpec]:
    """The DSpark drafter (spec §7.9, §3.11, §9): ``mtp.0`` holds the context projection
    (``main_proj`` over the concatenated target-layer states, ``main_norm``); every stage is a
    window-only block with the drafter's experts; the last stage holds the output norm, the
    Markov head and the confidence head, and on V4 (V4-Flash-0731) a learned ``hc_head``
    (V4.1 collapses with the last FFN site's ``pre`` instead)."""
    d, v, r = c.hidden_size, c.vocab_size, c.dspark_markov_rank
    stage_c = dspark_stage_config(c)
    specs = [
        linear_spec("mtp.0.main_proj", d, len(c.dspark_target_layer_ids) * d, ("embed", None), "fp8"),
        norm_spec("mtp.0.main_norm", d),
    ]
    for s in range(c.dspark_stages):
        specs += block_specs(f"mtp.{s}", stage_c, 0, False)
    last = f"mtp.{c.dspark_stages - 1}"
    specs += [
        norm_spec(f"{last}.norm", d),
        # Stored in the model dtype (the released byte budget fits bf16); the bias is computed in fp32.
        ParamSpec(f"{last}.markov_head.embed", f"{last}.markov_head.embed.weight", (v, r), ("vocab", None)),
        ParamSpec(f"{last}.markov_head.head", f"{last}.markov_head.head.weight", (v, r), ("vocab", None)),
        ParamSpec(
            f"{last}.confidence_head.proj", f"{last}.confidence_head.proj.weight", (1, d + r), (None, None), fp32=True
        ),
    ]
    if not c.is_v41:
        specs += hc_head_specs(last, c)
    return specs


def param_specs(c: ModelConfig, mtp: bool = True) -> list[ParamSpec]:
    """Every spec of ``c``: the backbone, the draft layers (``mtp``) and the vision path (last,
    so that a seeded random tree draws the same text weights with or without it)."""
    return backbone_specs(c) + (mtp_specs(c) if mtp else []) + vision_specs(c)


def count_params(c: ModelConfig, mtp: bool = False, engram: bool = False, vision: bool = False) -> int:
    """Parameters of a config, counted from the specs without allocating. The draft layers
    (``mtp.*``), V4.1's Engram tables and its vision path are left out unless asked for: the
    published backbone sizes count none of them. Block scales of weights held in fp8 are not
    parameters."""
    return sum(
        s.numel
        for s in param_specs(c, mtp=mtp)
        if (engram or ".engram." not in s.path) and (vision or not is_vision_path(s.path)) and s.held != "scale"
    )
