"""Random checkpoints in DeepSeek's format (fp8 block weights, MXFP4 experts, a tokenizer)
load and run; bad checkpoints end in one-line errors naming the file and the tensor."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx.config import ConfigError
from deepinfer_fx.graphs.params import param_specs
from deepinfer_fx.graphs.random_init import random_flat
from deepinfer_fx.io.checkpoint import CheckpointError
from deepinfer_fx.io.quant import dequant_fp8_block, dequant_mxfp4, quant_fp8_block, quant_mxfp4
from deepinfer_fx.io.tokenizer import load_tokenizer

QUANT = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0"}


def _quantised(block: int) -> dict:
    return tiny_v4(
        quantization_config={**QUANT, "weight_block_size": [block, block]}, expert_dtype="fp4", torch_dtype="bfloat16"
    )


@pytest.mark.parametrize("block", [128, 32])
def test_quantised_checkpoint_loads_and_runs(block: int, tmp_path: Path) -> None:
    seed = random.SystemRandom().randrange(2**31)
    cfg = _quantised(block)
    deepinfer_fx.write_random_checkpoint(tmp_path, cfg, seed=seed)
    stored = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(stored.values())) >= 2, "expected several shards"
    assert "layers.0.attn.wq_a.scale" in stored and "layers.1.ffn.experts.3.w2.scale" in stored

    model = deepinfer_fx.load_model(tmp_path, dtype=torch.float32)
    c, params = model
    assert c.fp8_block == block and c.fake_quant
    # Loaded weights are exactly the dequantised form of what the writer drew.
    values = random_flat(c, seed, torch.float32)
    wq_a = values["layers.0.attn.wq_a"].to(torch.bfloat16).float()
    assert torch.equal(params["layers"][0]["attn"]["wq_a"], dequant_fp8_block(*quant_fp8_block(wq_a, block), block))
    w2 = values["layers.1.ffn.experts.w2"][3].to(torch.bfloat16).float()
    assert torch.equal(params["layers"][1]["ffn"]["experts"]["w2"][3], dequant_mxfp4(*quant_mxfp4(w2)))
    assert torch.equal(params["layers"][0]["ffn"]["gate"]["tid2eid"], values["layers.0.ffn.gate.tid2eid"])
    assert "mtp" in params

    tok = load_tokenizer(tmp_path)
    ids = tok.encode("hello world, this is a tiny model").ids
    out = deepinfer_fx.logits(model, ids)
    assert out.shape == (len(ids), c.vocab_size) and torch.isfinite(out).all()


def test_count_params_matches_loaded_tree(tmp_path: Path) -> None:
    cfg = tiny_v4()
    deepinfer_fx.write_random_checkpoint(tmp_path, cfg, seed=1)
    model = deepinfer_fx.load_model(tmp_path, dtype=torch.float32)
    from deepinfer_fx.graphs.param_spec import iter_tree

    n = sum(t.numel() for path, t in iter_tree(model.params) if not path.startswith("mtp"))
    assert n == deepinfer_fx.count_params(cfg)
    assert sum(s.numel for s in param_specs(model.config)) == deepinfer_fx.count_params(cfg, mtp=True)


def _one_line(err: BaseException) -> str:
    msg = str(err)
    assert "\n" not in msg, msg
    return msg


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    deepinfer_fx.write_random_checkpoint(tmp_path, _quantised(32), seed=3)
    return tmp_path


def _index(ckpt: Path) -> dict:
    return json.loads((ckpt / "model.safetensors.index.json").read_text())


def test_missing_shard(ckpt: Path) -> None:
    shard = sorted(ckpt.glob("*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError) as e:
        deepinfer_fx.load_model(ckpt, dtype=torch.float32)
    assert shard.name in _one_line(e.value)


def test_missing_tensor(ckpt: Path) -> None:
    index = _index(ckpt)
    del index["weight_map"]["layers.2.attn.compressor.wkv.weight"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as e:
        deepinfer_fx.load_model(ckpt, dtype=torch.float32)
    msg = _one_line(e.value)
    assert "layers.2.attn.compressor.wkv.weight" in msg and str(ckpt) in msg


def test_wrong_shape(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["q_lora_rank"] = 48  # the stored wq_a / wq_b no longer match the config
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError) as e:
        deepinfer_fx.load_model(ckpt, dtype=torch.float32)
    msg = _one_line(e.value)
    assert "layers.0.attn.wq_a.weight" in msg and ".safetensors" in msg and "48" in msg


def test_unknown_model_type(ckpt: Path) -> None:
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError) as e:
        deepinfer_fx.load_model(ckpt, dtype=torch.float32)
    msg = _one_line(e.value)
    assert "model_type" in msg and "config.json" in msg and "llama" in msg


def test_corrupt_index(ckpt: Path) -> None:
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": {"embed.weight": ')
    with pytest.raises(CheckpointError) as e:
        deepinfer_fx.load_model(ckpt, dtype=torch.float32)
    assert "model.safetensors.index.json" in _one_line(e.value)


def test_bad_token_ids(ckpt: Path) -> None:
    model = deepinfer_fx.load_model(ckpt, dtype=torch.float32)
    with pytest.raises(ValueError, match="token ids must lie in"):
        deepinfer_fx.logits(model, [1, 2, model.config.vocab_size])
    with pytest.raises(ValueError, match="at least one token"):
        deepinfer_fx.logits(model, [])
