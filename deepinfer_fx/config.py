"""Model configuration: one frozen dataclass parsed from an HF ``config.json``.

Two spellings of the same config reach us: DeepSeek's released files (``compress_ratios``,
``num_hash_layers``, ``rope_scaling``, ``qk_rope_head_dim``) and what HF transformers writes
with ``save_pretrained`` (``layer_types`` + ``compress_rates``, ``mlp_layer_types``, nested
``rope_parameters``, ``partial_rotary_factor``). Both are normalised here, once, so the model
code only ever sees per-layer compression ratios and plain numbers.

Two generations share the dataclass. DeepSeek-V4 (``model_type: deepseek_v4``) and
DeepSeek-V4.1 (``deepseek_v41``: a composite config whose ``text_config`` is a
``deepseek_v41_text`` dict; a bare ``deepseek_v41_text`` dict is accepted too). V4.1-only fields
default to values that leave a V4 config unchanged; the CSA2 layer roles of spec §7.2 are
derived from them by the methods of ``ModelConfig`` (pure functions of the config).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config_fields import ConfigError, _need, _num, read_json_object
from .config_v41 import _dspark_fields, _unwrap_composite, _v41_fields, _validate_dspark, _validate_v41

SUPPORTED_MODEL_TYPES = ("deepseek_v4", "deepseek_v41", "deepseek_v41_text")
V41 = "deepseek_v41"  # ModelConfig.model_type of every V4.1 config, composite or bare text config
# V4's CSA ratio. V4.1 has no CSA layer (its ratios are 0/2/1): its csa_ratio keeps this value,
# which no V4.1 layer has, so V4 code asking ``ratio == csa_ratio`` never takes the CSA path.
_V4_CSA_RATIO = 4
_LAYER_TYPE_NAMES = {
    "sliding_attention": 0,
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


@dataclass(frozen=True)
class Yarn:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    # One entry per backbone layer (0 = window only, 4 = CSA, 128 = HCA); MTP layers are window-only.
    compress_ratios: tuple[int, ...]
    csa_ratio: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_theta: float
    compress_rope_theta: float
    yarn: Yarn | None
    max_position_embeddings: int
    rms_norm_eps: float
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    scoring_func: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    num_hash_layers: int
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_nextn_predict_layers: int
    dspark_stages: int  # > 0: mtp.* is a DSpark drafter (not an MTP-1 block)
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # Checkpoint storage: FP8 block size of the dense weights (None = unquantised) and the
    # routed experts' format ("fp4" = MXFP4, "fp8" = block FP8, None = same as dense).
    fp8_block: int | None
    expert_dtype: str | None
    # The official reference's QAT fake-quant points (spec §2.3, §3.3, §3.5). HF transformers'
    # V4 leaves them out, so HF parity runs with this off; real checkpoints were trained with it on.
    fake_quant: bool = True
    # Routed experts held as the checkpoint stores them, float8_e4m3fn with fp32 block scales
    # (``*_scale`` params, fp8_block), instead of dequantised: load_model's expert_format decides.
    fp8_experts: bool = False

    # ---- V4.1 only (spec §1.2). The defaults describe "absent", so V4 configs are unchanged.
    # CSA2 sharing: KV sources own a compressor + compressed cache (and the index keys); index
    # sources run the indexer; the candidate source publishes the two-level top-k block mask
    # (None: no second level).
    kv_source_layer_ids: tuple[int, ...] = ()
    index_source_layer_ids: tuple[int, ...] = ()
    candidate_source_layer_id: int | None = None
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    # Engram n-gram memory (spec §7.7); engram_num_embeddings = table rows, one per engram layer.
    engram_layer_ids: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_vocab_size: int = 0
    engram_pad_token_id: int | None = None
    # Tokenizer-derived (spec §7.7 step 1); None when the config does not state it.
    engram_compressed_vocab_size: int | None = None
    # DSpark drafter (spec §7.9); the number of stages is dspark_stages.
    dspark_block_size: int = 0
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_num_experts_per_tok: int = 0
    gate_temp: float = 1.0  # router logits are divided by it before the score function
    image_token_id: int | None = None
    # Spec §11.1: True reproduces the official reference's index-key publishing quirk (ratio-2
    # index sources score against the last published keys while their group is open); False is
    # the intended behaviour (each owner scores against its own keys). Not in config.json.
    index_key_quirk: bool = False

    @property
    def is_v41(self) -> bool:
        return self.model_type == V41

    @property
    def hca_ratios(self) -> set[int]:
        if self.is_v41:
            return set()
        return {r for r in self.compress_ratios if r not in (0, self.csa_ratio)}

    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    def layer_kind(self, layer: int) -> str:
        """Attention kind of a backbone layer: V4 'swa', 'csa' or 'hca'; V4.1 'swa' (ratio 0),
        'pooled' (ratio > 1: non-overlapping pooled groups, the CED encoder side) or 'unpooled'
        (ratio 1: one latent per token, the CED decoder side)."""
        r = self.compress_ratios[layer]
        if r == 0:
            return "swa"
        if self.is_v41:
            return "pooled" if r > 1 else "unpooled"
        return "csa" if r == self.csa_ratio else "hca"

    # ---- V4.1 CSA2 layer roles (spec §7.2). V4 has no shared sources (every compressed layer
    # owns its compressor), so asking a V4 config is a caller bug and raises.

    def _require_v41(self, what: str) -> None:
        if not self.is_v41:
            raise ValueError(f"{what} is a DeepSeek-V4.1 layer role; this config is {self.model_type}")

    def kv_source(self, layer: int) -> int | None:
        """The layer whose compressed KV ``layer`` attends: the last KV source at or before it
        (None for a window-only layer)."""
        self._require_v41("kv_source")
        return _last_at_or_before(self.kv_source_layer_ids, layer) if self.compress_ratios[layer] else None

    def index_source(self, layer: int) -> int | None:
        """The layer whose top-k selection ``layer`` uses: the last index source at or before it
        (None for a window-only layer)."""
        self._require_v41("index_source")
        return _last_at_or_before(self.index_source_layer_ids, layer) if self.compress_ratios[layer] else None

    def is_kv_source(self, layer: int) -> bool:
        self._require_v41("is_kv_source")
        return layer in self.kv_source_layer_ids

    def is_index_source(self, layer: int) -> bool:
        self._require_v41("is_index_source")
        return layer in self.index_source_layer_ids

    def is_reindex(self, layer: int) -> bool:
        """An index source that borrows its keys from its KV source (own wq_b/weights_proj only)."""
        return self.is_index_source(layer) and not self.is_kv_source(layer)

    def is_candidate_source(self, layer: int) -> bool:
        self._require_v41("is_candidate_source")
        return layer == self.candidate_source_layer_id

    def uses_candidates(self, layer: int) -> bool:
        """An index source after the candidate source: its top-k is restricted to the candidate
        blocks that the candidate source published."""
        c = self.candidate_source_layer_id
        return self.is_index_source(layer) and c is not None and layer > c

    def layer_role(self, layer: int) -> str:
        """Mode column of spec §7.2: 'swa' (window only), 'full' (owns compressor and indexer),
        'reindex' (own indexer queries over its KV source's keys) or 'reuse' (borrows both)."""
        self._require_v41("layer_role")
        if not self.compress_ratios[layer]:
            return "swa"
        if self.is_kv_source(layer):
            return "full"
        return "reindex" if self.is_index_source(layer) else "reuse"

    @property
    def decoder_layers(self) -> tuple[int, ...]:
        """CED decoder: the layers from the last KV source on. They read only that source's
        compressed KV, which is what lets prefill replay them on a bounded suffix (spec §8.2)."""
        self._require_v41("decoder_layers")
        first = self.kv_source_layer_ids[-1] if self.kv_source_layer_ids else self.num_hidden_layers
        return tuple(range(first, self.num_hidden_layers))

    @property
    def encoder_layers(self) -> tuple[int, ...]:
        """CED encoder: the layers before the decoder; they run on every prompt token."""
        first_decoder = self.num_hidden_layers - len(self.decoder_layers)
        return tuple(range(first_decoder))

    def is_engram_layer(self, layer: int) -> bool:
        return layer in self.engram_layer_ids

    def replace(self, **changes: Any) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _last_at_or_before(sorted_ids: tuple[int, ...], layer: int) -> int | None:
    # a plain scan (the lists are short): traced steps call it, and Dynamo cannot trace bisect
    before = [i for i in sorted_ids if i <= layer]
    return before[-1] if before else None


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
        original_max_position_embeddings=int(_need(scaling, "original_max_position_embeddings", where + " rope_scaling")),
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
        raise ConfigError(f"{where}: quantization_config.quant_method {quant.get('quant_method')!r} is not supported (fp8 only)")
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
