"""DEEPINFER_* settings: parsed in one place, unknown names warn, bad values name the variable."""

from __future__ import annotations

import warnings

import pytest

from deepinfer_fx.settings import VARIABLES, EngineConfig, setting


def test_defaults_and_overrides() -> None:
    cfg = EngineConfig.from_env({})
    assert cfg.extra_experts == 32 and cfg.nextn_decode is None and cfg.yoco_keep_tokens == 140
    assert cfg.batch_invariant is False and cfg.accelerator is None and cfg.expert_format == "auto"
    assert cfg.dist_timeout == 300.0 and EngineConfig.from_env({"DEEPINFER_DIST_TIMEOUT": "2.5"}).dist_timeout == 2.5
    env = {
        "DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS": "8",
        "DEEPINFER_BATCH_INVARIANT": "1",
        "DEEPINFER_ACCELERATOR": "CPU",
    }
    cfg = EngineConfig.from_env(env, extra_experts=4)
    assert cfg.extra_experts == 4 and cfg.batch_invariant is True and cfg.accelerator == "cpu"


@pytest.mark.parametrize(
    "name,value",
    [
        ("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "-1"),
        ("DEEPINFER_OVERRIDE_NUM_EXTRA_EXPERTS", "many"),
        ("DEEPINFER_BATCH_INVARIANT", "maybe"),
        ("DEEPINFER_ACCELERATOR", "tpu"),
        ("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", "mask"),
        ("DEEPINFER_EXPERT_FORMAT", "int8"),
        ("DEEPINFER_DENSE_FORMAT", "fp4"),
        ("DEEPINFER_DIST_TIMEOUT", "0"),
        ("DEEPINFER_DIST_TIMEOUT", "-5"),
        ("DEEPINFER_DIST_TIMEOUT", "inf"),
        ("DEEPINFER_DIST_TIMEOUT", "nan"),
        ("DEEPINFER_DIST_TIMEOUT", "5m"),
    ],
)
def test_bad_values_name_the_variable(name: str, value: str) -> None:
    with pytest.raises(ValueError) as e:
        EngineConfig.from_env({name: value})
    assert name in str(e.value) and VARIABLES[name].allowed in str(e.value)
    with pytest.raises(ValueError, match=name):
        setting(name, {name: value})


def test_unknown_names_warn_and_unknown_overrides_fail() -> None:
    with pytest.warns(UserWarning, match="DEEPINFER_BATCH_INVARIENT"):
        EngineConfig.from_env(
            {"DEEPINFER_BATCH_INVARIENT": "1", "DEEPINFER_BATCH_INVARIENT".replace("ANT", "ENT"): "1"}
        )
    with pytest.raises(ValueError, match="unknown engine setting"):
        EngineConfig.from_env({}, not_a_setting=1)
    with warnings.catch_warnings():  # the benches' variable is known, not the engine's
        warnings.simplefilter("error")
        EngineConfig.from_env({"DEEPINFER_COMMIT": "abc123"})
