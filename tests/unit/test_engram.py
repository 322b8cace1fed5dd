"""deepinfer_fx.graphs.engram: memory-mapped table lookups (fp8 + ue8m0 and unquantised) against a
plain dequantisation, CheckpointReader.raw offsets, and engram_apply against a per-token,
per-stream loop written out here."""

from __future__ import annotations

import math
import pathlib
import random

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from deepinfer_fx.graphs.engram import EngramTable, engram_apply
from deepinfer_fx.io.checkpoint import CheckpointError
from deepinfer_fx.io.checkpoint_reader import CheckpointReader

W_KEY = "layers.1.engram.embed.weight"
S_KEY = "layers.1.engram.embed.scale"
ROWS, HD = 1000, 64


def fresh_seed() -> int:
    # A new seed every run (printed in failure messages) so repeated runs cover more inputs.
    seed = random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed)
    return seed


def quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 with one power-of-two scale per 32 channels, written independently of quant.py."""
    blocks = x.view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1).clamp_min(1e-30)
    e = torch.ceil(torch.log2(amax / 448.0)).to(torch.int32)
    # log2 may land a hair off; nudge so that amax / 2^e <= 448 always holds.
    e = torch.where(amax / torch.exp2(e.float()) > 448.0, e + 1, e)
    w8 = (blocks / torch.exp2(e.float()).unsqueeze(-1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return w8.view(x.shape), (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)


def plain_dequant(w8: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    exps = s.view(torch.uint8).to(torch.float64) - 127
    vals = w8.to(torch.float64).view(w8.shape[0], -1, 32) * torch.pow(2.0, exps).unsqueeze(-1)
    return vals.view(w8.shape).to(torch.float32)


def write_ckpt(path: pathlib.Path, tensors: dict[str, torch.Tensor]) -> CheckpointReader:
    # Unrelated tensors first (larger dtypes sort earlier in safetensors), so the table does not
    # start at data offset 0 and a wrong offset would be caught.
    filler = {
        "layers.0.attn_norm.weight": torch.randn(37),
        "embed.weight": torch.randn(11, 5).to(torch.bfloat16),
        "aaa.filler": torch.randint(0, 255, (123,), dtype=torch.uint8),
    }
    path.mkdir(parents=True, exist_ok=True)
    save_file({**filler, **tensors}, str(path / "model-00001-of-00001.safetensors"))
    return CheckpointReader(path)


def random_rows(rows: int = ROWS, hd: int = HD) -> torch.Tensor:
    # Spread magnitudes over many binades so the per-block scales really differ.
    return torch.randn(rows, hd) * torch.exp2(torch.randint(-20, 20, (rows, hd // 32)).float()).repeat_interleave(32, 1)


def assert_memmap_only(table: EngramTable, rows: int, hd: int) -> None:
    held = list(vars(table).values())
    assert any(isinstance(v, np.memmap) for v in held), f"no numpy.memmap held by {table!r}"
    big = [v for v in held if isinstance(v, torch.Tensor) and v.numel() >= rows * hd // 32]
    assert not big, f"{table!r} holds torch tensors of table size: {[tuple(v.shape) for v in big]}"
    for v in held:
        if isinstance(v, np.memmap):
            assert v.mode == "r", f"memmap opened with mode {v.mode}"


def test_raw_points_at_the_stored_bytes(tmp_path: pathlib.Path) -> None:
    seed = fresh_seed()
    w8, s = quant_rows(random_rows(64))
    reader = write_ckpt(tmp_path, {W_KEY: w8, S_KEY: s})
    for key, t in ((W_KEY, w8), (S_KEY, s), ("layers.0.attn_norm.weight", None)):
        raw = reader.raw(key)
        data = t if t is not None else reader.get(key)
        nbytes = data.numel() * data.element_size()
        assert raw.offset > 8 and raw.shape == tuple(data.shape), f"seed={seed} {key}: {raw}"
        with open(raw.path, "rb") as fh:
            fh.seek(raw.offset)
            on_disk = fh.read(nbytes)
        assert on_disk == data.contiguous().view(torch.uint8).numpy().tobytes(), f"seed={seed} {key}"
    assert reader.raw(W_KEY).dtype == "F8_E4M3" and reader.raw(S_KEY).dtype == "F8_E8M0"
    assert reader.raw(W_KEY).offset > reader.raw("layers.0.attn_norm.weight").offset  # non-zero data offset
    with pytest.raises(CheckpointError, match="layers.1.engram.embed.nope"):
        reader.raw("layers.1.engram.embed.nope")


def test_fp8_table_lookup_matches_plain_dequant(tmp_path: pathlib.Path) -> None:
    seed = fresh_seed()
    w8, s = quant_rows(random_rows())
    reader = write_ckpt(tmp_path, {W_KEY: w8, S_KEY: s, "layers.1.engram.q_weight": torch.randn(4, 8)})
    table = EngramTable.from_checkpoint(reader, W_KEY, S_KEY)
    assert (table.num_rows, table.head_dim) == (ROWS, HD)
    assert_memmap_only(table, ROWS, HD)
    ids = torch.randint(0, ROWS, (7, 3, 5))
    ids[0, 0, 0], ids[-1, -1, -1] = 0, ROWS - 1  # both ends of the table
    got = table.lookup(ids)
    want = plain_dequant(w8, s)[ids]
    assert got.dtype == torch.float32 and got.shape == (7, 3, 5, HD) and got.device == ids.device
    assert torch.equal(got, want), f"seed={seed}: max err {(got - want).abs().max()}"
    assert_memmap_only(table, ROWS, HD)  # a lookup must not have cached the table
    # Same rows through the dense backing.
    assert torch.equal(EngramTable.from_tensor(plain_dequant(w8, s)).lookup(ids), got), f"seed={seed}"
    assert table.lookup(torch.zeros(0, 4, dtype=torch.long)).shape == (0, 4, HD)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_unquantised_table(tmp_path: pathlib.Path, dtype: torch.dtype) -> None:
    seed = fresh_seed()
    rows = torch.randn(ROWS, HD).to(dtype)
    reader = write_ckpt(tmp_path, {W_KEY: rows})
    table = EngramTable.from_checkpoint(reader, W_KEY)
    assert_memmap_only(table, ROWS, HD)
    ids = torch.randint(0, ROWS, (13, 24))
    assert torch.equal(table.lookup(ids), rows[ids].float()), f"seed={seed} dtype={dtype}"
    with pytest.raises(CheckpointError, match="unquantised"):
        EngramTable.from_checkpoint(reader, W_KEY, "layers.0.attn_norm.weight")


def test_fp8_table_needs_matching_scale(tmp_path: pathlib.Path) -> None:
    fresh_seed()
    w8, s = quant_rows(random_rows())
    reader = write_ckpt(tmp_path, {W_KEY: w8, S_KEY: s[:, :1].contiguous()})
    with pytest.raises(CheckpointError, match="scale"):
        EngramTable.from_checkpoint(reader, W_KEY, S_KEY)
    with pytest.raises(CheckpointError, match="scale"):
        EngramTable.from_checkpoint(reader, W_KEY)


@pytest.mark.parametrize("bad", [-1, ROWS])
def test_out_of_range_ids(tmp_path: pathlib.Path, bad: int) -> None:
    fresh_seed()
    w8, s = quant_rows(random_rows())
    reader = write_ckpt(tmp_path, {W_KEY: w8, S_KEY: s})
    ids = torch.tensor([[0, 5], [bad, 3]])
    for table in (EngramTable.from_checkpoint(reader, W_KEY, S_KEY), EngramTable.from_tensor(torch.zeros(ROWS, HD))):
        with pytest.raises(ValueError, match=rf"\[0, {ROWS}\)") as err:
            table.lookup(ids)
        assert "engram" in str(err.value), str(err.value)


def loop_reference(
    p: dict, X: torch.Tensor, hash_ids: torch.Tensor, eps: float, token_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """Spec §7.7 written one token and one stream at a time."""
    n, hc, d = X.shape
    out = X.clone()
    wkv = p["wkv"].to(X.dtype)
    for t in range(n):
        row = p["embed"].lookup(hash_ids[t]).reshape(-1).to(X.dtype)
        kv = (wkv @ row).float()
        value = kv[hc * d :]
        for k in range(hc):
            key = kv[k * d : (k + 1) * d]
            x = X[t, k].float()
            w = p["q_weight"][k].float() * p["k_weight"][k].float()
            r = 1 / math.sqrt(float((x * x).mean()) + eps) / math.sqrt(float((key * key).mean()) + eps)
            dot = float((x * w * key).sum()) * r / math.sqrt(d)
            g = 1 / (1 + math.exp(-math.copysign(math.sqrt(max(abs(dot), 1e-6)), dot))) if dot != 0 else 0.5
            if token_mask is not None and not bool(token_mask[t]):
                g = 0.0
            out[t, k] = (x + g * value).to(X.dtype)
    return out


def random_params(hc: int, d: int, n_cols: int, hd: int, rows: int) -> dict:
    return {
        "embed": EngramTable.from_tensor(torch.randn(rows, hd)),
        "wkv": torch.randn((hc + 1) * d, n_cols * hd) / math.sqrt(n_cols * hd),
        "q_weight": (1 + 0.3 * torch.randn(hc, d)).to(torch.bfloat16),
        "k_weight": (1 + 0.3 * torch.randn(hc, d)).to(torch.bfloat16),
    }


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_engram_apply_matches_loop(dtype: torch.dtype, tol: float) -> None:
    seed = fresh_seed()
    hc, d, n_cols, hd, rows, n = 4, 48, 6, 32, 300, 9
    p = random_params(hc, d, n_cols, hd, rows)
    X = (torch.randn(n, hc, d) * 3).to(dtype)
    ids = torch.randint(0, rows, (n, n_cols))
    got = engram_apply(p, X, ids, 1e-6)
    want = loop_reference(p, X, ids, 1e-6)
    assert got.dtype == dtype and got.shape == X.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * max(1.0, want.float().abs().max().item()), f"seed={seed} dtype={dtype}: max err {err}"
    assert not torch.equal(got, X), f"seed={seed}: engram changed nothing"


def test_engram_apply_token_mask() -> None:
    seed = fresh_seed()
    hc, d, n_cols, hd, rows, n = 2, 32, 4, 32, 100, 6
    p = random_params(hc, d, n_cols, hd, rows)
    X = torch.randn(n, hc, d).to(torch.bfloat16)
    ids = torch.randint(0, rows, (n, n_cols))
    mask = torch.tensor([True, False, True, False, False, True])
    got = engram_apply(p, X, ids, 1e-6, token_mask=mask)
    assert torch.equal(got[~mask], X[~mask]), f"seed={seed}: masked tokens changed"
    assert torch.equal(got[mask], engram_apply(p, X[mask], ids[mask], 1e-6)), f"seed={seed}"
    want = loop_reference(p, X, ids, 1e-6, mask)
    assert (got.float() - want.float()).abs().max() <= 3e-2 * want.float().abs().max(), f"seed={seed}"


def test_engram_apply_over_checkpoint_table(tmp_path: pathlib.Path) -> None:
    seed = fresh_seed()
    hc, d, n_cols, hd, n = 4, 32, 3, 64, 5
    w8, s = quant_rows(random_rows(ROWS, hd))
    reader = write_ckpt(tmp_path, {W_KEY: w8, S_KEY: s})
    p = random_params(hc, d, n_cols, hd, ROWS)
    p["embed"] = EngramTable.from_checkpoint(reader, W_KEY, S_KEY)
    dense = dict(p, embed=EngramTable.from_tensor(plain_dequant(w8, s)))
    X = torch.randn(n, hc, d)
    ids = torch.randint(0, ROWS, (n, n_cols))
    assert torch.equal(engram_apply(p, X, ids, 1e-6), engram_apply(dense, X, ids, 1e-6)), f"seed={seed}"
    with pytest.raises(ValueError, match="wkv"):
        engram_apply(p, X, ids[:, :2], 1e-6)
