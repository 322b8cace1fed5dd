"""Routed experts held as the checkpoint stores them (``load_model(..., expert_format=...)``):
a tiny V4 -Base style checkpoint (block-FP8 experts, ue8m0 or fp32 scales) held in fp8 gives the
logits of the same checkpoint dequantised on load, exactly (the per-call dequantisation is the
load-time one); the fp8 op and the swap agree with the eager path; the choice of format and a
malformed scale end in one-line errors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import FP8_EXPERTS, tiny_v4

import deepinfer_fx
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.graphs.moe import routed_experts
from deepinfer_fx.graphs.params import iter_tree, param_specs
from deepinfer_fx.graphs.swap import swapped
from deepinfer_fx.io.checkpoint import CheckpointError
from deepinfer_fx.io.loader import holds_fp8_experts
from deepinfer_fx.io.quant import dequant_fp8_block, quant_fp8_block, ue8m0_to_float
from deepinfer_fx.passes.swaps import MoEExpertsSwap

SEED = 7
EXPERTS = "layers.1.ffn.experts"


def _rewrite(ckpt: Path, change) -> None:
    """Apply ``change(name, tensor) -> tensor`` to every stored tensor, shard by shard."""
    for shard in ckpt.glob("*.safetensors"):
        tensors = load_file(shard)
        save_file({k: change(k, v) for k, v in tensors.items()}, str(shard), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["ue8m0", "fp32"])
def ckpt(request, tmp_path_factory) -> Path:
    """The checkpoint, with the experts' scales as the release writes them (ue8m0) or as -Base
    checkpoints ship them (fp32)."""
    path = tmp_path_factory.mktemp(f"fp8-experts-{request.param}")
    deepinfer_fx.write_random_checkpoint(path, tiny_v4(**FP8_EXPERTS), seed=SEED)
    if request.param == "fp32":
        _rewrite(path, lambda k, v: ue8m0_to_float(v) if ".experts." in k and k.endswith(".scale") else v)
    return path


def _one_line(err: BaseException) -> str:
    msg = str(err)
    assert "\n" not in msg, msg
    return msg


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_fp8_gives_the_dequantised_logits(ckpt: Path, dtype: torch.dtype) -> None:
    want = deepinfer_fx.load_model(ckpt, dtype=dtype, expert_format="dequant")
    got = deepinfer_fx.load_model(ckpt, dtype=dtype, expert_format="fp8")
    assert got.config.fp8_experts and not want.config.fp8_experts
    experts = got.params["layers"][1]["ffn"]["experts"]
    e, i, d = got.config.n_routed_experts, got.config.moe_intermediate_size, got.config.hidden_size
    assert {n: (t.dtype, tuple(t.shape)) for n, t in experts.items()} == {
        "w1": (torch.float8_e4m3fn, (e, i, d)), "w3": (torch.float8_e4m3fn, (e, i, d)), "w2": (torch.float8_e4m3fn, (e, d, i)),
        "w1_scale": (torch.float32, (e, 1, 2)), "w3_scale": (torch.float32, (e, 1, 2)), "w2_scale": (torch.float32, (e, 2, 1)),
    }
    assert torch.equal(dequant_fp8_block(experts["w2"], experts["w2_scale"], 32, dtype), want.params["layers"][1]["ffn"]["experts"]["w2"])
    # the scales are declared specs, yet no parameters: the count is the dequantised model's
    held = {path for path, _ in iter_tree(got.params)} - {path for path, _ in iter_tree(want.params)}
    assert held == {s.path for s in param_specs(got.config) if s.held == "fp8_scale"} and held
    assert deepinfer_fx.count_params(got.config) == deepinfer_fx.count_params(want.config)
    ids = random.Random(SEED).choices(range(3, want.config.vocab_size), k=24)
    torch.testing.assert_close(deepinfer_fx.logits(got, ids), deepinfer_fx.logits(want, ids), rtol=0, atol=0)


def test_fp8_op_and_swap_match_the_eager_path(ckpt: Path) -> None:
    """``routed_experts`` over held experts == the swap (which calls ``moe_experts_fp8``) == the
    dequantised experts, on CPU where the op runs its reference."""
    model = deepinfer_fx.load_model(ckpt, dtype=torch.float32, expert_format="fp8")
    p = model.params["layers"][1]["ffn"]["experts"]
    g = torch.Generator().manual_seed(SEED)
    t, k = 9, model.config.num_experts_per_tok
    x = torch.randn(t, model.config.hidden_size, generator=g)
    idx = torch.stack([torch.randperm(model.config.n_routed_experts, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g)
    want = routed_experts({n: dequant_fp8_block(p[n], p[f"{n}_scale"], 32) for n in ("w1", "w3", "w2")}, 10.0, x, idx, w)
    torch.testing.assert_close(routed_experts(p, 10.0, x, idx, w), want, rtol=0, atol=0)
    with swapped(MoEExpertsSwap().swap()):
        torch.testing.assert_close(routed_experts(p, 10.0, x, idx, w), want, rtol=0, atol=0)


def test_random_model_holds_the_quantised_draw() -> None:
    """A random model with ``fp8_experts`` holds the block quantisation of the dequantised
    config's draw, and every other parameter is that draw."""
    c = config_from_dict(tiny_v4(**FP8_EXPERTS))
    plain = dict(iter_tree(deepinfer_fx.random_model(c, seed=SEED).params))
    held = dict(iter_tree(deepinfer_fx.random_model(c.replace(fp8_experts=True), seed=SEED).params))
    w8, scale = quant_fp8_block(plain[f"{EXPERTS}.w3"], 32)
    assert torch.equal(held[f"{EXPERTS}.w3"].view(torch.uint8), w8.view(torch.uint8))
    assert torch.equal(held[f"{EXPERTS}.w3_scale"], ue8m0_to_float(scale))
    assert all(torch.equal(held[path], v) for path, v in plain.items() if ".experts." not in path)


def test_expert_format_choice(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    c = deepinfer_fx.load_model(ckpt, dtype=torch.float32).config
    assert not c.fp8_experts  # auto on the CPU: every eager call would dequantise again
    assert holds_fp8_experts(c, "auto", "cuda") and holds_fp8_experts(c, None, torch.device("cuda", 1))
    assert not holds_fp8_experts(c, "dequant", "cuda") and holds_fp8_experts(c, "fp8", "cpu")
    mxfp4 = config_from_dict(tiny_v4(**{**FP8_EXPERTS, "expert_dtype": "fp4"}))
    assert not holds_fp8_experts(mxfp4, "auto", "cuda")  # MXFP4 experts are always dequantised
    for other, stored in ((mxfp4, "MXFP4"), (config_from_dict(tiny_v4()), "unquantised")):
        with pytest.raises(CheckpointError) as e:
            holds_fp8_experts(other, "fp8", "cuda")
        assert stored in _one_line(e.value) and "expert_format='fp8'" in str(e.value)
    with pytest.raises(ValueError) as e:
        deepinfer_fx.load_model(ckpt, expert_format="int8")
    assert "'int8'" in _one_line(e.value) and "auto, fp8 or dequant" in str(e.value)
    monkeypatch.setenv("DEEPINFER_EXPERT_FORMAT", "fp8")
    assert deepinfer_fx.load_model(ckpt, dtype=torch.float32).config.fp8_experts
    monkeypatch.setenv("DEEPINFER_EXPERT_FORMAT", "yes")
    with pytest.raises(ValueError) as e:
        deepinfer_fx.load_model(ckpt, dtype=torch.float32)
    assert "DEEPINFER_EXPERT_FORMAT" in _one_line(e.value) and "auto, fp8 or dequant" in str(e.value)


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
def test_cuda_load_keeps_fp8_and_the_triton_kernel_matches(ckpt: Path) -> None:
    """On CUDA ``auto`` keeps the experts in fp8, and the swap the compiled steps use runs them
    through the Triton fp8 kernel to the logits of the dequantised model."""
    from deepinfer_fx.kernels.triton import register_nvidia_kernels

    assert register_nvidia_kernels()
    got = deepinfer_fx.load_model(ckpt, dtype=torch.float32, device="cuda")
    assert got.config.fp8_experts and got.params["layers"][1]["ffn"]["experts"]["w1"].dtype == torch.float8_e4m3fn
    want = deepinfer_fx.load_model(ckpt, dtype=torch.float32, device="cuda", expert_format="dequant")
    ids = random.Random(SEED).choices(range(3, want.config.vocab_size), k=24)
    ref = deepinfer_fx.logits(want, ids)
    with swapped(MoEExpertsSwap().swap()):
        out = deepinfer_fx.logits(got, ids)
    assert (out - ref).abs().max() <= 1e-4 * ref.abs().max()
