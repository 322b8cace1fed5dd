"""Spec builders of one decoder block: its norms and mHC sites, attention (V4 and V4.1, with
compressor and indexer), MoE (router, routed and shared experts) and Engram; ``params.py`` lists
the blocks of the backbone and the draft model."""

from __future__ import annotations

from dataclasses import replace

from ..config import ModelConfig
from ..io.quant import MXFP4_BLOCK
from .param_spec import ParamSpec, scale_path


def linear_spec(path: str, out: int, inp: int, axes: tuple[str | None, str | None], quant: str | None) -> ParamSpec:
    """A projection's ``[out, inp]`` weight at ``path.weight``."""
    return ParamSpec(path, path + ".weight", (out, inp), axes, quant=quant)


def hold_dense(specs: list[ParamSpec], c: ModelConfig) -> list[ParamSpec]:
    """``specs`` with every block-FP8 dense projection held as stored where ``c.held_dense`` is
    "fp8": the float8 weight, then its fp32 block scales at ``scale_path`` (``[cdiv(out, b),
    cdiv(in, b)]``, replicated as the weight is). Routed experts keep ``held_experts``' say."""
    if c.held_dense is None:
        return specs
    if c.held_dense != "fp8" or c.fp8_block is None:
        raise ValueError(
            f"held_dense={c.held_dense!r}: only block-FP8 dense weights (fp8_block set) are held as stored"
        )
    b, out = c.fp8_block, []
    for s in specs:
        if s.quant != "fp8" or s.stacked or s.held is not None:
            out.append(s)
            continue
        grid = tuple(-(-n // b) for n in s.shape)
        out.append(replace(s, held="fp8"))
        out.append(
            ParamSpec(
                scale_path(s.path),
                s.key.removesuffix(".weight") + ".scale",
                grid,
                (None, None),
                fp32=True,
                held="scale",
            )
        )
    return out


def norm_spec(path: str, dim: int) -> ParamSpec:
    """An RMSNorm's ``[dim]`` weight at ``path.weight``."""
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


def hc_head_specs(prefix: str, c: ModelConfig) -> list[ParamSpec]:
    """The learned ``hc_head`` collapse of the streams (V4), under ``prefix`` ("" at the top)."""
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
        linear_spec(f"{prefix}.wkv", width, c.hidden_size, ("compress", "embed"), None),
        linear_spec(f"{prefix}.wgate", width, c.hidden_size, ("compress", "embed"), None),
        ParamSpec(f"{prefix}.ape", f"{prefix}.ape", (ratio, width), (None, None), init="zeros", fp32=True),
        norm_spec(f"{prefix}.norm", dim),
    ]


def _attention_common(a: str, c: ModelConfig) -> list[ParamSpec]:
    """Projections every attention layer of both generations owns."""
    h, hd, d = c.num_attention_heads, c.head_dim, c.hidden_size
    return [
        linear_spec(f"{a}.wq_a", c.q_lora_rank, d, (None, "embed"), "fp8"),
        norm_spec(f"{a}.q_norm", c.q_lora_rank),
        linear_spec(f"{a}.wq_b", h * hd, c.q_lora_rank, ("heads", None), "fp8"),
        linear_spec(f"{a}.wkv", hd, d, (None, "embed"), "fp8"),
        norm_spec(f"{a}.kv_norm", hd),
        linear_spec(f"{a}.wo_a", c.o_groups * c.o_lora_rank, h * hd // c.o_groups, ("heads", None), "fp8"),
        linear_spec(f"{a}.wo_b", d, c.o_groups * c.o_lora_rank, ("embed", None), "fp8"),
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
            linear_spec(f"{a}.indexer.wq_b", hi * di, c.q_lora_rank, (None, None), "fp8"),
            linear_spec(f"{a}.indexer.weights_proj", hi, d, (None, "embed"), None),
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
        specs.append(linear_spec(f"{a}.compressor.wkv", hd, d, ("compress", "embed"), None))
        if c.compress_ratios[layer] > 1:
            specs.append(linear_spec(f"{a}.compressor.wgate", hd, d, ("compress", "embed"), None))
        specs += [
            norm_spec(f"{a}.compressor.norm", hd),
            linear_spec(f"{a}.indexer.wk", c.index_head_dim, hd, (None, None), None),
            norm_spec(f"{a}.indexer.k_norm", c.index_head_dim),
        ]
    if c.compress_ratios[layer] and c.is_index_source(layer):
        specs += [
            linear_spec(f"{a}.indexer.wq_b", c.index_n_heads * c.index_head_dim, c.q_lora_rank, (None, None), "fp8"),
            linear_spec(f"{a}.indexer.weights_proj", c.index_n_heads, d, (None, "embed"), None),
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
        linear_spec(f"{e}.wkv", (n + 1) * d, cols, (None, None), "fp8"),
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
        linear_spec(f"{f}.shared_experts.w1", si, d, ("mlp", "embed"), "fp8"),
        linear_spec(f"{f}.shared_experts.w3", si, d, ("mlp", "embed"), "fp8"),
        linear_spec(f"{f}.shared_experts.w2", d, si, ("embed", "mlp"), "fp8"),
    ]
    return specs


def block_specs(prefix: str, c: ModelConfig, ratio: int, hashed: bool, layer: int | None = None) -> list[ParamSpec]:
    """One decoder block; ``layer`` is the backbone index (None for draft blocks)."""
    if c.is_v41 and layer is not None:
        attn = _attention_v41(prefix, c, layer)
    else:
        attn = _attention(prefix, c, ratio)
    extra = _engram(prefix, c, layer) if layer is not None and layer in c.engram_layer_ids else []
    return (
        [norm_spec(f"{prefix}.attn_norm", c.hidden_size), norm_spec(f"{prefix}.ffn_norm", c.hidden_size)]
        + _hc_site(prefix, "attn", c)
        + _hc_site(prefix, "ffn", c)
        + attn
        + _moe(prefix, c, hashed)
        + extra
    )
