"""Parsing an HF-style ``config.json`` into ``ModelConfig`` (``model.py``).

Two spellings of the same config reach us: DeepSeek's released files (``compress_ratios``,
``num_hash_layers``, ``rope_scaling``, ``qk_rope_head_dim``) and what HF transformers writes
with ``save_pretrained`` (``layer_types`` + ``compress_rates``, ``mlp_layer_types``, nested
``rope_parameters``, ``partial_rotary_factor``). Both are normalised here, once, so the model
code only ever sees per-layer compression ratios and plain numbers. The V4.1 and DSpark fields
are read by ``v41.py``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

from .fields import ConfigError, _need, _num, read_json_object
from .model import V41, ModelConfig, Yarn
from .v41 import _dspark_fields, _unwrap_composite, _v41_fields, _validate_dspark, _validate_v41

SUPPORTED_MODEL_TYPES = ("deepseek_v4", "deepseek_v41", "deepseek_v41_text")
# V4's CSA ratio. V4.1 has no CSA layer (its ratios are 0/2/1): its csa_ratio keeps this value,
# which no V4.1 layer has, so V4 code asking ``ratio == csa_ratio`` never takes the CSA path.
_V4_CSA_RATIO = 4
_LAYER_TYPE_NAMES = {
    "sliding_attention": 0,
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


def _ratios(d: dict, n_layers: int, n_draft: int, where: str) -> tuple[tuple[int, ...], int]:
    if "compress_ratios" in d and d["compress_ratios"] is not None:
        ratios = [int(r) for r in d["compress_ratios"]]
        if len(ratios) not in (n_layers, n_layers + n_draft):
            raise ConfigError(
                f"{where}: 'compress_ratios' has {len(ratios)} entries; expected num_hidden_layers "
                f"({n_layers}) or that plus one per draft layer ({n_layers + n_draft})"
            )
        if any(ratios[n_layers:]):
            raise ConfigError(f"{where}: 'compress_ratios' entries after the backbone (draft layers) must be 0")
        ratios = ratios[:n_layers]
        nonzero = sorted({r for r in ratios if r})
        csa = 4 if 4 in nonzero else (min(nonzero) if len(nonzero) > 1 else 4)
        return tuple(ratios), csa
    types = _need(d, "layer_types", where)
    if len(types) != n_layers:
        raise ConfigError(f"{where}: 'layer_types' has {len(types)} entries; expected num_hidden_layers ({n_layers})")
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128, **(d.get("compress_rates") or {})}
    out = []
    for i, t in enumerate(types):
        if t not in _LAYER_TYPE_NAMES:
            raise ConfigError(f"{where}: 'layer_types[{i}]' is {t!r}; expected one of {sorted(_LAYER_TYPE_NAMES)}")
        out.append(0 if t == "sliding_attention" else _num(rates, t, where + " compress_rates", int))
    return tuple(out), _num(rates, "compressed_sparse_attention", where + " compress_rates", int)


def _hash_layers(d: dict, n_layers: int, where: str) -> int:
    mlp = d.get("mlp_layer_types")
    if mlp is None:
        return int(d.get("num_hash_layers", 0) or 0)
    if len(mlp) != n_layers:
        raise ConfigError(f"{where}: 'mlp_layer_types' has {len(mlp)} entries; expected num_hidden_layers ({n_layers})")
    n = sum(1 for t in mlp if t == "hash_moe")
    if list(mlp) != ["hash_moe"] * n + ["moe"] * (n_layers - n):
        raise ConfigError(f"{where}: 'mlp_layer_types' must be 'hash_moe' for a prefix of layers, then 'moe'")
    return n


def _rope(d: dict, where: str) -> tuple[float, float, Yarn | None]:
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp["main"], rp["compress"]
        theta, ctheta, scaling = float(main["rope_theta"]), float(comp["rope_theta"]), comp
    else:
        theta = float(d.get("rope_theta", 10000.0))
        ctheta = float(d.get("compress_rope_theta", theta))
        scaling = d.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind in (None, "default"):
        return theta, ctheta, None
    if kind != "yarn":
        raise ConfigError(f"{where}: rope scaling type {kind!r} is not supported; DeepSeek-V4 uses 'yarn'")
    yarn = Yarn(
        factor=float(_need(scaling, "factor", where + " rope_scaling")),
        original_max_position_embeddings=int(
            _need(scaling, "original_max_position_embeddings", where + " rope_scaling")
        ),
        beta_fast=float(scaling.get("beta_fast") or 32),
        beta_slow=float(scaling.get("beta_slow") or 1),
    )
    return theta, ctheta, yarn


def config_from_dict(d: dict, where: str = "config.json") -> ModelConfig:
    """Parse and validate an HF-style config dict (DeepSeek's or HF's own spelling)."""
    mt = d.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"{where}: model_type {mt!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}")
    if mt == V41:
        d, where = _unwrap_composite(d, where)
    v41 = mt != "deepseek_v4"
    n_layers = _num(d, "num_hidden_layers", where, int)
    n_mtp = _num(d, "num_nextn_predict_layers", where, int, 0) or 0
    if v41:
        # V4.1's mtp.0..N-1 are always DSpark stages, one per num_nextn_predict_layers.
        dspark = n_mtp
        if d.get("compress_ratios") is None:
            # HF's V4.1 layer_types only mark KV sources; the ratios cannot be recovered from them.
            raise ConfigError(f"{where}: required field 'compress_ratios' is missing (V4.1 needs the explicit list)")
    else:
        # V4-Flash-0731 ships a 3-stage DSpark drafter under mtp.0..2 but still says
        # num_nextn_predict_layers = 1; the DSpark fields are what identify it.
        dspark = len(d.get("dspark_target_layer_ids") or [])
    ratios, csa = _ratios(d, n_layers, dspark or n_mtp, where)
    if v41:
        csa = _V4_CSA_RATIO
    head_dim = _num(d, "head_dim", where, int)
    rope_dim = d.get("qk_rope_head_dim")
    if rope_dim is None:
        rope_dim = int(head_dim * _num(d, "partial_rotary_factor", where, float))
    theta, ctheta, yarn = _rope(d, where)
    quant = d.get("quantization_config") or {}
    block = quant.get("weight_block_size")
    if quant and quant.get("quant_method", "fp8") != "fp8":
        raise ConfigError(
            f"{where}: quantization_config.quant_method {quant.get('quant_method')!r} is not supported (fp8 only)"
        )
    if block is not None and (len(block) != 2 or block[0] != block[1]):
        raise ConfigError(f"{where}: quantization_config.weight_block_size {block} must be square, e.g. [128, 128]")
    eos = d.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    n_kv = _num(d, "num_key_value_heads", where, int, 1)
    cfg = ModelConfig(
        model_type=V41 if v41 else mt,
        vocab_size=_num(d, "vocab_size", where, int),
        hidden_size=_num(d, "hidden_size", where, int),
        num_hidden_layers=n_layers,
        num_attention_heads=_num(d, "num_attention_heads", where, int),
        head_dim=head_dim,
        qk_rope_head_dim=int(rope_dim),
        q_lora_rank=_num(d, "q_lora_rank", where, int),
        o_groups=_num(d, "o_groups", where, int),
        o_lora_rank=_num(d, "o_lora_rank", where, int),
        sliding_window=_num(d, "sliding_window", where, int),
        compress_ratios=ratios,
        csa_ratio=csa,
        index_n_heads=_num(d, "index_n_heads", where, int),
        index_head_dim=_num(d, "index_head_dim", where, int),
        index_topk=_num(d, "index_topk", where, int),
        rope_theta=theta,
        compress_rope_theta=ctheta,
        yarn=yarn,
        max_position_embeddings=_num(d, "max_position_embeddings", where, int, 1 << 20),
        rms_norm_eps=_num(d, "rms_norm_eps", where, float),
        moe_intermediate_size=_num(d, "moe_intermediate_size", where, int),
        n_routed_experts=_num(d, "n_routed_experts", where, int),
        n_shared_experts=_num(d, "n_shared_experts", where, int, 1),
        num_experts_per_tok=_num(d, "num_experts_per_tok", where, int),
        scoring_func=str(d.get("scoring_func", "sqrtsoftplus")),
        norm_topk_prob=bool(d.get("norm_topk_prob", True)),
        routed_scaling_factor=_num(d, "routed_scaling_factor", where, float),
        num_hash_layers=_hash_layers(d, n_layers, where),
        swiglu_limit=_num(d, "swiglu_limit", where, float, 0.0) or 0.0,
        hc_mult=_num(d, "hc_mult", where, int),
        hc_sinkhorn_iters=_num(d, "hc_sinkhorn_iters", where, int),
        hc_eps=_num(d, "hc_eps", where, float),
        num_nextn_predict_layers=n_mtp,
        dspark_stages=dspark,
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        bos_token_id=d.get("bos_token_id"),
        eos_token_ids=tuple(int(e) for e in eos_ids),
        fp8_block=int(block[0]) if block else None,
        expert_dtype=d.get("expert_dtype", quant.get("expert_dtype")),
        **(_v41_fields(d, where) if v41 else {}),
        # V4.1 always describes its drafter; a V4 config only when it ships one (V4-Flash-0731).
        **(_dspark_fields(d, where, v41) if v41 or dspark else {}),
    )
    _validate(cfg, n_kv, where)
    if v41:
        _validate_v41(cfg, where)
    _validate_dspark(cfg, where)
    return cfg


def _validate(c: ModelConfig, n_kv: int, where: str) -> None:
    def bad(field: str, why: str) -> None:
        raise ConfigError(f"{where}: '{field}' {why}")

    if n_kv != 1:
        bad("num_key_value_heads", f"is {n_kv}; DeepSeek-V4 attention has one shared K=V head")
    if c.num_attention_heads % c.o_groups:
        bad("o_groups", f"({c.o_groups}) must divide num_attention_heads ({c.num_attention_heads})")
    if not 0 < c.qk_rope_head_dim <= c.head_dim or c.qk_rope_head_dim % 2:
        bad("qk_rope_head_dim", f"({c.qk_rope_head_dim}) must be even and at most head_dim ({c.head_dim})")
    if c.index_head_dim < c.qk_rope_head_dim:
        bad("index_head_dim", f"({c.index_head_dim}) must be at least qk_rope_head_dim ({c.qk_rope_head_dim})")
    if c.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
        bad("scoring_func", f"is {c.scoring_func!r}; expected sqrtsoftplus, sigmoid or softmax")
    if not 0 < c.num_experts_per_tok <= c.n_routed_experts:
        bad("num_experts_per_tok", f"({c.num_experts_per_tok}) must be in 1..n_routed_experts ({c.n_routed_experts})")
    if not 0 <= c.num_hash_layers <= c.num_hidden_layers:
        bad("num_hash_layers", f"({c.num_hash_layers}) must be in 0..num_hidden_layers")
    for i, r in enumerate(c.compress_ratios):
        if r < 0:
            bad("compress_ratios", f"entry {i} is {r}; ratios are >= 0")
    if c.expert_dtype not in (None, "fp4", "fp8", "bf16"):
        bad("expert_dtype", f"is {c.expert_dtype!r}; expected fp4, fp8 or bf16")
    if c.sliding_window <= 0:
        bad("sliding_window", "must be positive")
    if c.hc_mult < 1:
        bad("hc_mult", "must be positive")
    if c.hc_sinkhorn_iters < 1:
        bad("hc_sinkhorn_iters", "must be positive")
    if not math.isfinite(c.rms_norm_eps) or c.rms_norm_eps <= 0:
        bad("rms_norm_eps", "must be a positive number")


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read ``config.json`` from a checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    d = read_json_object(p, "no config.json; a checkpoint directory needs one", ConfigError)
    return config_from_dict(d, where=str(p))
