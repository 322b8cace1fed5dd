"""deepinfer_fx.config on tiny V4 configs: what parses to what, the validation errors (each naming
its field), load_config's file errors, parameter counts, and HF's ``save_pretrained`` spelling ==
DeepSeek's spelling. The released files: test_config_released.py; V4.1: test_config_v41.py."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
from config_helpers import DROP, YARN, fields_of, raises_naming, tiny, tiny_hf

import deepinfer_fx
from deepinfer_fx.config import ConfigError, Yarn, config_from_dict, load_config

# --------------------------------------------------------------------------- what parses to what


def test_tiny_config_is_valid():
    c = config_from_dict(tiny())
    assert c.compress_ratios == (0, 4, 128, 4)
    assert [c.layer_kind(i) for i in range(4)] == ["swa", "csa", "hca", "csa"]
    assert c.num_hash_layers == 1 and c.fp8_block is None and c.expert_dtype is None


@pytest.mark.parametrize(
    "d,want",
    [
        pytest.param(
            tiny(compress_ratios=[0, 4, 128, 4, 0, 0, 0], dspark_target_layer_ids=[1, 2, 3]),
            {"compress_ratios": (0, 4, 128, 4), "dspark_stages": 3},
            id="three-dspark-stages-zero-ratios",
        ),
        pytest.param(
            tiny(qk_rope_head_dim=DROP, partial_rotary_factor=0.25),
            {"qk_rope_head_dim": 16},
            id="rope-dim-from-partial_rotary_factor",
        ),
        pytest.param(tiny(o_groups=4), {"o_groups": 4}, id="o_groups-divides-heads"),
        pytest.param(tiny(rope_scaling=None), {"yarn": None}, id="no-rope_scaling"),
        pytest.param(
            tiny(quantization_config={"quant_method": "fp8", "weight_block_size": [32, 32], "expert_dtype": "fp4"}),
            {"fp8_block": 32, "expert_dtype": "fp4"},
            id="fp8-quantization_config",
        ),
        pytest.param(tiny_hf(compress_rates=DROP), {"compress_ratios": (0, 4, 128, 4)}, id="hf-default-compress_rates"),
        *(
            pytest.param(
                tiny_hf(mlp_layer_types=["hash_moe"] * n + ["moe"] * (4 - n)),
                {"num_hash_layers": n},
                id=f"hf-{n}-hash-layers",
            )
            for n in range(5)
        ),
    ],
)
def test_parsed_fields(d: dict, want: dict):
    assert fields_of(d, want) == want


def test_hf_default_compress_rates_equal_deepseek_ratios():
    assert config_from_dict(tiny_hf(compress_rates=DROP)) == config_from_dict(tiny(compress_ratios=[0, 4, 128, 4]))


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "d,words",
    [
        *(
            pytest.param(tiny(model_type=mt), ["model_type"], id=f"model_type-{mt}")
            for mt in ("llama", "deepseek_v3", "deepseek_v41")
        ),
        pytest.param(tiny(model_type=DROP), ["model_type"], id="model_type-missing"),
        *(
            pytest.param(tiny(compress_ratios=r), ["compress_ratios", str(len(r))], id=f"compress_ratios-{len(r)}")
            for r in ([0, 4, 128], [0, 4, 128, 4, 0, 0], [0, 4, 128, 4, 0, 0, 0], [])
        ),
        pytest.param(tiny(compress_ratios=[0, 4, 128, 4, 4]), ["compress_ratios"], id="draft-ratio-not-0"),
        pytest.param(
            tiny(compress_ratios=[0, 4, 128, 4, 0, 128, 0], dspark_target_layer_ids=[1, 2, 3]),
            ["compress_ratios"],
            id="dspark-draft-ratio-not-0",
        ),
        pytest.param(tiny(compress_ratios=[0, 4, -128, 4]), ["compress_ratios"], id="negative-compress-ratio"),
        pytest.param(tiny(qk_rope_head_dim=DROP), ["partial_rotary_factor"], id="no-rope-dim"),
        pytest.param(tiny(compress_ratios=DROP), ["layer_types"], id="no-compress_ratios-or-layer_types"),
        *(
            pytest.param(
                tiny_hf(layer_types=(["sliding_attention", "compressed_sparse_attention"] * 4)[:n]),
                ["layer_types", str(n)],
                id=f"layer_types-{n}",
            )
            for n in (3, 5, 0)
        ),
        pytest.param(
            tiny_hf(
                layer_types=[
                    "sliding_attention",
                    "compressed_sparse_attention",
                    "full_attention",
                    "compressed_sparse_attention",
                ]
            ),
            ["layer_types", "full_attention", "[2]"],
            id="unknown-layer-type",
        ),
        *(
            pytest.param(tiny(num_key_value_heads=n), ["num_key_value_heads"], id=f"num_key_value_heads-{n}")
            for n in (0, 2, 4)
        ),
        *(pytest.param(tiny(o_groups=g), ["o_groups"], id=f"o_groups-{g}") for g in (3, 8)),
        *(
            pytest.param(tiny_hf(mlp_layer_types=mlp), ["mlp_layer_types"], id=f"mlp_layer_types-{i}")
            for i, mlp in enumerate(
                [["moe", "hash_moe", "moe", "moe"], ["hash_moe", "moe", "hash_moe", "moe"], ["hash_moe", "moe", "moe"]]
            )
        ),
        *(
            pytest.param(tiny(**{field: value}), [field], id=f"{field}-{value}")
            for field, value in [
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
            ]
        ),
        pytest.param(tiny(rope_scaling={"type": "linear", "factor": 2}), ["linear"], id="rope_scaling-linear"),
        pytest.param(
            tiny(rope_scaling={k: v for k, v in YARN.items() if k != "factor"}), ["factor"], id="yarn-without-factor"
        ),
        pytest.param(
            tiny(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 64]}),
            ["weight_block_size"],
            id="fp8-block-not-square",
        ),
        pytest.param(tiny(quantization_config={"quant_method": "awq"}), ["quant_method"], id="quant_method-awq"),
    ],
)
def test_invalid_config_names_its_field(d: dict, words: list[str]):
    raises_naming(d, *words)


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
    raises_naming(tiny(**{field: DROP}), f"'{field}'", "missing")
    raises_naming(tiny(**{field: None}), f"'{field}'")


# --------------------------------------------------------------------------- load_config's files


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
    f.write_text(json.dumps(tiny(hidden_size=DROP)))
    with pytest.raises(ConfigError) as ei:
        load_config(tmp_path)
    assert str(f) in str(ei.value) and "'hidden_size'" in str(ei.value), str(ei.value)


# --------------------------------------------------------------------------- parameter counts


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
