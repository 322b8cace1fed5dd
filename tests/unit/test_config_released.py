"""deepinfer_fx.config on the released config files: each parses (or, for the reference's flat
ModelArgs files, is refused), V4-Flash's and V4.1-Flash's layer roles and values, the DSpark
config, and the parameter counts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import deepinfer_fx
from deepinfer_fx.config import RELEASED, ConfigError, ModelConfig, Yarn, config_from_dict, load_config, released_config

ALL_FILES = [released_config(name) for name in RELEASED]


def _model_type(path: Path):
    return json.loads(path.read_text()).get("model_type")


V4_FILES = [p for p in ALL_FILES if _model_type(p) == "deepseek_v4"]
V41_FILES = [p for p in ALL_FILES if _model_type(p) == "deepseek_v41"]
OTHER_FILES = [p for p in ALL_FILES if p not in V4_FILES + V41_FILES]


def test_released_configs_present():
    v4 = [p.name for p in V4_FILES]
    assert {"deepseek_v4_flash.json", "deepseek_v4_pro.json", "deepseek_v4_flash_0731_dspark.json"} <= set(v4), v4


@pytest.mark.parametrize("path", V4_FILES, ids=lambda p: p.name)
def test_released_v4_config_parses(path: Path):
    raw = json.loads(path.read_text())
    c = load_config(path)
    assert isinstance(c, ModelConfig)
    assert c.model_type == "deepseek_v4"
    n = raw["num_hidden_layers"]
    assert c.num_hidden_layers == n
    # Trailing draft-layer zeros are dropped: one ratio per backbone layer.
    assert c.compress_ratios == tuple(raw["compress_ratios"][:n]), path.name
    assert all(r == 0 for r in raw["compress_ratios"][n:])
    assert c.hidden_size == raw["hidden_size"] and c.head_dim == raw["head_dim"]
    assert c.qk_rope_head_dim == raw["qk_rope_head_dim"] == 64
    assert c.csa_ratio == 4 and c.hca_ratios == {128}
    assert c.rope_theta == 10000.0 and c.compress_rope_theta == 160000.0
    assert c.yarn == Yarn(16.0, 65536, 32.0, 1.0)
    assert c.n_routed_experts == raw["n_routed_experts"] and c.index_topk == raw["index_topk"]
    assert c.routed_scaling_factor == raw["routed_scaling_factor"]
    assert c.eos_token_ids == (1,) and c.bos_token_id == 0
    assert c.dspark_stages == len(raw.get("dspark_target_layer_ids") or [])
    # the directory form reads the same file
    assert load_config(path) == config_from_dict(raw, where=str(path))


@pytest.mark.parametrize("path", V41_FILES, ids=lambda p: p.name)
def test_released_v41_config_parses(path: Path):
    raw = json.loads(path.read_text())
    c = load_config(path)
    text = raw["text_config"]
    n = text["num_hidden_layers"]
    assert c.model_type == "deepseek_v41" and c.is_v41
    assert c.compress_ratios == tuple(text["compress_ratios"][:n]), path.name
    assert all(r == 0 for r in text["compress_ratios"][n:])
    assert c.hidden_size == text["hidden_size"] and c.n_routed_experts == text["n_routed_experts"]
    assert c.kv_source_layer_ids == tuple(text["kv_source_layer_ids"])
    assert c.eos_token_ids == tuple(raw["eos_token_id"]) and c.image_token_id == raw["image_token_id"]
    assert c.fp8_block == raw["quantization_config"]["weight_block_size"][0]
    assert load_config(path) == config_from_dict(raw, where=str(path))


@pytest.mark.parametrize("path", OTHER_FILES, ids=lambda p: p.name)
def test_released_modelargs_file_is_refused(path: Path):
    # The official reference's flat ModelArgs files are not HF configs and must be refused.
    assert _model_type(path) is None and "dim" in json.loads(path.read_text()), (
        f"{path.name}: unexpected file; add it to this test"
    )
    with pytest.raises(ConfigError, match="model_type"):
        load_config(path)


def test_flash_layer_roles():
    c = load_config(released_config("deepseek_v4_flash"))
    assert c.num_hidden_layers == 43 and len(c.compress_ratios) == 43
    assert [c.layer_kind(i) for i in (0, 1)] == ["swa", "swa"]
    for i in range(2, 43, 2):
        assert c.layer_kind(i) == "csa", (i, c.compress_ratios[i])
        assert c.compress_ratios[i] == 4
    for i in range(3, 42, 2):
        assert c.layer_kind(i) == "hca", (i, c.compress_ratios[i])
        assert c.compress_ratios[i] == 128
    assert c.num_hash_layers == 3
    assert c.fp8_block == 128
    assert c.expert_dtype == "fp4"
    assert c.yarn is not None and c.yarn.factor == 16.0 and c.yarn.original_max_position_embeddings == 65536
    assert c.num_nextn_predict_layers == 1 and c.dspark_stages == 0
    assert c.sliding_window == 128 and c.hc_mult == 4 and c.hc_sinkhorn_iters == 20


def test_dspark_config_is_flash_trunk_with_three_stages():
    flash = load_config(released_config("deepseek_v4_flash"))
    dspark = load_config(released_config("deepseek_v4_flash_0731_dspark"))
    assert dspark.dspark_stages == 3
    assert dspark.compress_ratios == flash.compress_ratios
    # The drafter's fields: the released values, experts defaulting to the trunk's (256, top-6).
    assert (dspark.dspark_block_size, dspark.dspark_noise_token_id, dspark.dspark_markov_rank) == (5, 128799, 256)
    assert dspark.dspark_target_layer_ids == (40, 41, 42)
    assert (dspark.dspark_n_routed_experts, dspark.dspark_num_experts_per_tok) == (256, 6)
    # Everything else is the V4-Flash trunk.
    no_drafter = dspark.replace(
        dspark_stages=0,
        dspark_block_size=0,
        dspark_noise_token_id=None,
        dspark_target_layer_ids=(),
        dspark_markov_rank=0,
        dspark_n_routed_experts=0,
        dspark_num_experts_per_tok=0,
    )
    assert no_drafter == flash


def test_count_params_of_released_configs():
    flash = deepinfer_fx.count_params(str(released_config("deepseek_v4_flash")))
    pro = deepinfer_fx.count_params(released_config("deepseek_v4_pro"))
    dspark = deepinfer_fx.count_params(str(released_config("deepseek_v4_flash_0731_dspark")))
    assert abs(flash / 284.3e9 - 1) < 0.005, flash
    assert abs(pro / 1573e9 - 1) < 0.005, pro
    assert dspark == flash, (dspark, flash)
    # the three accepted inputs agree
    raw = json.loads(released_config("deepseek_v4_flash").read_text())
    assert deepinfer_fx.count_params(raw) == flash
    assert deepinfer_fx.count_params(load_config(released_config("deepseek_v4_flash"))) == flash
    # MTP is excluded by default and adds parameters when asked for
    assert deepinfer_fx.count_params(raw, mtp=True) > flash


# --------------------------------------------------------------------------- V4.1-Flash


def test_v41_flash_values():
    c = load_config(released_config("deepseek_v41_flash"))
    assert c.num_hidden_layers == 40 and len(c.compress_ratios) == 40
    assert c.compress_ratios == (0, 0) + (2,) * 18 + (1,) * 20
    assert c.rms_norm_eps == 1e-20 and c.num_hash_layers == 0 and c.gate_temp == 1.0
    assert c.csa_ratio not in c.compress_ratios and c.hca_ratios == set()
    assert c.num_nextn_predict_layers == 3 and c.dspark_stages == 3
    assert c.dspark_target_layer_ids == (37, 38, 39) and c.dspark_block_size == 5
    assert c.dspark_noise_token_id == 128799 and c.dspark_markov_rank == 256
    assert (c.dspark_n_routed_experts, c.dspark_num_experts_per_tok) == (128, 3)
    assert c.engram_layer_ids == (1, 14) and c.engram_num_embeddings == (384006168, 384016682)
    assert (c.engram_max_ngram_size, c.engram_n_heads, c.engram_head_dim) == (4, 8, 256)
    assert (c.engram_vocab_size, c.engram_pad_token_id, c.engram_compressed_vocab_size) == (16000000, 2, 99092)
    assert (c.candidate_source_layer_id, c.candidate_topk_blocks, c.candidate_block_size) == (20, 2048, 8)
    assert c.fp8_block == 32 and c.expert_dtype == "fp4" and c.eos_token_ids == (1, 2)
    assert c.image_token_id == 129264 and c.index_key_quirk is False
    assert c.yarn == Yarn(16.0, 65536, 32.0, 1.0) and c.compress_rope_theta == 160000.0


def test_v41_flash_layer_roles_match_spec_table():
    """Spec §7.2's table, row by row: (layers, kind, KV source, index source, mode)."""
    c = load_config(released_config("deepseek_v41_flash"))
    table = [
        ([0, 1], "swa", None, None, "swa"),
        ([2], "pooled", 2, 2, "full"),
        ([8], "pooled", 8, 8, "full"),
        ([14], "pooled", 14, 14, "full"),
        ([3, 4, 5, 6, 7], "pooled", 2, 2, "reuse"),
        ([9, 10, 11, 12, 13], "pooled", 8, 8, "reuse"),
        ([15, 16, 17, 18, 19], "pooled", 14, 14, "reuse"),
        ([20], "unpooled", 20, 20, "full"),
        ([21, 22, 23], "unpooled", 20, 20, "reuse"),
        ([24], "unpooled", 20, 24, "reindex"),
        ([28], "unpooled", 20, 28, "reindex"),
        ([32], "unpooled", 20, 32, "reindex"),
        ([36], "unpooled", 20, 36, "reindex"),
        ([25, 26, 27], "unpooled", 20, 24, "reuse"),
        ([29, 30, 31], "unpooled", 20, 28, "reuse"),
        ([33, 34, 35], "unpooled", 20, 32, "reuse"),
        ([37, 38, 39], "unpooled", 20, 36, "reuse"),
    ]
    covered = sorted(layer for layers, *_ in table for layer in layers)
    assert covered == list(range(40))
    for layers, kind, kv, index, role in table:
        for layer in layers:
            got = (c.layer_kind(layer), c.kv_source(layer), c.index_source(layer), c.layer_role(layer))
            assert got == (kind, kv, index, role), (layer, got)
            assert c.is_kv_source(layer) == (role == "full")
            assert c.is_index_source(layer) == (role in ("full", "reindex"))
            assert c.is_reindex(layer) == (role == "reindex")
    assert [i for i in range(40) if c.is_reindex(i)] == [24, 28, 32, 36]
    assert [i for i in range(40) if c.is_candidate_source(i)] == [20]
    assert [i for i in range(40) if c.uses_candidates(i)] == [24, 28, 32, 36]
    assert c.encoder_layers == tuple(range(20)) and c.decoder_layers == tuple(range(20, 40))
    assert [i for i in range(40) if c.is_engram_layer(i)] == [1, 14]
