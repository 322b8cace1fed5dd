"""Dry runs (``sharding/dryrun.py``, ``generate --dry-run``): one rank traced in this process on
the fake process group, with abstract weights of the released V4-Flash and V4.1-Flash configs cut
to a few layers of every kind (exact shapes and bytes): ep8, and the issue's ``--mesh ep64``
command. Every MoE layer must show one set of EP all-to-alls with the bytes its static capacity
implies."""

from __future__ import annotations

import json
import re

import pytest
import torch

from deepinfer_fx import generate
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.config import released_config
from deepinfer_fx.sharding.dryrun import DEFAULT_CONFIG, NOT_REAL, RAGGED_PREFILL, dry_run, summary
from deepinfer_fx.sharding.mesh import parse_mesh

pytestmark = pytest.mark.usefixtures("fresh_dynamo")


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _trimmed(name: str) -> dict:
    """The released config with its layer stack cut to a few layers of every kind."""
    d = json.loads(released_config(name).read_text())
    if name == "deepseek_v4_flash":  # window, window, CSA, HCA (3 hashed-routing layers)
        d.update(num_hidden_layers=4, compress_ratios=[0, 0, 4, 128, 0])
    else:  # V4.1 roles: KV/index sources 2 and 4 (candidate source), reuse, reindex; Engram on 1 and 3
        d["text_config"].update(
            num_hidden_layers=8,
            compress_ratios=[0, 0, 2, 2, 1, 1, 1, 1, 0, 0, 0],
            kv_source_layer_ids=[2, 4],
            index_source_layer_ids=[2, 4, 6],
            candidate_source_layer_id=4,
            engram_layer_ids=[1, 3],
            dspark_target_layer_ids=[5, 6, 7],
        )
    return d


def test_v41_flash_ep8_one_all_to_all_set_per_moe_layer(tmp_path) -> None:
    c = config_from_dict(_trimmed("deepseek_v41_flash"))
    run = dry_run(c, parse_mesh("ep8"), 5, tmp_path, decode_requests=4, prefill_tokens=64)
    assert run.placement.n_physical == 416 and run.placement.slots_per_rank == 52  # 384 + 32 extra on ep8
    k, d = c.num_experts_per_tok, c.hidden_size
    for graph, tokens in (("decode-t4-r4", 4), ("prefill-t64-r1", 64)):
        for stage in ("00-captured.py", "01-aten.py"):
            assert (tmp_path / graph / stage).is_file(), f"{graph}/{stage} missing"
        assert "_c10d_functional.all_to_all_single" in (tmp_path / graph / "01-aten.py").read_text()
        assert run.moe_calls[graph] == c.num_hidden_layers
        items = run.graphs[graph]
        assert sorted({x.layer for x in items}) == list(range(c.num_hidden_layers)), (
            "a collective outside the MoE region"
        )
        rows = 8 * tokens * k  # ep destinations x worst-case capacity (every pair to one rank)
        want = [((rows, d), torch.bfloat16), ((rows, 2), torch.int32), ((rows, d), torch.float32)]
        for layer in range(c.num_hidden_layers):
            got = [x for x in items if x.layer == layer]
            assert [(x.kind, x.group_size) for x in got] == [("all_to_all_single", 8)] * 3, (graph, layer)
            assert [(x.shape, x.dtype) for x in got] == want, (graph, layer)
            assert [x.nbytes for x in got] == [rows * d * 2, rows * 8, rows * d * 4]
    text = summary(run)
    assert text.count("  layer ") == 2 * c.num_hidden_layers and text.endswith(NOT_REAL)
    assert RAGGED_PREFILL in text  # the engine's prefill sends less than the traced static capacity
    # the rank's parameters, as DTensors on the world mesh: experts split over ep, the rest whole
    n, i, e = c.num_hidden_layers, c.moe_intermediate_size, 416
    assert f"  layers.*.ffn.experts.w1 x{n}: (dp:R, cp:R, ep:S(0)) global [{e}, {i}, {d}] local [52, {i}, {d}]" in text
    assert f"  layers.*.ffn.shared_experts.w1 x{n}: (dp:R, cp:R, ep:R) global [{i}, {d}] local [{i}, {d}]" in text
    assert f"  embed: (dp:R, cp:R, ep:R) global [{c.vocab_size}, {d}]" in text
    assert "  layers.*.engram.embed x2: not a DTensor (EngramTable, replicated)" in text
    rows = text[text.index("parameter placements") :].splitlines()[1:-1]
    assert all("ep:S(0)" in r for r in rows if ".experts." in r) and all(
        "ep:R" in r or "not a DTensor" in r for r in rows if ".experts." not in r
    )


def test_cli_v4_flash_ep8(tmp_path, capsys) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(_trimmed("deepseek_v4_flash")))
    dump = tmp_path / "graphs"
    assert (
        generate.main(["--mesh", "ep8", "--dry-run", "--rank", "3", "--dump-graphs", str(dump), "--model", str(model)])
        == 0
    )
    out = capsys.readouterr().out
    assert (
        "mesh ep8 (world 8), rank 3 = {'dp': 0, 'cp': 0, 'ep': 3}" in out
        and "256 logical -> 288 physical, 36 slots" in out
    )
    for graph in ("decode-t4-r4", "prefill-t64-r1"):
        assert f"{graph}: 12 collectives in 4 MoE layers" in out
        assert (dump / graph / "01-aten.py").is_file()
    layers = [line for line in out.splitlines() if line.startswith("  layer ")]
    assert len(layers) == 8 and all(len(re.findall(r"all_to_all_single over 8 ranks", line)) == 3 for line in layers)
    assert NOT_REAL in out and (dump / "collectives.txt").read_text().strip().endswith(NOT_REAL)


def test_cli_v41_flash_ep64(tmp_path, capsys) -> None:
    """The issue's ``--mesh ep64`` command on V4.1-Flash cut to a few layers of every role (the
    whole 43-layer stack traces the same layers ~10 min here)."""
    model = tmp_path / "model"
    model.mkdir()
    c = config_from_dict(_trimmed("deepseek_v41_flash"))
    (model / "config.json").write_text(json.dumps(_trimmed("deepseek_v41_flash")))
    dump = tmp_path / "graphs"
    argv = ["--mesh", "ep64", "--dry-run", "--rank", "37", "--dump-graphs", str(dump), "--model", str(model)]
    assert generate.main(argv) == 0
    out = capsys.readouterr().out
    assert "mesh ep64 (world 64), rank 37 = {'dp': 0, 'cp': 0, 'ep': 37}" in out
    n = c.num_hidden_layers
    for graph in ("decode-t4-r4", "prefill-t64-r1"):
        assert f"{graph}: {3 * n} collectives in {n} MoE layers" in out
        assert (dump / graph / "01-aten.py").is_file()
    layers = [line for line in out.splitlines() if line.startswith("  layer ")]
    assert len(layers) == 2 * n and all(
        len(re.findall(r"all_to_all_single over 64 ranks", line)) == 3 for line in layers
    )
    assert NOT_REAL in out


def test_cli_defaults_to_the_packaged_v41_config(capsys) -> None:
    """Without ``--model`` the dry run reads the packaged V4.1-Flash config; a rank outside the
    mesh is refused before anything is traced."""
    assert generate.main(["--mesh", "ep64", "--dry-run", "--rank", "64"]) == 2
    captured = capsys.readouterr()
    assert f"using the packaged V4.1-Flash config ({DEFAULT_CONFIG.name})" in captured.out
    assert "error:" in captured.err and "64" in captured.err
