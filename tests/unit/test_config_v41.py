"""deepinfer_fx.config on tiny V4.1 configs (bare text and composite): layer roles, HF's spellings
and the defaults, validation errors (each naming its field), and the roles on random layouts."""

from __future__ import annotations

import random

import pytest
from config_helpers import DROP, TINY41, YARN, composite41, fields_of, raises_naming, tiny, tiny41

from deepinfer_fx.config import config_from_dict


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


@pytest.mark.parametrize(
    "d,want",
    [
        pytest.param(
            tiny41(engram_pad_token_id=DROP, engram_pad_id=5), {"engram_pad_token_id": 5}, id="hf-engram_pad_id"
        ),
        pytest.param(tiny41(engram_pad_token_id=DROP), {"engram_pad_token_id": 2}, id="default-engram_pad_token_id"),
        # candidate source: absent -> the last KV source (HF's default)
        pytest.param(
            tiny41(candidate_source_layer_id=DROP), {"candidate_source_layer_id": 6}, id="default-candidate-source"
        ),
        pytest.param(tiny41(gate_temp=0.5), {"gate_temp": 0.5}, id="gate_temp"),
        # HF-written tiny configs keep the released token ids beside a small vocabulary: still loadable
        pytest.param(
            composite41(tiny41(), image_token_id=129264),
            {"image_token_id": 129264, "dspark_noise_token_id": 128799},
            id="released-token-ids-small-vocab",
        ),
        pytest.param(
            tiny41(engram_compressed_vocab_size=77),
            {"engram_compressed_vocab_size": 77},
            id="engram_compressed_vocab_size",
        ),
    ],
)
def test_v41_parsed_fields(d: dict, want: dict):
    assert fields_of(d, want) == want


@pytest.mark.parametrize(
    "d",
    [
        # ratios may list the backbone only or also the draft stages
        pytest.param(tiny41(compress_ratios=TINY41["compress_ratios"][:10]), id="backbone-only-ratios"),
        # HF's nested rope_parameters spelling
        pytest.param(
            tiny41(
                rope_parameters={
                    "main": {"rope_type": "default", "rope_theta": 10000.0},
                    "compress": {**YARN, "rope_type": "yarn", "rope_theta": 160000.0},
                }
            ),
            id="hf-rope_parameters",
        ),
    ],
)
def test_v41_spellings_of_the_same_config(d: dict):
    assert config_from_dict(d) == config_from_dict(tiny41())


def test_v41_negative_candidate_source_means_no_second_level():
    off = config_from_dict(tiny41(candidate_source_layer_id=-1))
    assert off.candidate_source_layer_id is None and not any(
        off.is_candidate_source(i) or off.uses_candidates(i) for i in range(10)
    )


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
        pytest.param({"kv_source_layer_ids": [4, 2, 6]}, "kv_source_layer_ids", id="kv-unsorted"),
        pytest.param({"kv_source_layer_ids": [2, 2, 4, 6]}, "kv_source_layer_ids", id="kv-repeated"),
        pytest.param(
            {"kv_source_layer_ids": [2, 4, 6, 10], "index_source_layer_ids": [2, 4, 6, 8, 10]},
            "kv_source_layer_ids",
            id="kv-past-last-layer",
        ),
        pytest.param({"kv_source_layer_ids": [2, "4", 6]}, "kv_source_layer_ids", id="kv-not-an-int"),
        pytest.param({"index_source_layer_ids": [2, 4, 8, 6]}, "index_source_layer_ids", id="index-unsorted"),
        pytest.param({"index_source_layer_ids": [-1, 2, 4, 6, 8]}, "index_source_layer_ids", id="index-negative"),
        # the first KV source after the first compressed layer (2), or none at all
        pytest.param(
            {"kv_source_layer_ids": [3, 4, 6], "index_source_layer_ids": [3, 4, 6, 8]},
            "kv_source_layer_ids",
            id="kv-start-after-first-compressed",
        ),
        pytest.param(
            {"kv_source_layer_ids": [], "index_source_layer_ids": [], "candidate_source_layer_id": -1},
            "kv_source_layer_ids",
            id="no-kv-sources",
        ),
        # a source on a window-only layer
        pytest.param(
            {"kv_source_layer_ids": [1, 2, 4, 6], "index_source_layer_ids": [1, 2, 4, 6, 8]},
            "kv_source_layer_ids",
            id="kv-on-window-layer",
        ),
        pytest.param({"index_source_layer_ids": [1, 2, 4, 6, 8]}, "index_source_layer_ids", id="index-on-window-layer"),
        # KV sources must be index sources
        pytest.param({"index_source_layer_ids": [2, 6, 8]}, "index_source_layer_ids", id="kv-not-an-index-source"),
        # a KV group with two ratios
        pytest.param({"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 1, 1]}, "compress_ratios", id="kv-group-two-ratios"),
        pytest.param({"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1]}, "compress_ratios", id="ratios-too-short"),
        pytest.param(
            {"compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 0, 1]}, "compress_ratios", id="draft-ratio-not-0"
        ),
        pytest.param({"compress_ratios": None}, "compress_ratios", id="ratios-None"),
        pytest.param({"candidate_source_layer_id": 7}, "candidate_source_layer_id", id="candidate-not-an-index-source"),
        pytest.param(
            {"candidate_source_layer_id": 4}, "candidate_source_layer_id", id="candidate-before-last-kv-group"
        ),
        pytest.param({"candidate_block_size": 0}, "candidate_block_size", id="candidate_block_size-0"),
        pytest.param({"engram_layer_ids": [1, 10]}, "engram_layer_ids", id="engram-past-last-layer"),
        pytest.param({"engram_layer_ids": [4, 1]}, "engram_layer_ids", id="engram-unsorted"),
        pytest.param({"engram_num_embeddings": [300]}, "engram_num_embeddings", id="engram_num_embeddings-count"),
        pytest.param({"engram_num_embeddings": [300, 0]}, "engram_num_embeddings", id="engram_num_embeddings-0"),
        pytest.param({"engram_max_ngram_size": 1}, "engram_max_ngram_size", id="engram_max_ngram_size-1"),
        pytest.param({"engram_pad_token_id": 256}, "engram_pad_token_id", id="engram_pad-out-of-vocab"),
        pytest.param({"dspark_target_layer_ids": None}, "dspark_target_layer_ids", id="dspark-targets-None"),
        pytest.param(
            {"dspark_target_layer_ids": [8, 10]}, "dspark_target_layer_ids", id="dspark-target-past-last-layer"
        ),
        pytest.param({"dspark_num_experts_per_tok": 5}, "dspark_num_experts_per_tok", id="dspark-top-k-over-experts"),
        pytest.param({"num_hash_layers": 1}, "num_hash_layers", id="hash-layers"),
        pytest.param({"gate_temp": 0.0}, "gate_temp", id="gate_temp-0"),
        pytest.param({"rms_norm_eps": 0.0}, "rms_norm_eps", id="rms_norm_eps-0"),
    ],
)
def test_v41_validation_errors(changes, field):
    raises_naming(tiny41(**changes), f"'{field}'")
    # the same error through the composite config
    raises_naming(composite41(tiny41(**changes)), f"'{field}'")


@pytest.mark.parametrize(
    "d,words",
    [
        pytest.param(tiny41(engram_pad_id=3), ["engram_pad_token_id", "engram_pad_id"], id="both-engram-pad-spellings"),
        *(
            pytest.param(tiny41(**{field: DROP}), [f"'{field}'", "missing"], id=f"missing-{field}")
            for field in ("kv_source_layer_ids", "index_source_layer_ids", "hidden_size")
        ),
        pytest.param(composite41(tiny41(), text_config=DROP), ["text_config"], id="composite-without-text_config"),
        pytest.param(
            composite41(tiny41(model_type="deepseek_v4")), ["text_config.model_type"], id="composite-v4-text_config"
        ),
        pytest.param(
            composite41(tiny41(), quantization_config={"quant_method": "fp8", "weight_block_size": [32, 64]}),
            ["weight_block_size"],
            id="composite-fp8-block-not-square",
        ),
    ],
)
def test_v41_invalid_config_names_its_field(d: dict, words: list[str]):
    raises_naming(d, *words)


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
