"""Damaged checkpoints fail at load with one line naming the file and the tensor, instead of
running: NaN/inf in a weight (checked per tensor, after dequantisation, and in fp8 experts held
as stored), hash-routing tables outside [0, n_experts), random bytes over a shard's data, and a
tokenizer.json that is not UTF-8 or not JSON."""

from __future__ import annotations

import json
import random
import re
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny import FP8_EXPERTS, tiny_v4

import deepinfer_fx
from deepinfer_fx import LLM
from deepinfer_fx.io.checkpoint import CheckpointError

FIX = "the shard is damaged or the weights are broken: re-download it"


@pytest.fixture(scope="module")
def sound(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sound")
    deepinfer_fx.write_random_checkpoint(path, tiny_v4(), seed=5)
    return path


@pytest.fixture(scope="module")
def sound_fp8(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sound-fp8")
    deepinfer_fx.write_random_checkpoint(path, tiny_v4(**FP8_EXPERTS), seed=5)
    return path


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit(ckpt: Path, key: str, change) -> str:
    """Rewrite stored tensor ``key`` as ``change(tensor)``; returns its shard's file name."""
    shard = ckpt / json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(shard)
    tensors[key] = change(tensors[key].clone())
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return shard.name


def _load(ckpt: Path, **kw) -> None:
    deepinfer_fx.load_model(ckpt, dtype=torch.float32, fake_quant=False, **kw)


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def _set(index, value):
    def change(t: torch.Tensor) -> torch.Tensor:
        t[index] = value
        return t

    return change


@pytest.mark.parametrize(
    "key, value",
    [
        ("norm.weight", float("nan")),
        ("layers.2.attn.wq_a.weight", float("inf")),
        ("layers.1.ffn.experts.5.w2.weight", float("-inf")),
    ],
)
def test_non_finite_weight(sound, tmp_path, key, value) -> None:
    ckpt = _copy(sound, tmp_path / "ckpt")
    shard = _edit(ckpt, key, _set((0,) if key == "norm.weight" else (1, 2), value))
    with pytest.raises(CheckpointError) as err:
        LLM(ckpt, dtype="float32", device="cpu", fake_quant=False, max_model_len=64)
    assert _one_line(err) == f"{shard}:{key}: tensor '{key}' holds 1 non-finite value(s) (NaN or inf); {FIX}"


def test_non_finite_after_dequantisation(sound_fp8, tmp_path) -> None:
    """A NaN block scale (ue8m0 0xFF) turns a whole fp8 block into NaN once dequantised."""
    ckpt = _copy(sound_fp8, tmp_path / "ckpt")
    key = "layers.1.attn.wq_a"
    shard = _edit(
        ckpt, f"{key}.scale", lambda s: s.view(torch.uint8).index_fill_(0, torch.tensor([0]), 0xFF).view(s.dtype)
    )
    with pytest.raises(
        CheckpointError,
        match=rf"^{shard}:{key}.weight: tensor '{key}.weight' holds \d+ non-finite value\(s\) "
        rf"\(NaN or inf\) after dequantisation; {FIX}$",
    ):
        _load(ckpt)


def _shard_of(ckpt: Path, key: str) -> str:
    return json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"][key]


@pytest.mark.parametrize("what", ["weight", "scale"])
def test_non_finite_in_fp8_experts(sound_fp8, tmp_path, what) -> None:
    """Held as stored (expert_format="fp8"): the e4m3fn NaN code in a weight, or a ue8m0 NaN in its
    scales, named as such; dequantised on load: the NaN it makes."""
    ckpt = _copy(sound_fp8, tmp_path / "ckpt")
    key = "layers.3.ffn.experts.6.w3"
    nan = 0x7F if what == "weight" else 0xFF  # e4m3fn's NaN; ue8m0's NaN
    _edit(ckpt, f"{key}.{what}", lambda t: t.view(torch.uint8).index_fill_(1, torch.tensor([1]), nan).view(t.dtype))
    where = f"{_shard_of(ckpt, f'{key}.weight')}:{key}.weight"
    named, count = ("tensor", r"\d+") if what == "weight" else ("the block scales of tensor", "1")
    with pytest.raises(
        CheckpointError,
        match=rf"^{where}: {named} '{key}.weight' holds {count} non-finite value\(s\) \(NaN or inf\); {FIX}$",
    ):
        _load(ckpt, expert_format="fp8")
    with pytest.raises(
        CheckpointError,
        match=rf"^{where}: tensor '{key}.weight' holds \d+ non-finite value\(s\) \(NaN or inf\) after dequantisation",
    ):
        _load(ckpt, expert_format="dequant")


@pytest.mark.parametrize("value", [8, -1, 2**40])
def test_hash_routing_table_out_of_range(sound, tmp_path, value) -> None:
    ckpt = _copy(sound, tmp_path / "ckpt")
    key = "layers.0.ffn.gate.tid2eid"
    shard = _edit(ckpt, key, _set((7, 1), value))
    lo, hi = min(value, 0), max(value, 7)
    with pytest.raises(CheckpointError) as err:
        _load(ckpt)
    assert (
        _one_line(err)
        == f"{shard}:{key}: tensor '{key}' holds 1 index value(s) outside [0, 8) (range [{lo}, {hi}]); {FIX}"
    )


def test_random_bytes_over_the_shard_data(sound, tmp_path) -> None:
    """The header intact, every data byte random: the first tensor read is named (before: an index
    out of bounds deep in graphs/moe.py)."""
    ckpt = _copy(sound, tmp_path / "ckpt")
    rng = random.Random(0)
    for shard in sorted(ckpt.glob("*.safetensors")):
        raw = bytearray(shard.read_bytes())
        start = 8 + struct.unpack("<Q", raw[:8])[0]
        raw[start:] = rng.randbytes(len(raw) - start)
        shard.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError) as err:
        LLM(ckpt, dtype="float32", device="cpu", fake_quant=False, max_model_len=64)
    msg = _one_line(err)
    assert re.fullmatch(
        rf"model-0000[12]-of-00002\.safetensors:(\S+): tensor '\1' holds \d+ (non-finite|index) value\(s\).*; {FIX}",
        msg,
    ), msg


@pytest.mark.parametrize(
    "content, why",
    [
        (b'\xff\xfe{"version"', "stream did not contain valid UTF-8"),
        (b'{"version": "1.0", "truncation": null', "EOF while parsing"),
    ],
)
def test_unreadable_tokenizer(sound, tmp_path, content, why) -> None:
    ckpt = _copy(sound, tmp_path / "ckpt")
    (ckpt / "tokenizer.json").write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        LLM(ckpt, dtype="float32", device="cpu", fake_quant=False, max_model_len=64)
    msg = _one_line(err)
    assert msg.startswith(f"{ckpt / 'tokenizer.json'}: not a readable tokenizer (") and why in msg, msg
    assert msg.endswith("re-download it or copy the checkpoint's tokenizer.json")
