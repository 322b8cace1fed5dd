"""CheckpointReader: naming schemes, dequantisation, validation errors, model-dir resolution."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from safetensors.torch import save_file

from deepinfer_fx.io.checkpoint import CheckpointError, resolve_model_dir
from deepinfer_fx.io.checkpoint_reader import CheckpointReader
from deepinfer_fx.io.tensor_names import canonical_name

E, I, D, V = 8, 32, 64, 256
COMPRESS = [0, 4, 128, 4]  # sliding, CSA (indexer), HCA, CSA
HASH_LAYERS = 1

# DeepSeek suffix -> HF module attribute path, per layer.  Written out by hand as an
# independent oracle for the reader's rename table.
LAYER_COMMON = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    **{f"hc_{b}_{p}": f"{b}_hc.{p}" for b in ("attn", "ffn") for p in ("fn", "base", "scale")},
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
LAYER_COMPRESSED = {
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
}
LAYER_INDEXER = {
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
}
TOP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    **{f"hc_head_{p}": f"model.hc_head.hc_{p}" for p in ("fn", "base", "scale")},
}


def expected_map() -> dict[str, str]:
    """Canonical key -> HF state_dict key (experts map to 'fused:<hf key>:<e>:<part>')."""
    out = dict(TOP)
    for layer, ratio in enumerate(COMPRESS):
        per = dict(LAYER_COMMON)
        if ratio:
            per |= LAYER_COMPRESSED
        if ratio == 4:
            per |= LAYER_INDEXER
        if layer < HASH_LAYERS:
            per["ffn.gate.tid2eid"] = "mlp.gate.tid2eid"
        else:
            per["ffn.gate.bias"] = "mlp.gate.e_score_correction_bias"
        for k, v in per.items():
            out[f"layers.{layer}.{k}"] = f"model.layers.{layer}.{v}"
        for e in range(E):
            fused = f"model.layers.{layer}.mlp.experts"
            out[f"layers.{layer}.ffn.experts.{e}.w1.weight"] = f"fused:{fused}.gate_up_proj:{e}:0"
            out[f"layers.{layer}.ffn.experts.{e}.w3.weight"] = f"fused:{fused}.gate_up_proj:{e}:1"
            out[f"layers.{layer}.ffn.experts.{e}.w2.weight"] = f"fused:{fused}.down_proj:{e}:-"
    return out


def hf_value(sd: dict[str, torch.Tensor], ref: str) -> torch.Tensor:
    if not ref.startswith("fused:"):
        return sd[ref]
    _, name, e, part = ref.split(":")
    t = sd[name][int(e)]
    return t if part == "-" else t[int(part) * I : (int(part) + 1) * I]


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], pathlib.Path, pathlib.Path]:
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(1234)
    cfg = DeepseekV4Config(
        vocab_size=V,
        hidden_size=D,
        moe_intermediate_size=I,
        num_hidden_layers=len(COMPRESS),
        num_attention_heads=4,
        head_dim=64,
        q_lora_rank=32,
        qk_rope_head_dim=16,
        o_groups=2,
        o_lora_rank=16,
        n_routed_experts=E,
        num_experts_per_tok=2,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=4,
        sliding_window=16,
        compress_ratios=COMPRESS,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        num_hash_layers=HASH_LAYERS,
    )
    m = DeepseekV4ForCausalLM(cfg).float()
    with torch.no_grad():  # distinct random values everywhere so a wrong mapping cannot match by accident
        for p in m.parameters():
            p.copy_(torch.randn_like(p))
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, E, b.shape))
    root = tmp_path_factory.mktemp("hf")
    d_new, d_orig = root / "new", root / "orig"
    m.save_pretrained(d_new, save_original_format=False)
    m.save_pretrained(d_orig, save_original_format=True)
    sd = {k: v.detach().clone() for k, v in m.state_dict().items()}
    return sd, d_new, d_orig


def test_hf_formats_map_to_deepseek_names(hf_dirs: tuple) -> None:
    sd, d_new, d_orig = hf_dirs
    expected = expected_map()
    r_new, r_orig = CheckpointReader(d_new), CheckpointReader(d_orig)
    assert r_new.keys() == r_orig.keys() == sorted(expected)
    for key, ref in expected.items():
        want = hf_value(sd, ref)
        for r in (r_new, r_orig):
            got = r.get(key)
            assert r.shape(key) == tuple(want.shape), (key, r.location(key))
            if key.endswith("tid2eid"):
                assert got.dtype == torch.int64
                assert torch.equal(got, want.to(torch.int64)), key
            else:
                assert got.dtype == torch.float32
                assert torch.equal(got, want), (key, r.location(key))
    # The brief's example, spelled out against the live module layout.
    assert torch.equal(
        r_new.get("layers.1.ffn.experts.3.w3.weight"), sd["model.layers.1.mlp.experts.gate_up_proj"][3, I:]
    )
    assert (
        r_new.location("layers.1.ffn.experts.3.w3.weight")
        == f"model.safetensors:model.layers.1.mlp.experts.gate_up_proj[3, {I}:{2 * I}]"
    )
    assert r_orig.location("layers.0.attn.kv_norm.weight") == "model.safetensors:model.layers.0.attn.norm.weight"
    assert r_new.get("layers.2.attn.wq_a.weight", torch.bfloat16).dtype == torch.bfloat16


def test_canonical_names_are_fixed_points() -> None:
    for key in expected_map():
        assert canonical_name(key) == key
    for key in (
        "mtp.0.e_proj.weight",
        "mtp.0.norm.weight",
        "mtp.0.hc_head_fn",
        "mtp.0.attn.kv_norm.weight",
        "layers.3.attn.wq_a.scale",
        "layers.3.ffn.experts.7.w2.scale",
    ):
        assert canonical_name(key) == key


# ---- hand-written DeepSeek-named sharded checkpoint ----------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def make_fp8(g: torch.Generator, n: int, k: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(e4m3 weight, ue8m0 scale, expected float32) built independently of quant.py."""
    w8 = (torch.randn(n, k, generator=g) * 50).clamp(-448, 448).to(torch.float8_e4m3fn)
    nb, kb = -(-n // block), -(-k // block)
    exp_bytes = torch.randint(120, 134, (nb, kb), generator=g, dtype=torch.int32)
    scale = exp_bytes.to(torch.uint8).view(torch.float8_e8m0fnu)
    factor = torch.exp2((exp_bytes - 127).float()).repeat_interleave(block, 0).repeat_interleave(block, 1)
    return w8, scale, w8.float() * factor[:n, :k]


def make_mxfp4(g: torch.Generator, n: int, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    codes = torch.randint(0, 16, (n, k), generator=g)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).view(torch.int8)  # low nibble = even k
    exp_bytes = torch.randint(122, 132, (n, k // 32), generator=g, dtype=torch.int32)
    scale = exp_bytes.to(torch.uint8).view(torch.float8_e8m0fnu)
    want = E2M1[codes] * torch.exp2((exp_bytes - 127).float()).repeat_interleave(32, 1)
    return packed, scale, want


@pytest.fixture()
def ds_dir(tmp_path: pathlib.Path) -> tuple[pathlib.Path, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    wq_a, wq_a_s, wq_a_want = make_fp8(g, 40, 72, 32)  # ragged: scale [2, 3], block must be inferred as 32
    wkv, wkv_s, wkv_want = make_fp8(g, 256, 128, 128)
    w1, w1_s, w1_want = make_mxfp4(g, 8, 64)
    tid2eid = torch.randint(0, 8, (16, 2), generator=g, dtype=torch.int32)
    norm = torch.randn(64, generator=g).to(torch.bfloat16)
    shard1 = {
        "embed.weight": torch.randn(16, 64, generator=g),
        "layers.0.attn.wq_a.weight": wq_a,
        "layers.0.attn.wq_a.scale": wq_a_s,
        "layers.0.ffn.experts.0.w1.weight": w1,
        "layers.0.attn.wkv.weight": wkv,
        "layers.0.attn.wkv.weight_scale_inv": wkv_s,
    }
    shard2 = {
        "layers.0.ffn.experts.0.w1.scale": w1_s,  # scale in a different shard from its weight
        "layers.0.ffn.gate.tid2eid": tid2eid,
        "norm.weight": norm,
    }
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    weight_map = {}
    for name, tensors in zip(names, (shard1, shard2)):
        save_file(tensors, str(tmp_path / name))
        weight_map |= {k: name for k in tensors}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    want = {
        "embed.weight": shard1["embed.weight"],
        "layers.0.attn.wq_a.weight": wq_a_want,
        "layers.0.attn.wkv.weight": wkv_want,
        "layers.0.ffn.experts.0.w1.weight": w1_want,
        "layers.0.ffn.gate.tid2eid": tid2eid.long(),
        "norm.weight": norm.float(),
    }
    return tmp_path, want


def test_deepseek_sharded_fp8_and_mxfp4(ds_dir: tuple) -> None:
    d, want = ds_dir
    r = CheckpointReader(d)
    assert r.keys() == sorted(want)
    assert "layers.0.attn.wq_a.scale" not in r
    assert r.shape("layers.0.ffn.experts.0.w1.weight") == (8, 64)  # logical, not packed [8, 32]
    assert r.shape("layers.0.attn.wq_a.weight") == (40, 72)
    for key, w in want.items():
        got = r.get(key)
        assert got.dtype == (torch.int64 if key.endswith("tid2eid") else torch.float32)
        assert torch.equal(got, w), key
    assert r.location("layers.0.ffn.gate.tid2eid") == "model-00002-of-00002.safetensors:layers.0.ffn.gate.tid2eid"
    assert torch.equal(
        CheckpointReader(d, fp8_block=32).get("layers.0.attn.wq_a.weight"), want["layers.0.attn.wq_a.weight"]
    )
    with pytest.raises(CheckpointError, match=r"wq_a.*fp8_block=64 is wrong"):
        CheckpointReader(d, fp8_block=64).get("layers.0.attn.wq_a.weight")


def one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_corrupt_index(ds_dir: tuple) -> None:
    d, _ = ds_dir
    (d / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(CheckpointError) as exc:
        CheckpointReader(d)
    assert "model.safetensors.index.json" in one_line(exc)
    (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(CheckpointError, match="weight_map") as exc:
        CheckpointReader(d)
    assert "model.safetensors.index.json" in one_line(exc)


def test_missing_shard(ds_dir: tuple) -> None:
    d, _ = ds_dir
    (d / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError) as exc:
        CheckpointReader(d)
    msg = one_line(exc)
    assert "model-00002-of-00002.safetensors" in msg and "missing" in msg
    assert any(t in msg for t in ("layers.0.ffn.experts.0.w1.scale", "layers.0.ffn.gate.tid2eid", "norm.weight"))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "empty"])
def test_bad_shard(ds_dir: tuple, damage: str) -> None:
    d, _ = ds_dir
    shard = d / "model-00001-of-00002.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(
        {"garbage": b"\x93NUMPY garbage bytes" * 50, "truncated": data[: len(data) - 100], "empty": b""}[damage]
    )
    with pytest.raises(CheckpointError) as exc:
        CheckpointReader(d)
    msg = one_line(exc)
    assert "model-00001-of-00002.safetensors" in msg and "not a valid safetensors" in msg


def test_index_names_tensor_absent_from_shard(ds_dir: tuple) -> None:
    d, _ = ds_dir
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["layers.9.attn.wq_a.weight"] = "model-00001-of-00002.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"model-00001-of-00002\.safetensors.*layers\.9\.attn\.wq_a\.weight"):
        CheckpointReader(d)


def test_missing_key_and_empty_dir(ds_dir: tuple, tmp_path_factory: pytest.TempPathFactory) -> None:
    d, _ = ds_dir
    r = CheckpointReader(d)
    for call in (r.get, r.shape, r.location):
        with pytest.raises(CheckpointError) as exc:
            call("layers.0.attn.wq_b.weight")
        msg = one_line(exc)
        assert "layers.0.attn.wq_b.weight" in msg and str(d) in msg
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(CheckpointError) as exc:
        CheckpointReader(empty)
    assert str(empty) in one_line(exc)


# ---- resolve_model_dir ----------------------------------------------------------------


def test_resolve_local_and_env(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model_dir(tmp_path) == tmp_path.resolve()
    assert resolve_model_dir(str(tmp_path)) == tmp_path.resolve()
    with pytest.raises(CheckpointError, match="no such directory") as exc:
        resolve_model_dir(str(tmp_path / "nope"))
    assert str(tmp_path / "nope") in one_line(exc)
    with pytest.raises(CheckpointError, match="no such directory"):
        resolve_model_dir("./definitely/not/here")
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path))
    assert resolve_model_dir(None) == tmp_path.resolve()
    monkeypatch.setenv("DEEPINFER_HF_MODEL_DIR", str(tmp_path / "gone"))
    with pytest.raises(CheckpointError, match="no such directory.*"):
        resolve_model_dir(None)
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR")
    with pytest.raises(CheckpointError, match="DEEPINFER_HF_MODEL_DIR"):
        resolve_model_dir(None)


def test_resolve_hub_offline(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv("DEEPINFER_HF_MODEL_DIR", raising=False)
    with pytest.raises(CheckpointError) as exc:
        resolve_model_dir("deepinfer-test-org/no-such-model-xyz")
    msg = one_line(exc)
    assert "deepinfer-test-org/no-such-model-xyz" in msg and "DEEPINFER_HF_MODEL_DIR" in msg and "offline" in msg
