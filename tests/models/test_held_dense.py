"""Dense projections held as the checkpoint stores them (``load_model(..., dense_format="fp8")``):
tiny V4 and V4.1 checkpoints with block-FP8 dense weights (32 x 32 blocks, so the tiny widths
span several) give, held as stored, the logits of the same checkpoint dequantised on load,
exactly: each projection dequantises its weight to the activation dtype, the load-time value.
Through ``LLM.generate`` too, eager and compiled, with MTP-1 drafting through its fp8 projections.
A checkpoint without fp8 dense weights refuses the format in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_dspark import v41_dspark
from tiny import FP8_EXPERTS, tiny_v4, tiny_v41

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.api import Model, random_model
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.graphs.norm import dequant_dense
from deepinfer_fx.graphs.param_spec import build_tree, iter_tree
from deepinfer_fx.io.checkpoint import CheckpointError
from deepinfer_fx.io.loader import held_dense

SEED = 11


def _v41() -> dict:
    """A tiny V4.1 stored as released: block-FP8 dense weights, MXFP4 experts, its Engram fields
    left to the writer (which derives them from the tokenizer it writes)."""
    cfg = tiny_v41(quantization_config=FP8_EXPERTS["quantization_config"], expert_dtype="fp4")
    del cfg["engram_compressed_vocab_size"], cfg["engram_num_embeddings"]
    return {"model_type": "deepseek_v41", "text_config": cfg, "eos_token_id": [1, 2]}


CONFIGS = {"v4": lambda: tiny_v4(**FP8_EXPERTS), "v41": _v41}


@pytest.fixture(scope="module", params=list(CONFIGS))
def ckpt(request, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp(f"held-dense-{request.param}")
    deepinfer_fx.write_random_checkpoint(path, CONFIGS[request.param](), seed=SEED)
    return path


def _load(path: Path, dtype: torch.dtype, fmt: str) -> deepinfer_fx.Model:
    return deepinfer_fx.load_model(path, dtype=dtype, expert_format="dequant", dense_format=fmt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_dense_weights_give_the_dequantised_logits(ckpt: Path, dtype: torch.dtype) -> None:
    want, got = _load(ckpt, dtype, "dequant"), _load(ckpt, dtype, "fp8")
    assert got.config.held_dense == "fp8" and want.config.held_dense is None
    held = {p: t for p, t in iter_tree(got.params) if isinstance(t, torch.Tensor)}
    plain = {p: t for p, t in iter_tree(want.params) if isinstance(t, torch.Tensor)}
    attn = "layers.0.attn"
    c = got.config
    assert held[f"{attn}.wq_a"].dtype == torch.float8_e4m3fn
    assert held[f"{attn}.wq_a_scale"].shape == (-(-c.q_lora_rank // 32), -(-c.hidden_size // 32))
    assert held[f"{attn}.wq_a_scale"].dtype == torch.float32
    assert held["layers.0.ffn.shared_experts.w2"].dtype == torch.float8_e4m3fn
    assert held["head"].dtype == dtype and held["embed"].dtype == dtype  # unquantised in the checkpoint
    fp8 = {p for p, t in held.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8 and all(plain[p].dtype == dtype for p in fp8), "the fp8-held weights are the dequantised ones"
    assert set(held) == set(plain) | {p + "_scale" for p in fp8}
    ids = torch.randint(0, c.vocab_size, (23,), generator=torch.Generator().manual_seed(SEED)).tolist()
    torch.testing.assert_close(deepinfer_fx.logits(got, ids), deepinfer_fx.logits(want, ids), rtol=0, atol=0)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_generate_with_held_dense_weights(tmp_path: Path, eager: bool) -> None:
    """Greedy text of a V4 checkpoint (its MTP-1 block drafting as well) held in fp8 == dequantised."""
    path = tmp_path / "v4"
    deepinfer_fx.write_random_checkpoint(path, tiny_v4(**FP8_EXPERTS), seed=SEED)
    prompts = [[5, 9, 2, 7, 11, 3], [8, 1, 4]]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    out = {}
    for fmt in ("dequant", "fp8"):
        llm = LLM(
            str(path),
            device="cpu",
            dtype="float32",
            eager=eager,
            warmup=False,
            max_model_len=64,
            max_num_seqs=2,
            expert_format="dequant",
            dense_format=fmt,
            speculative_config={"method": "mtp", "num_speculative_tokens": 2},
        )
        assert llm.model.config.held_dense == (None if fmt == "dequant" else "fp8")
        out[fmt] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert out["fp8"] == out["dequant"]


def test_auto_keeps_fp8_on_cuda_in_bf16(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` (the default): fp8 on CUDA with bf16 activations, where decode reads the weight as
    stored; converted on the CPU and in fp32 (each call would dequantise the whole weight again)."""
    c = deepinfer_fx.load_model(ckpt, dtype=torch.float32, expert_format="dequant").config
    assert c.held_dense is None
    assert held_dense(c, "auto", "cuda") == held_dense(c, None, torch.device("cuda", 1)) == "fp8"
    assert held_dense(c, "auto", "cuda", torch.float32) is None and held_dense(c, "auto", "cpu") is None
    assert held_dense(c, "dequant", "cuda") is None and held_dense(c, "fp8", "cpu") == "fp8"
    assert held_dense(c.replace(fp8_block=None), "auto", "cuda") is None  # nothing stored in fp8
    monkeypatch.setenv("DEEPINFER_DENSE_FORMAT", "dequant")
    assert held_dense(c, None, "cuda") is None


def test_an_unquantised_checkpoint_refuses_fp8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    deepinfer_fx.write_random_checkpoint(tmp_path, tiny_v4(), seed=SEED)
    with pytest.raises(CheckpointError) as err:
        deepinfer_fx.load_model(tmp_path, dense_format="fp8")
    assert "\n" not in str(err.value) and "dense_format='fp8'" in str(err.value) and "unquantised" in str(err.value)
    monkeypatch.setenv("DEEPINFER_DENSE_FORMAT", "fp4")
    with pytest.raises(ValueError, match="DEEPINFER_DENSE_FORMAT"):
        deepinfer_fx.load_model(tmp_path)


def test_a_model_object_refuses_a_storage_format() -> None:
    """``LLM(model=Model, dense_format=...)`` would have nothing to load: refused, not ignored."""
    model = random_model(tiny_v4(), seed=SEED)
    for kw in ({"dense_format": "fp8"}, {"expert_format": "dequant"}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} apply when a checkpoint is loaded"):
            LLM(model, eager=True, max_model_len=32, **kw)


def _dequantised(model: Model) -> Model:
    """``model`` with every weight held in block FP8 dequantised to its dtype, as a load would."""
    flat = dict(iter_tree(model.params))
    for path in [p for p in flat if p + "_scale" in flat]:
        flat[path] = dequant_dense(flat[path], flat.pop(path + "_scale"), model.dtype)
    return Model(model.config.replace(held_dense=None), build_tree(flat))


def test_dspark_drafts_through_held_dense_weights() -> None:
    """A tiny V4.1 with its DSpark drafter, every block-FP8 projection held as stored (the stages'
    and ``main_proj`` too): the engine's greedy text and drafts are those of the model dequantised,
    with speculation on (eager: the compiled steps are the V4 test's)."""
    c = config_from_dict(v41_dspark()).replace(fp8_block=32, held_dense="fp8", expert_dtype="bf16")
    held = random_model(c, seed=SEED)
    assert held.params["mtp"][0]["main_proj"].dtype == torch.float8_e4m3fn
    prompts = [[5, 9, 2, 7, 11, 3, 4, 8], [8, 1, 4]]
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    runs = {}
    for name, model in (("held", held), ("dequantised", _dequantised(held))):
        llm = LLM(
            model,
            eager=True,
            max_model_len=64,
            max_num_seqs=2,
            speculative_config={"method": "dspark", "num_speculative_tokens": 3},
        )
        runs[name] = ([o.outputs[0].token_ids for o in llm.generate(prompts, sp)], llm.speculator.stats.draft_tokens)
    assert runs["held"] == runs["dequantised"] and runs["held"][1] > 0
