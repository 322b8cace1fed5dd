"""Routed experts held as the checkpoint stores them (``load_model(..., expert_format=...)``):
tiny V4 checkpoints with block-FP8 experts (ue8m0 or fp32 scales, as the release and -Base
write them) or MXFP4 experts, held as stored, give the logits of the same checkpoint
dequantised on load, exactly (the per-call dequantisation is the load-time one); the ops and
the swap agree with the eager path; the choice of format and a malformed scale end in
one-line errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import FP8_EXPERTS, tiny_v4

import deepinfer_fx
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.graphs.moe import dequant_experts, routed_experts
from deepinfer_fx.graphs.param_spec import iter_tree
from deepinfer_fx.graphs.params import param_specs
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.io.checkpoint import CheckpointError
from deepinfer_fx.io.loader import held_experts
from deepinfer_fx.io.quant import quant_fp8_block, quant_mxfp4, ue8m0_to_float
from deepinfer_fx.passes.manager import registered_passes

SEED = 7
EXPERTS = "layers.1.ffn.experts"
FP4_EXPERTS = {**FP8_EXPERTS, "expert_dtype": "fp4"}
FORMATS = {"fp8": FP8_EXPERTS, "fp4": FP4_EXPERTS}


def _rewrite(ckpt: Path, change) -> None:
    """Apply ``change(name, tensor) -> tensor`` to every stored tensor, shard by shard."""
    for shard in ckpt.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({k: change(k, v) for k, v in tensors.items()}, str(shard), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["fp8-ue8m0", "fp8-fp32", "fp4-ue8m0"])
def ckpt(request, tmp_path_factory) -> tuple[str, Path]:
    """(format, checkpoint): block-FP8 experts with the scales as the release writes them
    (ue8m0) or as -Base checkpoints ship them (fp32), or MXFP4 experts."""
    fmt, scales = request.param.split("-")
    path = tmp_path_factory.mktemp(f"held-experts-{request.param}")
    deepinfer_fx.write_random_checkpoint(path, tiny_v4(**FORMATS[fmt]), seed=SEED)
    if scales == "fp32":
        _rewrite(path, lambda k, v: ue8m0_to_float(v) if ".experts." in k and k.endswith(".scale") else v)
    return fmt, path


def _one_line(err: BaseException) -> str:
    msg = str(err)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_experts_give_the_dequantised_logits(ckpt: tuple[str, Path], dtype: torch.dtype) -> None:
    fmt, path = ckpt
    want = deepinfer_fx.load_model(path, dtype=dtype, expert_format="dequant")
    got = deepinfer_fx.load_model(path, dtype=dtype, expert_format=fmt)
    assert got.config.held_experts == fmt and want.config.held_experts is None
    experts = got.params["layers"][1]["ffn"]["experts"]
    e, i, d = got.config.n_routed_experts, got.config.moe_intermediate_size, got.config.hidden_size
    if fmt == "fp8":
        held = {
            "w1": (torch.float8_e4m3fn, (e, i, d)),
            "w3": (torch.float8_e4m3fn, (e, i, d)),
            "w2": (torch.float8_e4m3fn, (e, d, i)),
            "w1_scale": (torch.float32, (e, 1, 2)),
            "w3_scale": (torch.float32, (e, 1, 2)),
            "w2_scale": (torch.float32, (e, 2, 1)),
        }
    else:  # two e2m1 codes a byte, a ue8m0 byte a 32 values of a row
        held = {
            "w1": (torch.uint8, (e, i, d // 2)),
            "w3": (torch.uint8, (e, i, d // 2)),
            "w2": (torch.uint8, (e, d, i // 2)),
            "w1_scale": (torch.uint8, (e, i, d // 32)),
            "w3_scale": (torch.uint8, (e, i, d // 32)),
            "w2_scale": (torch.uint8, (e, d, i // 32)),
        }
    assert {n: (t.dtype, tuple(t.shape)) for n, t in experts.items()} == held
    assert torch.equal(dequant_experts(experts, dtype)["w2"], want.params["layers"][1]["ffn"]["experts"]["w2"])
    # the scales are declared specs, yet no parameters: the count is the dequantised model's
    extra = {path for path, _ in iter_tree(got.params)} - {path for path, _ in iter_tree(want.params)}
    assert extra == {s.path for s in param_specs(got.config) if s.held == "scale"} and extra
    assert deepinfer_fx.count_params(got.config) == deepinfer_fx.count_params(want.config)
    ids = random.Random(SEED).choices(range(3, want.config.vocab_size), k=24)
    torch.testing.assert_close(deepinfer_fx.logits(got, ids), deepinfer_fx.logits(want, ids), rtol=0, atol=0)


def test_ops_and_swap_match_the_eager_path(ckpt: tuple[str, Path]) -> None:
    """``routed_experts`` over held experts == the swap (which calls ``moe_experts_fp8`` /
    ``moe_experts_fp4``) == the dequantised experts, on CPU where the ops run their reference."""
    fmt, path = ckpt
    model = deepinfer_fx.load_model(path, dtype=torch.float32, expert_format=fmt)
    p = model.params["layers"][1]["ffn"]["experts"]
    g = torch.Generator().manual_seed(SEED)
    t, k = 9, model.config.num_experts_per_tok
    x = torch.randn(t, model.config.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(model.config.n_routed_experts, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    want = routed_experts(dequant_experts(p, torch.float32), 10.0, x, idx, w)
    torch.testing.assert_close(routed_experts(p, 10.0, x, idx, w), want, rtol=0, atol=0)
    with swapped(registered_passes()["moe_experts_kernel"].swap()):
        torch.testing.assert_close(routed_experts(p, 10.0, x, idx, w), want, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_random_model_holds_the_quantised_draw(fmt: str) -> None:
    """A random model with held experts holds the quantisation of the dequantised config's
    draw, and every other parameter is that draw."""
    c = config_from_dict(tiny_v4(**FORMATS[fmt]))
    plain = dict(iter_tree(deepinfer_fx.random_model(c, seed=SEED).params))
    held = dict(iter_tree(deepinfer_fx.random_model(c.replace(held_experts=fmt), seed=SEED).params))
    if fmt == "fp8":
        w8, scale = quant_fp8_block(plain[f"{EXPERTS}.w3"], 32)
        assert torch.equal(held[f"{EXPERTS}.w3"].view(torch.uint8), w8.view(torch.uint8))
        assert torch.equal(held[f"{EXPERTS}.w3_scale"], ue8m0_to_float(scale))
    else:
        w4, scale = quant_mxfp4(plain[f"{EXPERTS}.w3"])
        assert torch.equal(held[f"{EXPERTS}.w3"], w4.view(torch.uint8))
        assert torch.equal(held[f"{EXPERTS}.w3_scale"], scale.view(torch.uint8))
    assert all(torch.equal(held[path], v) for path, v in plain.items() if ".experts." not in path)


def test_expert_format_choice(ckpt: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    fmt, path = ckpt
    c = deepinfer_fx.load_model(path, dtype=torch.float32).config
    assert c.held_experts is None  # auto on the CPU: every eager call would dequantise again
    # auto keeps block FP8 and MXFP4 as stored on CUDA
    assert held_experts(c, "auto", "cuda") == held_experts(c, None, torch.device("cuda", 1)) == fmt
    assert held_experts(c, "dequant", "cuda") is None and held_experts(c, fmt, "cpu") == fmt
    other = "fp4" if fmt == "fp8" else "fp8"
    for config, stored in (
        (c, {"fp8": "block-FP8", "fp4": "MXFP4"}[fmt]),
        (config_from_dict(tiny_v4()), "unquantised"),
    ):
        with pytest.raises(CheckpointError) as e:
            held_experts(config, other, "cuda")
        assert f"are {stored}" in _one_line(e.value) and f"expert_format={other!r}" in str(e.value)
    with pytest.raises(ValueError) as e:
        deepinfer_fx.load_model(path, expert_format="int8")
    assert "'int8'" in _one_line(e.value) and "auto, fp8, fp4 or dequant" in str(e.value)
    monkeypatch.setenv("DEEPINFER_EXPERT_FORMAT", fmt)
    assert deepinfer_fx.load_model(path, dtype=torch.float32).config.held_experts == fmt
    monkeypatch.setenv("DEEPINFER_EXPERT_FORMAT", "yes")
    with pytest.raises(ValueError) as e:
        deepinfer_fx.load_model(path, dtype=torch.float32)
    assert "DEEPINFER_EXPERT_FORMAT" in _one_line(e.value) and "auto, fp8, fp4 or dequant" in str(e.value)


def test_malformed_mxfp4_scale_names_the_key(tmp_path: Path) -> None:
    deepinfer_fx.write_random_checkpoint(tmp_path, tiny_v4(**FP4_EXPERTS), seed=SEED)
    bad = f"{EXPERTS}.3.w2.scale"
    _rewrite(tmp_path, lambda k, v: v[:, :0].contiguous() if k == bad else v)
    for fmt in ("fp4", "dequant"):
        with pytest.raises(CheckpointError) as e:
            deepinfer_fx.load_model(tmp_path, dtype=torch.float32, expert_format=fmt)
        msg = _one_line(e.value)
        assert f"{EXPERTS}.3.w2.weight" in msg and "[64, 0]" in msg and ".safetensors" in msg, msg


@pytest.mark.parametrize("expert_format", ["fp8", "dequant"])
def test_malformed_scale_names_the_key(tmp_path: Path, expert_format: str) -> None:
    deepinfer_fx.write_random_checkpoint(tmp_path, tiny_v4(**FP8_EXPERTS), seed=SEED)
    bad = f"{EXPERTS}.3.w2.scale"
    _rewrite(tmp_path, lambda k, v: v.view(torch.uint8)[:1].view(v.dtype).contiguous() if k == bad else v)
    with pytest.raises(CheckpointError) as e:
        deepinfer_fx.load_model(tmp_path, dtype=torch.float32, expert_format=expert_format)
    msg = _one_line(e.value)
    assert f"{EXPERTS}.3.w2.weight" in msg and "[1, 1]" in msg and "[64, 32]" in msg and ".safetensors" in msg


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_held_experts_and_the_triton_kernel_match(ckpt: tuple[str, Path]) -> None:
    """On CUDA ``auto`` keeps block-FP8 experts, ``fp4`` MXFP4 ones, and the swap the compiled
    steps use runs them through the Triton kernel of their format to the dequantised logits."""
    from deepinfer_fx.kernels.triton import register_nvidia_kernels

    fmt, path = ckpt
    assert register_nvidia_kernels()
    got = deepinfer_fx.load_model(path, dtype=torch.float32, device="cuda", expert_format=None if fmt == "fp8" else fmt)
    assert got.config.held_experts == fmt
    want = deepinfer_fx.load_model(path, dtype=torch.float32, device="cuda", expert_format="dequant")
    ids = random.Random(SEED).choices(range(3, want.config.vocab_size), k=24)
    ref = deepinfer_fx.logits(want, ids)
    with swapped(registered_passes()["moe_experts_kernel"].swap()):
        out = deepinfer_fx.logits(got, ids)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
