"""The memory plan (``engine/memory_plan.py``, ``generate --plan``): a tiny config counted by hand,
the released configs against the spec's byte budgets and hand counts of their state, and the
CLI on a directory that holds nothing but a config.json."""

from __future__ import annotations

import json
import math

import pytest
from released import released_config, released_path

from deepinfer_fx import generate
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.demo import DEMO_CONFIG
from deepinfer_fx.engine.memory_plan import GiB, memory_plan
from deepinfer_fx.sharding.mesh import MeshSpec

# generate's demo model: 4 layers (ratios 0, 4, 128, 4) + one MTP-1 layer, hidden 128, head_dim
# 128, index_head_dim 64, 8 routed experts of intermediate 64, MXFP4 experts, fp8 blocks of 32.
TINY = DEMO_CONFIG


def _category(plan, name: str) -> int:
    return next(c.bytes for c in plan.device if c.name == name)


def test_tiny_config_by_hand() -> None:
    c = config_from_dict(TINY)
    plan = memory_plan(c, max_model_len=4096, max_num_seqs=4, expert_format="dequant")
    expert = 3 * 64 * 128  # w1, w3 [64, 128] and w2 [128, 64]
    assert _category(plan, "routed experts") == 4 * 8 * expert * 2  # 4 layers x 8 experts, bf16 (MXFP4 dequantised)
    native = memory_plan(c, max_model_len=4096, max_num_seqs=4)  # auto: MXFP4 held as stored on CUDA
    assert _category(native, "routed experts") == 4 * 8 * (expert // 2 + expert // 32)
    routed_released = next(c.note for c in plan.device if c.name == "routed experts")
    numel = 4 * 8 * expert
    assert (
        f"{(numel // 2 + numel // 32) / GiB:.2f} GiB as released (MXFP4)" in routed_released
    )  # half a byte + a scale a 32
    # the MTP layer's experts are the draft model's, beside its dense weights
    assert _category(plan, "draft model (mtp.*)") > 8 * expert * 2
    # per cached token: CSA layers 1 and 3 keep (128 + 64) / 4 entry channels, HCA layer 2 128 / 128; bf16
    assert plan.state_per_token == 2 * (128 + 64) / 4 * 2 + 128 / 128 * 2
    assert plan.sequence_bytes == plan.state_per_sequence + math.ceil(plan.state_per_token * 4096)
    assert plan.fits and plan.sequences == 4

    # ep2 without redundant experts: 4 experts a GPU; with 2 extra: (8 + 2) / 2 = 5
    for extra, slots in ((0, 4), (2, 5)):
        ep2 = memory_plan(c, MeshSpec(ep=2), extra_experts=extra, expert_format="dequant")
        assert _category(ep2, "routed experts") == 4 * slots * expert * 2
        assert _category(ep2, "dense weights") == _category(plan, "dense weights")  # replicated

    # block-FP8 experts held as stored on CUDA (expert_format fp8): a byte a value + fp32 scales of 32 x 32 blocks
    fp8 = memory_plan(c.replace(expert_dtype="fp8"), expert_format="fp8")
    blocks = 2 * (64 // 32) * (128 // 32) + (128 // 32) * (64 // 32)
    assert _category(fp8, "routed experts") == 4 * 8 * (expert + blocks * 4)
    assert (
        _category(memory_plan(c.replace(expert_dtype="fp8"), expert_format="dequant"), "routed experts")
        == 4 * 8 * expert * 2
    )

    # a GPU too small for the weights: the plan says so, and how many sequences the pool would hold (none)
    small = memory_plan(c, gpu_memory_gib=_category(plan, "dense weights") / GiB, expert_format="dequant")
    assert not small.fits and small.sequences == 0 and "does NOT fit" in small.format()


def test_released_v41_flash() -> None:
    """Routed experts as released (MXFP4) against the spec's 288.8 GB, held so (auto) and as bf16 (3.76x);
    Engram as stored against the spec's 203.1 GB, in host memory (each table is above the device
    budget, an eighth of the GPU) compiled or eager; on a GPU of 2 TB they fit its budget; state per token
    by hand: three ratio-2 KV sources and one ratio-1 source, 512 + 128 channels each, bf16."""
    c = released_config("v41-flash")
    plan = memory_plan(c)
    note = next(x.note for x in plan.device if x.name == "routed experts")
    released = float(note.split("; ")[1].split(" GiB")[0]) * GiB
    assert abs(released / 288.8e9 - 1) < 0.005, note
    assert abs(_category(plan, "routed experts") / released - 1) < 0.01
    bf16 = memory_plan(c, expert_format="dequant")
    assert abs(_category(bf16, "routed experts") / released - 2 / (0.5 + 1 / 32)) < 0.01
    assert "Engram" not in [x.name for x in plan.device] and not plan.problems
    assert abs(plan.host[0].bytes / 203.1e9 - 1) < 0.01 and "pinned host memory" in plan.host[0].note
    big = memory_plan(c, gpu_memory_gib=2048)
    assert not big.host and abs(_category(big, "Engram tables") / 203.1e9 - 1) < 0.01
    # DEEPINFER_ENGRAM_TABLES / DEEPINFER_ENGRAM_DEVICE_GIB as the engine places the tables
    assert memory_plan(c, gpu_memory_gib=2048, engram_tables="host").host[0].bytes == _category(big, "Engram tables")
    assert _category(memory_plan(c, engram_tables="device"), "Engram tables") == _category(big, "Engram tables")
    one = memory_plan(c, engram_device_gib=120)  # room for the first table (~101 GB) and not both
    assert 0 < _category(one, "Engram tables") < 120 * GiB < _category(big, "Engram tables")
    assert _category(one, "Engram tables") + one.host[0].bytes == _category(big, "Engram tables")
    assert memory_plan(c, MeshSpec(ep=16)).fits
    eager = memory_plan(c, MeshSpec(ep=16), compiled=False)
    assert abs(eager.host[0].bytes / 203.1e9 - 1) < 0.01 and "Engram" not in [x.name for x in eager.device]
    assert eager.fits and not memory_plan(c, MeshSpec(ep=8), compiled=False, expert_format="dequant").fits
    assert (
        memory_plan(c, MeshSpec(ep=4), compiled=False).fits and not memory_plan(c, MeshSpec(ep=2), compiled=False).fits
    )
    assert plan.state_per_token == 3 * (512 + 128) / 2 * 2 + (512 + 128) * 2


def test_released_v4_flash_and_pro() -> None:
    """V4-Flash: state per token by hand (21 CSA layers keep (512 + 128) / 4 channels, 20 HCA
    layers 512 / 128, bf16); with MXFP4 experts as stored it does not fit one H200 and fits each GPU
    of ep2 (ep8 dequantised); V4-Pro needs ep8 with its dense projections in block FP8 too (auto on
    CUDA), ep16 with them dequantised, ep64 with everything dequantised."""
    flash = released_config("v4-flash")
    assert memory_plan(flash).state_per_token == 21 * (512 + 128) / 4 * 2 + 20 * 512 / 128 * 2
    assert not memory_plan(flash).fits and memory_plan(flash, MeshSpec(ep=2)).fits
    assert not memory_plan(flash, MeshSpec(ep=4), expert_format="dequant").fits
    assert memory_plan(flash, MeshSpec(ep=8), expert_format="dequant").fits
    pro = released_config("v4-pro")
    assert not memory_plan(pro, MeshSpec(ep=4)).fits and memory_plan(pro, MeshSpec(ep=8)).fits
    assert not memory_plan(pro, MeshSpec(ep=8), dense_format="dequant").fits
    assert memory_plan(pro, MeshSpec(ep=16), dense_format="dequant").fits
    bf16 = {"expert_format": "dequant", "dense_format": "dequant"}
    assert not memory_plan(pro, MeshSpec(ep=32), **bf16).fits
    assert memory_plan(pro, MeshSpec(ep=64), **bf16).fits
    # 256 + 32 redundant experts over ep8: 36 slots a GPU
    assert "36 of 256 experts a layer" in next(
        x.note for x in memory_plan(flash, MeshSpec(ep=8)).device if x.name == "routed experts"
    )


def test_native_formats() -> None:
    """Everything as the checkpoints store it (MXFP4 experts, block-FP8 dense weights, the state
    as trained): V4.1-Flash's state per token is the spec's 890 B (§8.1: NVFP4 entries of 288 B,
    MXFP4 index keys of 68 B); V4-Flash's 21 CSA layers keep (584 + 68) / 4 B and 20 HCA layers
    584 / 128 B; fp8 dense weights take 0.6 of the dequantised bytes; V4-Pro then fits ep8 (16 sequences), which
    it does not with its dense weights dequantised."""
    native = {"expert_format": "fp4", "dense_format": "fp8", "kv_format": "trained"}
    v41 = released_config("v41-flash")
    assert memory_plan(v41, **native).state_per_token == 3 * (288 + 68) / 2 + 288 + 68 == 890
    flash = released_config("v4-flash")
    assert memory_plan(flash, **native).state_per_token == 21 * (584 + 68) / 4 + 20 * 584 / 128
    bf16, fp8 = (_category(memory_plan(flash, dense_format=f), "dense weights") for f in ("dequant", "fp8"))
    assert 0.55 < fp8 / bf16 < 0.65  # the projections halve; embeddings and head stay bf16
    pro = released_config("v4-pro")
    assert not memory_plan(pro, MeshSpec(ep=8), expert_format="fp4", dense_format="dequant").fits
    assert memory_plan(pro, MeshSpec(ep=8), max_num_seqs=16, **native).fits
    assert "fp8 / fp4 as trained" in memory_plan(pro, **native).format()


def test_cli_reads_only_the_config(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(released_path("v4-flash").read_text())
    assert generate.main(["--plan", "--model", str(tmp_path), "--mesh", "ep8"]) == 0
    out = capsys.readouterr().out
    assert (
        "memory plan per GPU: mesh ep8 (8 GPUs)" in out
        and "routed experts" in out
        and out.rstrip().splitlines()[-1].startswith("fits")
    )
    assert (
        generate.main(["--plan", "--model", str(released_path("v4-flash"))]) == 1
    )  # the released file itself, one GPU
    assert "does NOT fit" in capsys.readouterr().out
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "config.json").write_text(json.dumps(TINY))
    assert generate.main(["--plan", "--model", str(tiny), "--gpu-memory-gb", "0.001"]) == 1
    capsys.readouterr()
    assert generate.main(["--plan", "--model", str(tmp_path / "missing")]) == 2  # the CLI's one-line error
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "config.json" in err and "Traceback" not in err
    with pytest.raises(SystemExit):  # an option --plan does not read
        generate.main(["--plan", "--model", str(tiny), "--temperature", "0.5"])


def test_gpu_memory_without_plan_is_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        generate.main(["--gpu-memory-gb", "80"])
    assert "only --plan reads it" in capsys.readouterr().err


def test_bench_memory_plans_finds_the_smallest_mesh(tmp_path) -> None:
    """``bench.memory_plans``: the mesh it reports fits and the one before it does not; the
    released form needs fewer GPUs and fewer state bytes a token than the dequantised one."""
    from deepinfer_fx.bench import memory_plans
    from deepinfer_fx.sharding.mesh import parse_mesh

    meshes = ["1", "ep2", "ep4", "ep8", "ep16"]
    rows = {
        form: memory_plans.smallest_fit("deepseek_v4_flash", form, 141.0, meshes, 8192, 64)
        for form in memory_plans.FORMATS
    }
    for form, row in rows.items():
        at = meshes.index(row["mesh"])
        c = released_config("v4-flash")
        fit = [
            memory_plan(c, parse_mesh(m), gpu_memory_gib=141.0, max_model_len=8192, **memory_plans.FORMATS[form]).fits
            for m in meshes[at - 1 : at + 1]
        ]
        assert fit == [False, True], (form, row)
    assert rows["released"]["gpus"] < rows["dequantised"]["gpus"]
    assert rows["released"]["state_bytes_per_token"] < rows["dequantised"]["state_bytes_per_token"]
    assert memory_plans.main(["--meshes", "ep64", "--max-num-seqs", "1", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "memory_plans_released.json").exists()
