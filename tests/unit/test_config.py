"""deepinfer_fx.config: the released configs parse, parameter counts, layer roles, validation
errors (each naming its field) and HF's ``save_pretrained`` spelling == DeepSeek's spelling."""

from __future__ import annotations

import copy
import dataclasses
import json
import random
from pathlib import Path

import pytest

import deepinfer_fx
from deepinfer_fx.config import ConfigError, ModelConfig, Yarn, config_from_dict, load_config
from deepinfer_fx.config import RELEASED, released_config

ALL_FILES = [released_config(name) for name in RELEASED]


def _model_type(path: Path):
    return json.loads(path.read_text()).get("model_type")


YARN = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1}

# A tiny DeepSeek-spelled config (the released files' fields, small numbers).
TINY = {
    "model_type": "deepseek_v4",
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_groups": 2,
    "o_lora_rank": 16,
    "sliding_window": 16,
    "compress_ratios": [0, 4, 128, 4, 0],
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 4,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": dict(YARN),
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-6,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 1,
    "swiglu_limit": 10.0,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def tiny(**changes) -> dict:
    d = copy.deepcopy(TINY)
    d.update(changes)
    return d


def tiny_hf(**changes) -> dict:
    """The same model in HF's spelling (layer_types / compress_rates / mlp_layer_types)."""
    d = tiny()
    del d["compress_ratios"], d["num_hash_layers"]
    d["layer_types"] = [
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ]
    d["compress_rates"] = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    d["mlp_layer_types"] = ["hash_moe", "moe", "moe", "moe"]
    d.update(changes)
    return d


def raises_naming(d: dict, *words: str) -> str:
    with pytest.raises(ConfigError) as ei:
        config_from_dict(d)
    msg = str(ei.value)
    for w in words:
        assert w in msg, f"ConfigError message {msg!r} does not name {w!r}"
    return msg


# --------------------------------------------------------------------------- released configs


def test_released_configs_present():
    v4 = [p.name for p in ALL_FILES if _model_type(p) == "deepseek_v4"]
    assert {"deepseek_v4_flash.json", "deepseek_v4_pro.json", "deepseek_v4_flash_0731_dspark.json"} <= set(v4), v4


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: p.name)
def test_released_config_parses_or_is_rejected(path: Path):
    mt = _model_type(path)
    raw = json.loads(path.read_text())
    if mt == "deepseek_v4":
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
    elif mt == "deepseek_v41":
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
    else:
        # The official reference's flat ModelArgs files are not HF configs and must be refused.
        assert mt is None and "dim" in json.loads(path.read_text()), (
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


def test_count_paramsreleased_config():
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


def test_count_params_scales_with_layers_and_experts():
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    base = deepinfer_fx.count_params(tiny())
    # One more HCA layer (not a hash layer) adds exactly the per-layer count of an HCA layer.
    extra = rng.randrange(1, 4)
    more = tiny(num_hidden_layers=4 + extra, compress_ratios=[0, 4, 128, 4] + [128] * extra)
    one = deepinfer_fx.count_params(tiny(num_hidden_layers=5, compress_ratios=[0, 4, 128, 4, 128]))
    assert deepinfer_fx.count_params(more) - base == extra * (one - base), f"seed={seed}"
    # Routed experts: each adds 3 * inter * hidden weights and one gate row + one bias per non-hash layer.
    e = 8 * rng.randrange(2, 5)
    d, i, layers, hashed = 64, 32, 4, 1
    got = deepinfer_fx.count_params(tiny(n_routed_experts=e)) - base
    want = (e - 8) * (layers * (3 * i * d + d) + (layers - hashed))
    assert got == want, f"seed={seed} experts={e}: {got} != {want}"


# --------------------------------------------------------------------------- errors


def test_tiny_config_is_valid():
    c = config_from_dict(tiny())
    assert c.compress_ratios == (0, 4, 128, 4)
    assert [c.layer_kind(i) for i in range(4)] == ["swa", "csa", "hca", "csa"]
    assert c.num_hash_layers == 1 and c.fp8_block is None and c.expert_dtype is None


@pytest.mark.parametrize("mt", ["llama", "deepseek_v3", "deepseek_v41", None])
def test_unknown_model_type(mt):
    d = tiny(model_type=mt)
    if mt is None:
        del d["model_type"]
    raises_naming(d, "model_type")


@pytest.mark.parametrize("ratios", [[0, 4, 128], [0, 4, 128, 4, 0, 0], [0, 4, 128, 4, 0, 0, 0], []])
def test_compress_ratios_wrong_length(ratios):
    raises_naming(tiny(compress_ratios=ratios), "compress_ratios", str(len(ratios)))


def test_compress_ratios_draft_entries_must_be_zero():
    raises_naming(tiny(compress_ratios=[0, 4, 128, 4, 4]), "compress_ratios")
    # with three DSpark stages, every trailing entry must be 0
    d = tiny(compress_ratios=[0, 4, 128, 4, 0, 128, 0], dspark_target_layer_ids=[1, 2, 3])
    raises_naming(d, "compress_ratios")
    ok = config_from_dict(tiny(compress_ratios=[0, 4, 128, 4, 0, 0, 0], dspark_target_layer_ids=[1, 2, 3]))
    assert ok.compress_ratios == (0, 4, 128, 4) and ok.dspark_stages == 3


def test_negative_compress_ratio():
    raises_naming(tiny(compress_ratios=[0, 4, -128, 4]), "compress_ratios")


REQUIRED = [
    "hidden_size",
    "q_lora_rank",
    "index_topk",
    "vocab_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "index_n_heads",
    "index_head_dim",
    "rms_norm_eps",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
    "routed_scaling_factor",
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
]


@pytest.mark.parametrize("field", REQUIRED)
def test_missing_required_field(field):
    d = tiny()
    del d[field]
    raises_naming(d, f"'{field}'", "missing")
    raises_naming(tiny(**{field: None}), f"'{field}'")


def test_missing_rope_dim_and_partial_rotary_factor():
    d = tiny()
    del d["qk_rope_head_dim"]
    raises_naming(d, "partial_rotary_factor")
    assert config_from_dict({**d, "partial_rotary_factor": 0.25}).qk_rope_head_dim == 16


def test_missing_compress_ratios_and_layer_types():
    d = tiny()
    del d["compress_ratios"]
    raises_naming(d, "layer_types")


@pytest.mark.parametrize("n", [3, 5, 0])
def test_layer_types_wrong_length(n):
    types = (["sliding_attention", "compressed_sparse_attention"] * 4)[:n]
    raises_naming(tiny_hf(layer_types=types), "layer_types", str(n))


def test_unknown_layer_type():
    types = ["sliding_attention", "compressed_sparse_attention", "full_attention", "compressed_sparse_attention"]
    msg = raises_naming(tiny_hf(layer_types=types), "layer_types")
    assert "full_attention" in msg and "[2]" in msg, msg


@pytest.mark.parametrize("n_kv", [0, 2, 4])
def test_num_key_value_heads_must_be_one(n_kv):
    raises_naming(tiny(num_key_value_heads=n_kv), "num_key_value_heads")


@pytest.mark.parametrize("groups", [3, 8])
def test_o_groups_must_divide_heads(groups):
    raises_naming(tiny(o_groups=groups), "o_groups")
    assert config_from_dict(tiny(o_groups=4)).o_groups == 4


@pytest.mark.parametrize(
    "mlp",
    [["moe", "hash_moe", "moe", "moe"], ["hash_moe", "moe", "hash_moe", "moe"], ["hash_moe", "moe", "moe"]],
)
def test_mlp_layer_types_must_be_hash_prefix(mlp):
    raises_naming(tiny_hf(mlp_layer_types=mlp), "mlp_layer_types")


def test_mlp_layer_types_prefix_counts():
    for n in range(5):
        c = config_from_dict(tiny_hf(mlp_layer_types=["hash_moe"] * n + ["moe"] * (4 - n)))
        assert c.num_hash_layers == n


@pytest.mark.parametrize(
    "field,value",
    [
        ("qk_rope_head_dim", 15),
        ("qk_rope_head_dim", 128),
        ("index_head_dim", 8),
        ("scoring_func", "relu"),
        ("num_experts_per_tok", 9),
        ("num_experts_per_tok", 0),
        ("num_hash_layers", 5),
        ("expert_dtype", "int4"),
        ("sliding_window", 0),
        ("rms_norm_eps", 0.0),
    ],
)
def test_other_invalid_values(field, value):
    raises_naming(tiny(**{field: value}), field)


def test_rope_scaling_errors():
    raises_naming(tiny(rope_scaling={"type": "linear", "factor": 2}), "linear")
    missing = dict(YARN)
    del missing["factor"]
    raises_naming(tiny(rope_scaling=missing), "factor")
    assert config_from_dict(tiny(rope_scaling=None)).yarn is None


def test_quantization_config_errors():
    q = {"quant_method": "fp8", "weight_block_size": [128, 64]}
    raises_naming(tiny(quantization_config=q), "weight_block_size")
    raises_naming(tiny(quantization_config={"quant_method": "awq"}), "quant_method")
    c = config_from_dict(
        tiny(quantization_config={"quant_method": "fp8", "weight_block_size": [32, 32], "expert_dtype": "fp4"})
    )
    assert c.fp8_block == 32 and c.expert_dtype == "fp4"


def test_load_config_dir_without_config_json(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(ei.value), str(ei.value)


def test_load_config_invalid_json(tmp_path):
    f = tmp_path / "config.json"
    f.write_text('{"model_type": "deepseek_v4", ')
    for arg in (f, tmp_path):
        with pytest.raises(ConfigError) as ei:
            load_config(arg)
        assert str(f) in str(ei.value) and "JSON" in str(ei.value), str(ei.value)
    f.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="JSON object"):
        load_config(f)


def test_load_config_dir_and_errors_name_the_file(tmp_path):
    f = tmp_path / "config.json"
    f.write_text(json.dumps(tiny()))
    assert load_config(tmp_path) == load_config(f) == config_from_dict(tiny())
    d = tiny()
    del d["hidden_size"]
    f.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path)
    assert str(f) in str(ei.value) and "'hidden_size'" in str(ei.value), str(ei.value)


# --------------------------------------------------------------------------- HF spelling


def _hf_small_config(**extra):
    import transformers

    return transformers.DeepseekV4Config(
        vocab_size=256,
        hidden_size=64,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=4,
        sliding_window=16,
        layer_types=[
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        num_hash_layers=1,
        rope_scaling=dict(YARN),
        **extra,
    )


def test_hf_spelling_equals_deepseek_spelling():
    hf = _hf_small_config().to_dict()
    # what save_pretrained writes goes through JSON
    hf = json.loads(json.dumps(hf))
    assert "compress_ratios" not in hf and "layer_types" in hf and "rope_parameters" in hf
    ds = tiny(compress_ratios=[0, 4, 16, 4], num_hash_layers=1)
    a, b = config_from_dict(hf), config_from_dict(ds)
    da, db = dataclasses.asdict(a), dataclasses.asdict(b)
    diff = {k: (da[k], db[k]) for k in da if da[k] != db[k]}
    assert not diff, f"HF vs DeepSeek spelling differ: {diff}"
    assert a == b
    # and the shared values are the intended ones (not equal-but-both-wrong)
    assert a.compress_ratios == (0, 4, 16, 4) and a.csa_ratio == 4 and a.hca_ratios == {16}
    assert [a.layer_kind(i) for i in range(4)] == ["swa", "csa", "hca", "csa"]
    assert a.num_hash_layers == 1 and a.qk_rope_head_dim == 16
    assert a.rope_theta == 10000.0 and a.compress_rope_theta == 160000.0
    assert a.yarn == Yarn(16.0, 65536, 32.0, 1.0)


def test_hf_spelling_rope_dim_from_partial_rotary_factor():
    hf = json.loads(json.dumps(_hf_small_config().to_dict()))
    del hf["qk_rope_head_dim"]
    assert config_from_dict(hf).qk_rope_head_dim == 16


def test_hf_spelling_default_compress_rates():
    d = tiny_hf()
    del d["compress_rates"]
    c = config_from_dict(d)
    assert c.compress_ratios == (0, 4, 128, 4)
    assert c == config_from_dict(tiny(compress_ratios=[0, 4, 128, 4]))


# --------------------------------------------------------------------------- V4.1


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


# A tiny bare text config (deepseek_v41_text): 10 layers, ratio-2 groups at 2 and 4, a ratio-1
# decoder from layer 6 with a reindex source at 8, Engram at 1 and 4, two DSpark stages.
TINY41 = {
    "model_type": "deepseek_v41_text",
    **{
        k: v
        for k, v in TINY.items()
        if k not in ("model_type", "compress_ratios", "num_hash_layers", "num_hidden_layers")
    },
    "num_hidden_layers": 10,
    "rms_norm_eps": 1e-20,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0],
    "kv_source_layer_ids": [2, 4, 6],
    "index_source_layer_ids": [2, 4, 6, 8],
    "candidate_source_layer_id": 6,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 2,
    "engram_layer_ids": [1, 4],
    "engram_num_embeddings": [300, 320],
    "engram_max_ngram_size": 3,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
    "engram_vocab_size": 50,
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 2,
    "dspark_target_layer_ids": [8, 9],
    "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}


def tiny41(**changes) -> dict:
    d = copy.deepcopy(TINY41)
    d.update(changes)
    return d


def composite41(text: dict, **top) -> dict:
    return {
        "model_type": "deepseek_v41",
        "eos_token_id": [1, 2],
        "image_token_id": 200,
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [32, 32], "expert_dtype": "fp4"},
        "text_config": text,
        "vision_config": {"model_type": "deepseek_v41_vision", "hidden_size": 8, "num_attention_heads": 2},
        **top,
    }


def test_tiny41_roles():
    c = config_from_dict(tiny41())
    assert c.is_v41 and c.model_type == "deepseek_v41" and c.compress_ratios == (0, 0, 2, 2, 2, 2, 1, 1, 1, 1)
    assert [c.layer_role(i) for i in range(10)] == [
        "swa",
        "swa",
        "full",
        "reuse",
        "full",
        "reuse",
        "full",
        "reuse",
        "reindex",
        "reuse",
    ]
    assert [c.kv_source(i) for i in range(10)] == [None, None, 2, 2, 4, 4, 6, 6, 6, 6]
    assert [c.index_source(i) for i in range(10)] == [None, None, 2, 2, 4, 4, 6, 6, 8, 8]
    assert c.encoder_layers == tuple(range(6)) and c.decoder_layers == (6, 7, 8, 9)
    assert c.dspark_stages == 2 and c.num_hash_layers == 0 and c.engram_compressed_vocab_size is None


def test_v41_composite_equals_bare_text_config():
    text = tiny41()
    bare = tiny41(eos_token_id=[1, 2], image_token_id=200, quantization_config=composite41({})["quantization_config"])
    a, b = config_from_dict(composite41(text)), config_from_dict(bare)
    assert a.replace(vision=None) == b  # the vision tower is the composite's own; the text model is the same
    assert a.vision.hidden_size == 8 and a.vision.num_hidden_layers == 32  # unstated fields: the released values
    assert a.eos_token_ids == (1, 2) and a.image_token_id == 200 and a.fp8_block == 32 and a.expert_dtype == "fp4"
    # the outer eos wins over the text config's own
    assert config_from_dict(composite41(tiny41(eos_token_id=1))).eos_token_ids == (1, 2)


def test_v41_hf_spellings_and_defaults():
    d = tiny41()
    del d["engram_pad_token_id"]
    assert config_from_dict({**d, "engram_pad_id": 5}).engram_pad_token_id == 5
    assert config_from_dict(d).engram_pad_token_id == 2
    raises_naming(tiny41(engram_pad_id=3), "engram_pad_token_id", "engram_pad_id")
    # candidate source: absent -> the last KV source (HF's default); negative -> no second level
    d = tiny41()
    del d["candidate_source_layer_id"]
    assert config_from_dict(d).candidate_source_layer_id == 6
    off = config_from_dict(tiny41(candidate_source_layer_id=-1))
    assert off.candidate_source_layer_id is None and not any(
        off.is_candidate_source(i) or off.uses_candidates(i) for i in range(10)
    )
    assert config_from_dict(tiny41(gate_temp=0.5)).gate_temp == 0.5
    # HF-written tiny configs keep the released token ids beside a small vocabulary: still loadable
    released_ids = config_from_dict(composite41(tiny41(), image_token_id=129264))
    assert released_ids.image_token_id == 129264 and released_ids.dspark_noise_token_id == 128799
    assert config_from_dict(tiny41(engram_compressed_vocab_size=77)).engram_compressed_vocab_size == 77
    # ratios may list the backbone only or also the draft stages
    assert config_from_dict(tiny41(compress_ratios=TINY41["compress_ratios"][:10])) == config_from_dict(tiny41())
    # HF's nested rope_parameters spelling
    rp = {
        "main": {"rope_type": "default", "rope_theta": 10000.0},
        "compress": {**YARN, "rope_type": "yarn", "rope_theta": 160000.0},
    }
    assert config_from_dict(tiny41(rope_parameters=rp)) == config_from_dict(tiny41())


def test_v4_configs_keep_v41_defaults_and_refuse_roles():
    c = config_from_dict(tiny())
    assert not c.is_v41 and c.kv_source_layer_ids == () and c.engram_layer_ids == () and c.gate_temp == 1.0
    assert c.index_key_quirk is False and c.image_token_id is None
    assert not c.is_engram_layer(1)
    for call in (lambda: c.kv_source(1), lambda: c.layer_role(1), lambda: c.decoder_layers, lambda: c.is_reindex(1)):
        with pytest.raises(ValueError, match="V4.1"):
            call()


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"kv_source_layer_ids": [4, 2, 6]}, "kv_source_layer_ids"),
        ({"kv_source_layer_ids": [2, 2, 4, 6]}, "kv_source_layer_ids"),
        ({"kv_source_layer_ids": [2, 4, 6, 10], "index_source_layer_ids": [2, 4, 6, 8, 10]}, "kv_source_layer_ids"),
        ({"kv_source_layer_ids": [2, "4", 6]}, "kv_source_layer_ids"),
        ({"index_source_layer_ids": [2, 4, 8, 6]}, "index_source_layer_ids"),
        ({"index_source_layer_ids": [-1, 2, 4, 6, 8]}, "index_source_layer_ids"),
        # the first KV source after the first compressed layer (2), or none at all
        ({"kv_source_layer_ids": [3, 4, 6], "index_source_layer_ids": [3, 4, 6, 8]}, "kv_source_layer_ids"),
        (
            {"kv_source_layer_ids": [], "index_source_layer_ids": [], "candidate_source_layer_id": -1},
            "kv_source_layer_ids",
        ),
        # a source on a window-only layer
        ({"kv_source_layer_ids": [1, 2, 4, 6], "index_source_layer_ids": [1, 2, 4, 6, 8]}, "kv_source_layer_ids"),
        ({"index_source_layer_ids": [1, 2, 4, 6, 8]}, "index_source_layer_ids"),
        # KV sources must be index sources
        ({"index_source_layer_ids": [2, 6, 8]}, "index_source_layer_ids"),
        # a KV group with two ratios
        ({"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 1]}, "compress_ratios"),
        ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1]}, "compress_ratios"),
        ({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 1]}, "compress_ratios"),
        ({"compress_ratios": None}, "compress_ratios"),
        ({"candidate_source_layer_id": 7}, "candidate_source_layer_id"),
        ({"candidate_source_layer_id": 4}, "candidate_source_layer_id"),
        ({"candidate_block_size": 0}, "candidate_block_size"),
        ({"engram_layer_ids": [1, 10]}, "engram_layer_ids"),
        ({"engram_layer_ids": [4, 1]}, "engram_layer_ids"),
        ({"engram_num_embeddings": [300]}, "engram_num_embeddings"),
        ({"engram_num_embeddings": [300, 0]}, "engram_num_embeddings"),
        ({"engram_max_ngram_size": 1}, "engram_max_ngram_size"),
        ({"engram_pad_token_id": 256}, "engram_pad_token_id"),
        ({"dspark_target_layer_ids": None}, "dspark_target_layer_ids"),
        ({"dspark_target_layer_ids": [8, 10]}, "dspark_target_layer_ids"),
        ({"dspark_num_experts_per_tok": 5}, "dspark_num_experts_per_tok"),
        ({"num_hash_layers": 1}, "num_hash_layers"),
        ({"gate_temp": 0.0}, "gate_temp"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ],
)
def test_v41_validation_errors(changes, field):
    raises_naming(tiny41(**changes), f"'{field}'")
    # the same error through the composite config
    raises_naming(composite41(tiny41(**changes)), f"'{field}'")


@pytest.mark.parametrize("field", ["kv_source_layer_ids", "index_source_layer_ids", "hidden_size"])
def test_v41_missing_required(field):
    d = tiny41()
    del d[field]
    raises_naming(d, f"'{field}'", "missing")


def test_v41_composite_errors():
    d = composite41(tiny41())
    del d["text_config"]
    raises_naming(d, "text_config")
    raises_naming(composite41(tiny41(model_type="deepseek_v4")), "text_config.model_type")
    raises_naming(
        composite41(tiny41(), quantization_config={"quant_method": "fp8", "weight_block_size": [32, 64]}),
        "weight_block_size",
    )


def test_v41_roles_match_definitions_on_random_layouts():
    """Random valid CSA2 layouts: every role method equals its definition computed by brute force."""
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    for _ in range(30):
        n = rng.randrange(4, 24)
        n_swa = rng.randrange(0, 3)
        n_enc = rng.randrange(1, n - n_swa)
        ratios = [0] * n_swa + [2] * n_enc + [1] * (n - n_swa - n_enc)
        enc_sources = [n_swa] + sorted(rng.sample(range(n_swa + 1, n_swa + n_enc), rng.randrange(0, n_enc)))
        dec_sources = [n_swa + n_enc] if n_swa + n_enc < n else []
        kv = enc_sources + dec_sources
        extra = [i for i in range(n_swa, n) if i not in kv and rng.random() < 0.3]
        index = sorted(kv + extra)
        c = config_from_dict(
            tiny41(
                num_hidden_layers=n,
                compress_ratios=ratios,
                kv_source_layer_ids=kv,
                index_source_layer_ids=index,
                candidate_source_layer_id=kv[-1],
                engram_layer_ids=[],
                engram_num_embeddings=[],
                num_nextn_predict_layers=0,
                dspark_target_layer_ids=[],
            )
        )
        for layer in range(n):
            at_or_before = lambda ids: max((s for s in ids if s <= layer), default=None) if ratios[layer] else None
            assert c.kv_source(layer) == at_or_before(kv), f"seed={seed} layer={layer}"
            assert c.index_source(layer) == at_or_before(index), f"seed={seed} layer={layer}"
            assert c.is_reindex(layer) == (layer in index and layer not in kv), f"seed={seed}"
            assert c.uses_candidates(layer) == (layer in index and layer > kv[-1]), f"seed={seed}"
        assert c.decoder_layers == tuple(range(kv[-1], n)), f"seed={seed}"
        assert c.encoder_layers + c.decoder_layers == tuple(range(n)), f"seed={seed}"
