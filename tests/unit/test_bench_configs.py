"""The bench models (``bench/configs.py``): P8 as before, the V4.1-Flash-width model the issue
describes (and at its released depth), the V4-Pro-width one, each fitting one H200 (in bf16, or
as ``HELD_TO_FIT`` says); cuts by layers; the benches' ``--config`` flag."""

from __future__ import annotations

import pytest

from deepinfer_fx.bench import compile_time, p8_vs_hf, spec
from deepinfer_fx.bench.configs import BENCH_CONFIGS, HELD_TO_FIT, bench_config, held_as_released
from deepinfer_fx.bench.p8 import p8_config
from deepinfer_fx.config import ConfigError, load_config, released_config
from deepinfer_fx.engine.memory_plan import memory_plan


def test_p8_is_the_table_entry() -> None:
    assert bench_config("p8") == p8_config() and not bench_config("p8").fake_quant


def test_v41_widths_and_roles() -> None:
    c = bench_config("v41")
    assert c.is_v41 and c.num_hidden_layers == 10 and c.hidden_size == 5120
    assert (c.num_attention_heads, c.head_dim, c.q_lora_rank) == (64, 512, 1280)
    assert (c.index_n_heads, c.index_head_dim, c.index_topk) == (32, 128, 512)
    assert (c.candidate_topk_blocks, c.candidate_block_size, c.candidate_source_layer_id) == (2048, 8, 5)
    assert c.kv_source_layer_ids == (2, 5) and c.engram_layer_ids == (1, 6)
    assert [c.layer_role(i) for i in range(10)] == [
        "swa",
        "swa",
        "full",
        "reuse",
        "reuse",
        "full",
        "reuse",
        "reindex",
        "reuse",
        "reindex",
    ]
    assert (c.n_routed_experts, c.num_experts_per_tok, c.dspark_stages) == (64, 6, 3)
    # small tables: each fits the device as compiled steps hold them (fp32, at most 2 GiB)
    assert all(rows * c.engram_head_dim * 4 <= 2 << 30 for rows in c.engram_num_embeddings)


def test_pro_widths() -> None:
    c = bench_config("pro")
    assert (c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.o_groups, c.moe_intermediate_size) == (
        7168,
        128,
        1536,
        16,
        3072,
    )
    assert c.hca_ratios == {128} and c.compress_ratios[:2] == (128, 128) and c.index_topk == 1024


def test_p8_deep_is_the_released_layout() -> None:
    """``p8_deep``: the released V4-Flash config's depth and layer roles at P8's widths; with
    ``mtp`` one MTP-1 block, as released."""
    released = load_config(released_config("deepseek_v4_flash"))
    c = bench_config("p8_deep", mtp=True)
    assert c.num_hidden_layers == released.num_hidden_layers == 43
    assert [c.layer_kind(i) for i in range(43)] == [released.layer_kind(i) for i in range(43)]
    assert (
        c.num_hash_layers == released.num_hash_layers
        and c.num_nextn_predict_layers == released.num_nextn_predict_layers == 1
    )
    assert c.n_routed_experts == 64 and c.hidden_size == released.hidden_size
    assert bench_config("p8", 4, mtp=True).num_nextn_predict_layers == 1
    assert bench_config("p8", 4).num_nextn_predict_layers == 0


def test_v41_deep_is_the_released_layout() -> None:
    """``v41_deep``: the released V4.1-Flash config's depth and layer roles at the bench widths."""
    released = load_config(released_config("deepseek_v41_flash"))
    c = bench_config("v41_deep")
    assert c.num_hidden_layers == released.num_hidden_layers == 40
    assert [c.layer_role(i) for i in range(40)] == [released.layer_role(i) for i in range(40)]
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id", "engram_layer_ids"):
        assert getattr(c, key) == getattr(released, key), key
    assert c.dspark_target_layer_ids == released.dspark_target_layer_ids and c.dspark_stages == 3
    assert c.n_routed_experts == 64 and c.hidden_size == released.hidden_size


@pytest.mark.parametrize("name", sorted(BENCH_CONFIGS))
def test_each_fits_one_h200(name: str) -> None:
    """bf16, or the formats ``HELD_TO_FIT`` names (``v41_deep`` even an H100's 79 GiB); in bf16
    the deep one does not fit, and the benches refuse it so before drawing a weight."""
    formats = HELD_TO_FIT.get(name, ("bf16", "bf16"))
    plan = memory_plan(held_as_released(bench_config(name), *formats), max_model_len=32768, max_num_seqs=64)
    assert plan.fits, plan.format()
    if name in HELD_TO_FIT:
        assert not memory_plan(bench_config(name), max_model_len=32768, max_num_seqs=64).fits
        small = memory_plan(held_as_released(bench_config(name), *formats), gpu_memory_gib=79, max_model_len=576)
        assert small.fits, small.format()


@pytest.mark.parametrize("bench", [p8_vs_hf, spec])
def test_benches_refuse_what_does_not_fit(bench, capsys: pytest.CaptureFixture[str]) -> None:
    argv = (
        ["--config", "v41_deep", "--random-weights"]
        if bench is p8_vs_hf
        else ["--method", "dspark", "--config", "v41_deep"]
    )
    with pytest.raises(SystemExit):
        bench.main(argv + ["--expert-format", "fp4"])
    assert "pass --expert-format fp4 --dense-format fp8 (got fp4, bf16)" in capsys.readouterr().err


def test_spec_config_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench.spec``: each method drafts on its family of bench models (P8's for ngram and MTP-1,
    V4.1's for DSpark), the deep ones only as released, and ``--layers`` cuts the model."""
    for method, config in (("ngram", "v41"), ("mtp", "v41_deep"), ("dspark", "p8")):
        with pytest.raises(SystemExit):
            spec.main(["--method", method, "--config", config])
        assert f"--method {method} drafts on the" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        spec.main(["--method", "mtp", "--config", "p8_deep", "--expert-format", "fp4"])
    assert "pass --expert-format fp4 --dense-format fp8 (got fp4, bf16)" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a cut below the DSpark head's layers
        spec.main(["--method", "dspark", "--layers", "4"])
    assert "dspark_target_layer_ids" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        spec.main(["--method", "ngram", "--draft-head", "fp8"])
    assert "the n-gram drafter reads no head" in capsys.readouterr().err
    for bad in ("bf16", "fp8,fp8", ""):
        with pytest.raises(SystemExit):
            spec.main(["--method", "mtp", "--draft-head", bad])
        assert f"--draft-head: model, fp8 or model,fp8, got {bad!r}" in capsys.readouterr().err


def test_cuts() -> None:
    assert bench_config("p8", 4).compress_ratios == (0, 0, 4, 128)
    with pytest.raises(ConfigError, match="dspark_target_layer_ids"):  # the DSpark head reads layers 7-9
        bench_config("v41", 4)
    with pytest.raises(ValueError, match="cannot cut it to 9"):
        bench_config("p8", 9)
    with pytest.raises(ValueError, match="unknown bench config 'v5'"):
        bench_config("v5")


def test_p8_vs_hf_needs_random_weights_for_v41(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        p8_vs_hf.main(["--config", "v41"])
    assert "no HF peer" in capsys.readouterr().err


def test_held_as_released() -> None:
    """The benches' ``--expert-format fp4`` / ``--dense-format fp8``: the random weights held as
    the checkpoints store them (the config's own scale block where it has one, else 128)."""
    p8, v41 = bench_config("p8"), bench_config("v41")
    assert held_as_released(p8) == p8
    fp4 = held_as_released(v41, "fp4")
    assert (fp4.held_experts, fp4.expert_dtype, fp4.held_dense) == ("fp4", "fp4", None)
    assert fp4.fp8_block == (v41.fp8_block or 128)
    fp8 = held_as_released(p8, dense_format="fp8")
    assert (fp8.held_dense, fp8.expert_dtype, fp8.held_experts, fp8.fp8_block) == ("fp8", "bf16", None, 128)
    both = held_as_released(p8, "fp4", "fp8")
    assert (both.held_experts, both.held_dense) == ("fp4", "fp8")
    with pytest.raises(ValueError, match="fp4"):
        held_as_released(p8, "fp8")


def test_compile_time_layouts(capsys: pytest.CaptureFixture[str]) -> None:
    """``bench.compile_time --tiny``: each V4.1 bench config's layer roles at the tiny widths;
    layouts it cannot shrink and unknown names are refused."""
    for name in ("v41", "v41_deep"):
        tiny, real = compile_time.bench_layout_model(name, tiny=True).config, bench_config(name)
        assert tiny.hidden_size < real.hidden_size and tiny.num_hidden_layers == real.num_hidden_layers
        assert [tiny.layer_role(i) for i in range(tiny.num_hidden_layers)] == [
            real.layer_role(i) for i in range(real.num_hidden_layers)
        ]
    for argv, message in (
        (["--configs", "p8", "--tiny"], "--tiny takes V4.1 layouts"),
        (["--configs", "v5"], "unknown"),
    ):
        with pytest.raises(SystemExit):
            compile_time.main(argv + ["--out", "/nonexistent"])
        assert message in capsys.readouterr().err
