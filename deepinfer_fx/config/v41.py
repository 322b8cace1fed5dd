"""The V4.1 and DSpark parts of config parsing: the composite ``deepseek_v41`` config, the
CSA2 layer roles, Engram and drafter fields, and their validation."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from .fields import ConfigError, _num
from .vision import parse_vision

if TYPE_CHECKING:
    from .model import ModelConfig

# Keys of the composite V4.1 config that live beside text_config and describe the text model.
COMPOSITE_KEYS = ("eos_token_id", "bos_token_id", "image_token_id", "quantization_config")


def _unwrap_composite(d: dict, where: str) -> tuple[dict, str]:
    """The text model's fields of a composite ``deepseek_v41`` config, with the top-level keys
    that describe it (eos ids, image token, quantization) folded in, and ``vision_config`` beside them."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{where}: model_type 'deepseek_v41' is a composite config and needs a 'text_config' object")
    inner = text.get("model_type", "deepseek_v41_text")
    if inner != "deepseek_v41_text":
        raise ConfigError(f"{where}: 'text_config.model_type' is {inner!r}; expected 'deepseek_v41_text'")
    flat = dict(text)
    # The released file states eos [1, 2] only at the top level: the outer value wins.
    flat.update({k: d[k] for k in COMPOSITE_KEYS if d.get(k) is not None})
    flat["vision_config"] = d.get("vision_config")
    return flat, f"{where} (text_config)"


def _layer_ids(d: dict, key: str, where: str, required: bool) -> tuple[int, ...]:
    value = d.get(key)
    if value is None:
        if required:
            raise ConfigError(f"{where}: required field '{key}' is missing")
        return ()
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise ConfigError(f"{where}: '{key}' must be a list of integers, got {value!r}")
    return tuple(value)


def _v41_fields(d: dict, where: str) -> dict[str, Any]:
    """ModelConfig's V4.1 fields. Absent optional fields take HF ``DeepseekV41TextConfig``'s
    defaults, so a config HF can load means the same model here; the exception is
    engram_compressed_vocab_size, left None (it must then come from the tokenizer)."""
    kv = _layer_ids(d, "kv_source_layer_ids", where, required=True)
    candidate = _num(d, "candidate_source_layer_id", where, int, None)
    if candidate is None:
        candidate = kv[-1] if kv else None  # HF's default: the last KV source
    elif candidate < 0:
        candidate = None  # HF: a negative id switches the two-level top-k off
    pad = _num(d, "engram_pad_token_id", where, int, None)
    alias = _num(d, "engram_pad_id", where, int, None)  # HF's name for the same field
    if pad is not None and alias is not None and pad != alias:
        raise ConfigError(f"{where}: 'engram_pad_token_id' ({pad}) and its alias 'engram_pad_id' ({alias}) differ")
    return dict(
        kv_source_layer_ids=kv,
        index_source_layer_ids=_layer_ids(d, "index_source_layer_ids", where, required=True),
        candidate_source_layer_id=candidate,
        candidate_topk_blocks=_num(d, "candidate_topk_blocks", where, int, 2048),
        candidate_block_size=_num(d, "candidate_block_size", where, int, 8),
        engram_layer_ids=_layer_ids(d, "engram_layer_ids", where, required=False),
        engram_num_embeddings=_layer_ids(d, "engram_num_embeddings", where, required=False),
        engram_max_ngram_size=_num(d, "engram_max_ngram_size", where, int, 4),
        engram_n_heads=_num(d, "engram_n_heads", where, int, 8),
        engram_head_dim=_num(d, "engram_head_dim", where, int, 256),
        engram_vocab_size=_num(d, "engram_vocab_size", where, int, 16_000_000),
        engram_pad_token_id=next((p for p in (pad, alias) if p is not None), 2),  # HF's default: 2
        engram_compressed_vocab_size=_num(d, "engram_compressed_vocab_size", where, int, None),
        gate_temp=_num(d, "gate_temp", where, float, 1.0),
        image_token_id=_num(d, "image_token_id", where, int, None),
        vision=parse_vision(d.get("vision_config"), where),
    )


def _dspark_fields(d: dict, where: str, v41: bool) -> dict[str, Any]:
    """ModelConfig's DSpark fields (spec §1.1, §1.2). Defaults are the released values; the
    drafter's experts default to HF ``DeepseekV41TextConfig``'s 128 / top-3 on V4.1 and to the
    trunk's own count on V4 (V4-Flash-0731's stages reuse the trunk's 256 / top-6 and its config
    states no ``dspark_n_routed_experts``)."""
    experts = 128 if v41 else _num(d, "n_routed_experts", where, int)
    per_tok = 3 if v41 else _num(d, "num_experts_per_tok", where, int)
    return dict(
        dspark_block_size=_num(d, "dspark_block_size", where, int, 5),
        dspark_noise_token_id=_num(d, "dspark_noise_token_id", where, int, 128799),
        dspark_target_layer_ids=_layer_ids(d, "dspark_target_layer_ids", where, required=False),
        dspark_markov_rank=_num(d, "dspark_markov_rank", where, int, 256),
        dspark_n_routed_experts=_num(d, "dspark_n_routed_experts", where, int, experts),
        dspark_num_experts_per_tok=_num(d, "dspark_num_experts_per_tok", where, int, per_tok),
    )


def _validate_v41(c: ModelConfig, where: str) -> None:
    def bad(field: str, why: str) -> None:
        raise ConfigError(f"{where}: '{field}' {why}")

    n, ratios = c.num_hidden_layers, c.compress_ratios

    def layer_list(field: str, ids: tuple[int, ...]) -> None:
        if list(ids) != sorted(set(ids)):
            bad(field, f"{list(ids)} must be sorted and without repeats")
        if ids and not (0 <= ids[0] and ids[-1] < n):
            bad(field, f"{list(ids)} has a layer outside 0..{n - 1}")

    kv, idx, cand = c.kv_source_layer_ids, c.index_source_layer_ids, c.candidate_source_layer_id
    for field, ids in (
        ("kv_source_layer_ids", kv),
        ("index_source_layer_ids", idx),
        ("engram_layer_ids", c.engram_layer_ids),
        ("dspark_target_layer_ids", c.dspark_target_layer_ids),
    ):
        layer_list(field, ids)
    if c.num_hash_layers:
        bad("num_hash_layers", f"is {c.num_hash_layers}; DeepSeek-V4.1 has no hash-routed layers")
    for field, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", idx)):
        window_only = [s for s in ids if ratios[s] == 0]
        if window_only:
            bad(field, f"lists window-only layers {window_only} (compress ratio 0); a source needs a compressed branch")
    compressed = [i for i, r in enumerate(ratios) if r]
    if compressed and (not kv or kv[0] > compressed[0]):
        bad(
            "kv_source_layer_ids",
            f"must start at or before the first compressed layer ({compressed[0]}): every layer with "
            f"compress ratio > 0 reads the last KV source at or before it; got {list(kv)}",
        )
    for layer in compressed:
        src = c.kv_source(layer)
        if ratios[layer] != ratios[src]:
            bad(
                "compress_ratios",
                f"layer {layer} has ratio {ratios[layer]} but reads the compressed KV of layer {src} "
                f"(ratio {ratios[src]}); a KV group has one ratio",
            )
    if set(kv) - set(idx):
        bad(
            "index_source_layer_ids",
            f"must include every KV source (they own the index keys); missing {sorted(set(kv) - set(idx))}",
        )
    if cand is not None:
        if cand not in idx:
            bad("candidate_source_layer_id", f"({cand}) must be one of index_source_layer_ids {list(idx)}")
        if kv and cand < kv[-1]:
            bad(
                "candidate_source_layer_id",
                f"({cand}) must be in the last KV group (at or after layer {kv[-1]}): its block mask "
                f"indexes that group's compressed cache",
            )
        for field in ("candidate_topk_blocks", "candidate_block_size"):
            if getattr(c, field) < 1:
                bad(field, "must be positive when a candidate source is set")
    if len(c.engram_num_embeddings) != len(c.engram_layer_ids):
        bad(
            "engram_num_embeddings",
            f"has {len(c.engram_num_embeddings)} entries; expected one per engram layer ({len(c.engram_layer_ids)})",
        )
    if c.engram_layer_ids:
        if any(rows < 1 for rows in c.engram_num_embeddings):
            bad("engram_num_embeddings", f"{list(c.engram_num_embeddings)} must be positive")
        if c.engram_max_ngram_size < 2:
            bad("engram_max_ngram_size", f"is {c.engram_max_ngram_size}; Engram hashes n-grams of size 2 and up")
        for field in ("engram_n_heads", "engram_head_dim", "engram_vocab_size"):
            if getattr(c, field) < 1:
                bad(field, "must be positive")
        if not 0 <= c.engram_pad_token_id < c.vocab_size:
            bad(
                "engram_pad_token_id", f"({c.engram_pad_token_id}) must be a token id below vocab_size ({c.vocab_size})"
            )
        if c.engram_compressed_vocab_size is not None and c.engram_compressed_vocab_size < 1:
            bad("engram_compressed_vocab_size", "must be positive")
    # image_token_id is not range-checked: HF-written tiny configs keep the released id (129264)
    # beside a small vocabulary.
    if c.vision is not None and c.image_token_id is None:
        bad("image_token_id", "is missing; a model with a vision tower lays its images out on spans of that id")
    if not math.isfinite(c.gate_temp) or c.gate_temp <= 0:
        bad("gate_temp", "must be a positive number")


def _validate_dspark(c: ModelConfig, where: str) -> None:
    """DSpark fields of either generation, checked only when the config has stages."""
    if not c.dspark_stages:
        return

    def bad(field: str, why: str) -> None:
        raise ConfigError(f"{where}: '{field}' {why}")

    ids = c.dspark_target_layer_ids
    if not ids:
        bad("dspark_target_layer_ids", "is missing; the DSpark stages read the streams of these layers")
    if list(ids) != sorted(set(ids)) or not (0 <= ids[0] and ids[-1] < c.num_hidden_layers):
        bad(
            "dspark_target_layer_ids",
            f"{list(ids)} must be sorted, without repeats, within 0..{c.num_hidden_layers - 1}",
        )
    if not 0 < c.dspark_num_experts_per_tok <= c.dspark_n_routed_experts:
        bad(
            "dspark_num_experts_per_tok",
            f"({c.dspark_num_experts_per_tok}) must be in 1..dspark_n_routed_experts ({c.dspark_n_routed_experts})",
        )
    if c.dspark_block_size < 1:
        bad("dspark_block_size", "must be positive")
    if c.dspark_markov_rank < 1:
        bad("dspark_markov_rank", "must be positive")
    # dspark_noise_token_id is not range-checked: HF-written tiny configs keep the released id
    # (128799) beside a small vocabulary, and such a text-only checkpoint without mtp.* weights
    # must still load; the drafter checks it when it runs.
