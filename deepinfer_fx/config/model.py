"""Model configuration: one frozen dataclass, parsed from an HF ``config.json`` by ``parse.py``.

Two generations share the dataclass. DeepSeek-V4 (``model_type: deepseek_v4``) and
DeepSeek-V4.1 (``deepseek_v41``: a composite config whose ``text_config`` is a
``deepseek_v41_text`` dict; a bare ``deepseek_v41_text`` dict is accepted too). V4.1-only fields
default to values that leave a V4 config unchanged; the CSA2 layer roles of spec §7.2 are
derived from them by the methods of ``ModelConfig`` (pure functions of the config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .vision import VisionConfig

V41 = "deepseek_v41"  # ModelConfig.model_type of every V4.1 config, composite or bare text config


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
    # Routed experts held as the checkpoint stores them instead of dequantised ("fp8":
    # float8_e4m3fn with fp32 block scales of fp8_block; "fp4": MXFP4, packed e2m1 bytes with
    # ue8m0 scales per 32; None: dequantised). The scales are ``*_scale`` params; load_model's
    # expert_format decides.
    held_experts: str | None = None
    # Dense projections the checkpoint stores in block FP8 held so ("fp8": float8_e4m3fn with
    # fp32 block scales at ``*_scale``) instead of dequantised (None); load_model's dense_format.
    held_dense: str | None = None

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
    vision: VisionConfig | None = None  # the composite config's vision_config (None: text only)
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
