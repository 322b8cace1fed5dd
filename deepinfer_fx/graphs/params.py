"""Parameter specs: every parameter declared once.

A spec names the tree path the model functions read, the checkpoint key (DeepSeek's own
spelling), the logical shape, the storage class, the logical axes the sharding rules map to
mesh axes, the initialiser for random models and the quantised format the checkpoint uses.
The same list builds random models, counts parameters without allocating, and drives loading.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterator

import torch

from ..config import ModelConfig
from ..io.quant import MXFP4_BLOCK


@dataclass(frozen=True)
class ParamSpec:
    path: str  # tree path, e.g. "layers.3.attn.wq_a"
    key: str  # checkpoint key; "{e}" marks a per-expert key stacked on dim 0
    shape: tuple[int, ...]
    axes: tuple[str | None, ...]  # logical axis per dim
    init: str = "normal"  # normal (fan-in scaled) | ones (1 + noise) | zeros (small noise)
    fp32: bool = False  # kept in float32 whatever the activation dtype (mHC, sinks, biases, ape)
    quant: str | None = None  # checkpoint storage: "fp8" (block), "fp4" (MXFP4) or None
    integer: bool = False
    high: int | None = None  # integer tensors: every value lies in [0, high) (checked at load)
    # Held in memory as stored rather than dequantised: "fp8" (a float8_e4m3fn weight, whose fp32
    # block scales are the spec at ``scale_path(path)``), "fp4" (MXFP4: uint8 bytes of two e2m1
    # codes, the even k in the low nibble, with ue8m0 byte scales per 32 at ``scale_path``) or
    # "scale" (those scales).
    held: str | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def stacked(self) -> bool:
        return "{e}" in self.key

    def dtype(self, run: torch.dtype) -> torch.dtype:
        """The tensor's dtype in a tree whose activations are ``run``."""
        if self.integer:
            return torch.long
        if self.held == "fp8":
            return torch.float8_e4m3fn
        if self.held == "fp4" or (self.held == "scale" and not self.fp32):
            return torch.uint8
        return torch.float32 if self.fp32 else run

    @property
    def held_shape(self) -> tuple[int, ...]:
        """The shape of the tensor in memory: ``shape`` but for MXFP4's two values a byte."""
        return (*self.shape[:-1], self.shape[-1] // 2) if self.held == "fp4" else self.shape


def scale_path(path: str) -> str:
    """The tree path of the scales of a weight held as stored (``...experts.w1_scale``)."""
    return f"{path}_scale"


def _linear(path: str, out: int, inp: int, axes: tuple[str | None, str | None], quant: str | None) -> ParamSpec:
    return ParamSpec(path, path + ".weight", (out, inp), axes, quant=quant)


def _norm(path: str, dim: int) -> ParamSpec:
    return ParamSpec(path, path + ".weight", (dim,), (None,), init="ones")


def _hc_site(prefix: str, site: str, c: ModelConfig) -> list[ParamSpec]:
    n, d = c.hc_mult, c.hidden_size
    return [
        ParamSpec(f"{prefix}.hc_{site}_fn", f"{prefix}.hc_{site}_fn", ((2 + n) * n, n * d), (None, None), fp32=True),
        ParamSpec(
            f"{prefix}.hc_{site}_base", f"{prefix}.hc_{site}_base", ((2 + n) * n,), (None,), init="zeros", fp32=True
        ),
        ParamSpec(f"{prefix}.hc_{site}_scale", f"{prefix}.hc_{site}_scale", (3,), (None,), init="ones", fp32=True),
    ]


def _hc_head(prefix: str, c: ModelConfig) -> list[ParamSpec]:
    n, d = c.hc_mult, c.hidden_size
    p = f"{prefix}." if prefix else ""
    return [
        ParamSpec(f"{p}hc_head_fn", f"{p}hc_head_fn", (n, n * d), (None, None), fp32=True),
        ParamSpec(f"{p}hc_head_base", f"{p}hc_head_base", (n,), (None,), init="zeros", fp32=True),
        ParamSpec(f"{p}hc_head_scale", f"{p}hc_head_scale", (1,), (None,), init="ones", fp32=True),
    ]


def _compressor(prefix: str, c: ModelConfig, dim: int, ratio: int) -> list[ParamSpec]:
    width = dim * (2 if ratio == c.csa_ratio else 1)  # CSA overlaps two windows: two series per token
    return [
        _linear(f"{prefix}.wkv", width, c.hidden_size, ("compress", "embed"), None),
        _linear(f"{prefix}.wgate", width, c.hidden_size, ("compress", "embed"), None),
        ParamSpec(f"{prefix}.ape", f"{prefix}.ape", (ratio, width), (None, None), init="zeros", fp32=True),
        _norm(f"{prefix}.norm", dim),
    ]


def _attention_common(a: str, c: ModelConfig) -> list[ParamSpec]:
    """Projections every attention layer of both generations owns."""
    h, hd, d = c.num_attention_heads, c.head_dim, c.hidden_size
    return [
        _linear(f"{a}.wq_a", c.q_lora_rank, d, (None, "embed"), "fp8"),
        _norm(f"{a}.q_norm", c.q_lora_rank),
        _linear(f"{a}.wq_b", h * hd, c.q_lora_rank, ("heads", None), "fp8"),
        _linear(f"{a}.wkv", hd, d, (None, "embed"), "fp8"),
        _norm(f"{a}.kv_norm", hd),
        _linear(f"{a}.wo_a", c.o_groups * c.o_lora_rank, h * hd // c.o_groups, ("heads", None), "fp8"),
        _linear(f"{a}.wo_b", d, c.o_groups * c.o_lora_rank, ("embed", None), "fp8"),
        ParamSpec(f"{a}.attn_sink", f"{a}.attn_sink", (h,), ("heads",), init="zeros", fp32=True),
    ]


def _attention(prefix: str, c: ModelConfig, ratio: int) -> list[ParamSpec]:
    hd, d = c.head_dim, c.hidden_size
    a = f"{prefix}.attn"
    specs = _attention_common(a, c)
    if ratio:
        specs += _compressor(f"{a}.compressor", c, hd, ratio)
    if ratio == c.csa_ratio:
        hi, di = c.index_n_heads, c.index_head_dim
        specs += [
            _linear(f"{a}.indexer.wq_b", hi * di, c.q_lora_rank, (None, None), "fp8"),
            _linear(f"{a}.indexer.weights_proj", hi, d, (None, "embed"), None),
        ]
        specs += _compressor(f"{a}.indexer.compressor", c, di, ratio)
    return specs


def _attention_v41(prefix: str, c: ModelConfig, layer: int) -> list[ParamSpec]:
    """V4.1 (CSA2): the common projections, plus a compressor and index-key projection on KV
    sources and an indexer query head on index sources; reuse layers own neither."""
    hd, d = c.head_dim, c.hidden_size
    a = f"{prefix}.attn"
    specs = _attention_common(a, c)
    if c.compress_ratios[layer] and c.is_kv_source(layer):
        specs.append(_linear(f"{a}.compressor.wkv", hd, d, ("compress", "embed"), None))
        if c.compress_ratios[layer] > 1:
            specs.append(_linear(f"{a}.compressor.wgate", hd, d, ("compress", "embed"), None))
        specs += [
            _norm(f"{a}.compressor.norm", hd),
            _linear(f"{a}.indexer.wk", c.index_head_dim, hd, (None, None), None),
            _norm(f"{a}.indexer.k_norm", c.index_head_dim),
        ]
    if c.compress_ratios[layer] and c.is_index_source(layer):
        specs += [
            _linear(f"{a}.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank, (None, None), "fp8"),
            _linear(f"{a}.indexer.weights_proj", c.index_n_heads, d, (None, "embed"), None),
        ]
    return specs


def _engram(prefix: str, c: ModelConfig, layer: int) -> list[ParamSpec]:
    e = f"{prefix}.engram"
    rows = c.engram_num_embeddings[c.engram_layer_ids.index(layer)]
    cols = (c.engram_max_ngram_size - 1) * c.engram_n_heads * c.engram_head_dim
    d, n = c.hidden_size, c.hc_mult
    return [
        # fp8 rows with a ue8m0 scale per 32 channels; read row by row from a memory map
        ParamSpec(f"{e}.embed", f"{e}.embed.weight", (rows, c.engram_head_dim), (None, None), quant="engram"),
        _linear(f"{e}.wkv", (n + 1) * d, cols, (None, None), "fp8"),
        ParamSpec(f"{e}.q_weight", f"{e}.q_weight", (n, d), (None, "embed"), init="ones"),
        ParamSpec(f"{e}.k_weight", f"{e}.k_weight", (n, d), (None, "embed"), init="ones"),
    ]


def _moe(prefix: str, c: ModelConfig, hashed: bool) -> list[ParamSpec]:
    e, i, d = c.n_routed_experts, c.moe_intermediate_size, c.hidden_size
    f = f"{prefix}.ffn"
    xq = None if c.expert_dtype == "bf16" else ("fp8" if c.expert_dtype == "fp8" else "fp4")
    specs = [ParamSpec(f"{f}.gate.weight", f"{f}.gate.weight", (e, d), ("experts", "embed"))]
    if c.is_v41:  # image-span tokens route with their own selection bias
        specs.append(ParamSpec(f"{f}.gate.bias_vl", f"{f}.gate.bias_vl", (e,), ("experts",), init="zeros", fp32=True))
    if hashed:
        specs.append(
            ParamSpec(
                f"{f}.gate.tid2eid",
                f"{f}.gate.tid2eid",
                (c.vocab_size, c.num_experts_per_tok),
                ("vocab", None),
                init="tid2eid",
                integer=True,
                high=e,
            )
        )
    else:
        specs.append(ParamSpec(f"{f}.gate.bias", f"{f}.gate.bias", (e,), ("experts",), init="zeros", fp32=True))
    if c.held_experts not in (None, "fp8", "fp4") or c.held_experts not in (None, xq):
        raise ValueError(f"held_experts={c.held_experts!r}: the checkpoint's experts are {xq or 'unquantised'}")
    if c.held_experts == "fp8" and c.fp8_block is None:
        raise ValueError("held_experts='fp8' needs fp8_block: the block scales' grid is unknown")
    for w, shape, axes in (
        ("w1", (e, i, d), ("experts", "expert_mlp", "embed")),
        ("w3", (e, i, d), ("experts", "expert_mlp", "embed")),
        ("w2", (e, d, i), ("experts", "embed", "expert_mlp")),
    ):
        path = f"{f}.experts.{w}"
        specs.append(ParamSpec(path, f"{f}.experts.{{e}}.{w}.weight", shape, axes, quant=xq, held=c.held_experts))
        if c.held_experts == "fp8":  # the scales shard with their experts and move with them
            grid = (e, -(-shape[1] // c.fp8_block), -(-shape[2] // c.fp8_block))
            specs.append(
                ParamSpec(
                    scale_path(path),
                    f"{f}.experts.{{e}}.{w}.scale",
                    grid,
                    (axes[0], None, None),
                    fp32=True,
                    held="scale",
                )
            )
        elif c.held_experts == "fp4":  # one ue8m0 byte per 32 values of a row
            grid = (e, shape[1], shape[2] // MXFP4_BLOCK)
            specs.append(
                ParamSpec(scale_path(path), f"{f}.experts.{{e}}.{w}.scale", grid, (axes[0], None, None), held="scale")
            )
    si = i * c.n_shared_experts
    specs += [
        _linear(f"{f}.shared_experts.w1", si, d, ("mlp", "embed"), "fp8"),
        _linear(f"{f}.shared_experts.w3", si, d, ("mlp", "embed"), "fp8"),
        _linear(f"{f}.shared_experts.w2", d, si, ("embed", "mlp"), "fp8"),
    ]
    return specs


def _block(prefix: str, c: ModelConfig, ratio: int, hashed: bool, layer: int | None = None) -> list[ParamSpec]:
    """One decoder block; ``layer`` is the backbone index (None for draft blocks)."""
    if c.is_v41 and layer is not None:
        attn = _attention_v41(prefix, c, layer)
    else:
        attn = _attention(prefix, c, ratio)
    extra = _engram(prefix, c, layer) if layer is not None and layer in c.engram_layer_ids else []
    return (
        [_norm(f"{prefix}.attn_norm", c.hidden_size), _norm(f"{prefix}.ffn_norm", c.hidden_size)]
        + _hc_site(prefix, "attn", c)
        + _hc_site(prefix, "ffn", c)
        + attn
        + _moe(prefix, c, hashed)
        + extra
    )


def backbone_specs(c: ModelConfig) -> list[ParamSpec]:
    v, d = c.vocab_size, c.hidden_size
    specs = [
        ParamSpec("embed", "embed.weight", (v, d), ("vocab", "embed")),
        ParamSpec(
            "head", "head.weight", (v, d), ("vocab", "embed")
        ),  # fp32 accumulation, not storage: norm.linear_fp32
        _norm("norm", d),
    ]
    if not c.is_v41:  # V4.1 collapses the streams with the last site's pre: no learned hc_head
        specs += _hc_head("", c)
    for layer, ratio in enumerate(c.compress_ratios):
        specs += _block(f"layers.{layer}", c, ratio, layer < c.num_hash_layers, layer)
    return specs


def engram_specs(c: ModelConfig) -> list[ParamSpec]:
    return [s for s in backbone_specs(c) if ".engram." in s.path]


def mtp_specs(c: ModelConfig) -> list[ParamSpec]:
    """Everything under ``mtp.*``: the DSpark drafter when the config has one, else the MTP-1
    blocks. Loading, writing and counting treat both alike as "the draft model"."""
    if c.dspark_stages:
        return dspark_specs(c)
    specs: list[ParamSpec] = []
    d = c.hidden_size
    for s in range(c.num_nextn_predict_layers):
        p = f"mtp.{s}"
        specs += _block(p, c, 0, False)
        specs += [
            _linear(f"{p}.e_proj", d, d, ("embed", None), "fp8"),
            _linear(f"{p}.h_proj", d, d, ("embed", None), "fp8"),
            _norm(f"{p}.enorm", d),
            _norm(f"{p}.hnorm", d),
            _norm(f"{p}.norm", d),
        ] + _hc_head(p, c)
    return specs


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
        _linear("mtp.0.main_proj", d, len(c.dspark_target_layer_ids) * d, ("embed", None), "fp8"),
        _norm("mtp.0.main_norm", d),
    ]
    for s in range(c.dspark_stages):
        specs += _block(f"mtp.{s}", stage_c, 0, False)
    last = f"mtp.{c.dspark_stages - 1}"
    specs += [
        _norm(f"{last}.norm", d),
        # Stored in the model dtype (the released byte budget fits bf16); the bias is computed in fp32.
        ParamSpec(f"{last}.markov_head.embed", f"{last}.markov_head.embed.weight", (v, r), ("vocab", None)),
        ParamSpec(f"{last}.markov_head.head", f"{last}.markov_head.head.weight", (v, r), ("vocab", None)),
        ParamSpec(
            f"{last}.confidence_head.proj", f"{last}.confidence_head.proj.weight", (1, d + r), (None, None), fp32=True
        ),
    ]
    if not c.is_v41:
        specs += _hc_head(last, c)
    return specs


def param_specs(c: ModelConfig, mtp: bool = True) -> list[ParamSpec]:
    """Every spec of ``c``: the backbone, the draft layers (``mtp``) and the vision path (last,
    so that a seeded random tree draws the same text weights with or without it)."""
    from ..vision.params import vision_specs

    return backbone_specs(c) + (mtp_specs(c) if mtp else []) + vision_specs(c)


def count_params(c: ModelConfig, mtp: bool = False, engram: bool = False, vision: bool = False) -> int:
    """Parameters of a config, counted from the specs without allocating. The draft layers
    (``mtp.*``), V4.1's Engram tables and its vision path are left out unless asked for: the
    published backbone sizes count none of them. Block scales of weights held in fp8 are not
    parameters."""
    from ..vision.params import is_vision_path

    return sum(
        s.numel
        for s in param_specs(c, mtp=mtp)
        if (engram or ".engram." not in s.path) and (vision or not is_vision_path(s.path)) and s.held != "scale"
    )


# --- trees -------------------------------------------------------------------------------------


def set_path(tree: dict, path: str, value: object) -> None:
    parts = path.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        nxt = parts[i + 1]
        if isinstance(node, list):
            idx = int(part)
            while len(node) <= idx:
                node.append({} if not nxt.isdigit() else [])
            node = node[idx]
        else:
            node = node.setdefault(part, [] if nxt.isdigit() else {})
    last = parts[-1]
    if isinstance(node, list):
        idx = int(last)
        while len(node) <= idx:
            node.append(None)
        node[idx] = value
    else:
        node[last] = value


def build_tree(values: dict[str, object]) -> dict:
    """Nested dicts (numeric components become lists) from flat tree paths."""
    tree: dict = {}
    for path in sorted(values, key=_natural):
        set_path(tree, path, values[path])
    return tree


def iter_tree(tree: object, prefix: str = "") -> Iterator[tuple[str, object]]:
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from iter_tree(v, f"{prefix}{k}.")
    elif isinstance(tree, list):
        for i, v in enumerate(tree):
            yield from iter_tree(v, f"{prefix}{i}.")
    else:
        yield prefix[:-1], tree


def _natural(path: str) -> tuple:
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in path.split("."))


def init_param(spec: ParamSpec, gen: torch.Generator, dtype: torch.dtype, n_experts: int) -> torch.Tensor:
    """Random value for a spec. Every parameter gets a non-trivial value (norm weights and biases
    too), so a checkpoint key mapped to the wrong place changes the logits and tests notice."""
    dev = gen.device
    if spec.integer:  # hash routing table: distinct experts for each token id
        k = spec.shape[1]
        return torch.argsort(torch.rand(spec.shape[0], n_experts, generator=gen, device=dev), dim=1)[:, :k].contiguous()
    noise = torch.randn(spec.shape, generator=gen, device=dev)
    if spec.init == "normal":
        value = noise * spec.shape[-1] ** -0.5  # fan-in scaling keeps tiny random models well conditioned
    elif spec.init == "ones":
        value = 1.0 + 0.1 * noise
    else:
        value = 0.1 * noise
    return value.to(torch.float32 if spec.fp32 else dtype)
