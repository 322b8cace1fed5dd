"""Engram tables placed for compiled steps (``engine/engram_tables.py``): on the device or in host
memory, read through ``deepinfer::engram_rows``. A tiny V4.1 checkpoint's steps (chunked prefill,
then decode) agree token for token: eager (memory-mapped tables) == eager on placed tables (bit
for bit) and compiled (aot_eager) with host tables == with device tables (bit for bit) == eager;
the budget and the modes refuse as documented; the released V4.1-Flash widths (Engram tables of
384M fp8 rows) trace compiled with host tables on fake tensors."""

from __future__ import annotations

import json
import random

import pytest
import torch
from tiny import tiny_v41
from torch._subclasses.fake_tensor import FakeTensorMode

import deepinfer_fx
from deepinfer_fx.api import Model
from deepinfer_fx.config import config_from_dict, released_config
from deepinfer_fx.engine import engram_tables
from deepinfer_fx.engine.graph_runner import StepGraphs
from deepinfer_fx.engine.step_arena import GREEDY, PrefillChunk
from deepinfer_fx.graphs.engram import EngramTable
from deepinfer_fx.graphs.param_spec import build_tree
from deepinfer_fx.graphs.params import param_specs
from deepinfer_fx.graphs.state import init_state

pytestmark = pytest.mark.usefixtures("fresh_compile")
ROLES = dict(  # three layers: window, KV source (ratio 2), decoder (ratio 1); Engram on 0 and 2
    num_hidden_layers=3,
    compress_ratios=[0, 2, 1],
    kv_source_layer_ids=[1, 2],
    index_source_layer_ids=[1, 2],
    candidate_source_layer_id=2,
    engram_layer_ids=[0, 2],
)


@pytest.fixture
def fresh_compile():
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    seed = random.SystemRandom().randrange(2**31)
    cfg = tiny_v41(**ROLES)
    del cfg["engram_compressed_vocab_size"], cfg["engram_num_embeddings"]  # the writer derives them
    path = tmp_path_factory.mktemp("v41") / "ckpt"
    deepinfer_fx.write_random_checkpoint(path, cfg, seed=seed)
    return path, seed


def _load(path) -> Model:
    return deepinfer_fx.load_model(path, dtype=torch.float32, fake_quant=False)


def _steps(model: Model, **kw) -> StepGraphs:
    state = init_state(model.config, 64, torch.float32, mtp=False, slots=3)
    return StepGraphs(model, state, torch.zeros(4, dtype=torch.long), max_requests=4, max_tokens=16, **kw)


def _generate(steps: StepGraphs, seed: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Three prompts prefilled in two chunks each, then three greedy decode steps: every step's
    logits of the real rows and the tokens it wrote."""
    rng = random.Random(seed)
    vocab = steps.config.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randint(6, 20))] for _ in range(3)]
    cut = [rng.randint(max(1, len(p) - 16), min(16, len(p) - 1)) for p in prompts]  # chunks fit the 16-row bucket
    logits, tokens = [], []
    with torch.no_grad():
        steps.step((), [PrefillChunk(s, 0, p[:k]) for s, (p, k) in enumerate(zip(prompts, cut))], "greedy")
        out = steps.step(
            (), [PrefillChunk(s, k, p[k:], GREEDY) for s, (p, k) in enumerate(zip(prompts, cut))], "greedy"
        )
        logits.append(out[1].logits[:3].clone())
        tokens.append(steps.next_token[:3].tolist())
        pos = [len(p) for p in prompts]
        for _ in range(3):
            logits.append(steps.decode([0, 1, 2], pos).logits[:3].clone())
            tokens.append(steps.next_token[:3].tolist())
            pos = [p + 1 for p in pos]
    return logits, tokens


def test_host_tables_equal_device_tables_and_eager(checkpoint, tmp_path, monkeypatch) -> None:
    path, seed = checkpoint
    monkeypatch.setattr(engram_tables, "_COPY_ROWS", 97)  # placing copies the memory map in several slices
    eager = _generate(_steps(_load(path), compile=False), seed)
    model = _load(path)
    placed = engram_tables.place_engram_tables(model.params, torch.device("cpu"), "host")
    assert [p.where for p in placed] == ["host", "host"], f"seed={seed}"
    again = _generate(_steps(model, compile=False), seed)
    assert again[1] == eager[1] and all(map(torch.equal, again[0], eager[0])), f"seed={seed}: placed tables differ"
    runs = {}
    for mode in ("device", "host"):
        steps = _steps(_load(path), inductor=False, engram_tables=mode, dump_dir=tmp_path / mode)
        assert [p.where for p in steps.engram] == [mode, mode], f"seed={seed}"
        runs[mode] = _generate(steps, seed)
        graphs = [(tmp_path / mode / r["model_graph"] / "01-aten.py").read_text() for r in steps.report()]
        assert all(("deepinfer.engram_rows" in g) == (mode == "host") for g in graphs), f"seed={seed} {mode}"
        # no host tensor constant: on a GPU aot_eager copies one in at every call, which CUDA-graph
        # capture refuses (Engram's hash constants and V4.1's first collapse did, found on an H100)
        assert not any("lift_fresh_copy" in g for g in graphs), f"{mode}: a compiled step lifts a host constant"
    assert runs["host"][1] == runs["device"][1] == eager[1], f"seed={seed}: tokens differ"
    for h, d, e in zip(runs["host"][0], runs["device"][0], eager[0]):
        assert torch.equal(h, d), f"seed={seed}: host and device tables give other logits"
        # compiled (aot_eager) against eager: the ulps of the decomposed ops, not Engram's rows
        torch.testing.assert_close(h, e, rtol=0, atol=3e-6 * e.abs().max().item(), msg=lambda m: f"seed={seed}: {m}")


def test_budget_and_modes(checkpoint, monkeypatch) -> None:
    path, seed = checkpoint
    cpu = torch.device("cpu")
    model = _load(path)
    sizes = [lp["engram"]["embed"].nbytes for lp in model.params["layers"] if "engram" in lp]
    first = sizes[0]
    where = [p.where for p in engram_tables.place_engram_tables(_load(path).params, cpu, "auto", first)]
    assert where == ["device", "host"], f"seed={seed} sizes={sizes}"
    assert [p.where for p in engram_tables.place_engram_tables(_load(path).params, cpu, "auto", 10)] == ["host"] * 2
    with pytest.raises(
        ValueError, match=rf"layers\.0\.engram\.embed\.weight .*takes 0\.00 GiB .*budget .*is 0\.00 GiB"
    ):
        engram_tables.place_engram_tables(_load(path).params, cpu, "device", first - 1)
    monkeypatch.setattr(engram_tables, "host_available", lambda: max(sizes) - 1)
    with pytest.raises(ValueError, match=r"fit neither the device nor the host: layers\.2\.engram\.embed takes"):
        engram_tables.place_engram_tables(_load(path).params, cpu, "auto", 0)
    with pytest.raises(ValueError, match=r"engram_tables='disk' is invalid: expected auto, device or host"):
        engram_tables.place_engram_tables(model.params, cpu, "disk")
    # StepGraphs reads the settings when given no arguments
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", "auto")
    monkeypatch.setenv("DEEPINFER_ENGRAM_DEVICE_GIB", "0")
    monkeypatch.setattr(engram_tables, "host_available", lambda: 1 << 40)
    steps = _steps(_load(path))
    assert [p.where for p in steps.engram] == ["host", "host"] and "engram.gather_rows" in steps.over
    monkeypatch.setenv("DEEPINFER_ENGRAM_TABLES", "elsewhere")
    with pytest.raises(ValueError, match="DEEPINFER_ENGRAM_TABLES='elsewhere' is invalid"):
        _steps(_load(path))


def test_released_v41_flash_widths_trace_with_host_tables(tmp_path) -> None:
    """Compiled decode and prefill at the released widths, with the released tables (384,006,168
    and 384,016,682 rows of 256 fp8 bytes) in host memory, on fake tensors (a CPU build cannot
    make fake CUDA views, so the fake device is the CPU: the same graphs, the op reading the host
    table as a graph input). The layer stack is cut to three layers of every role."""
    d = json.loads(released_config("deepseek_v41_flash").read_text())
    d["text_config"].update(ROLES, compress_ratios=[0, 2, 1, 0, 0, 0], dspark_target_layer_ids=[0, 1, 2])
    c = config_from_dict(d)
    assert c.engram_num_embeddings == (384006168, 384016682) and c.engram_head_dim == 256
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True):
        flat = {}
        for s in param_specs(c, mtp=False):
            if s.quant == "engram":
                rows, hd = s.shape
                w, scale = (
                    torch.empty(s.shape, dtype=torch.float8_e4m3fn),
                    torch.empty(rows, hd // 32, dtype=torch.uint8),
                )
                flat[s.path] = EngramTable.from_tensor(w, s.path, scale)
            else:
                flat[s.path] = torch.empty(s.shape, dtype=s.dtype(torch.bfloat16))
        flat["engram_vocab"] = torch.empty(c.vocab_size, dtype=torch.long)
        state = init_state(c, 4096, torch.bfloat16, mtp=False, slots=4)
        model = Model(c, build_tree(flat))
        steps = StepGraphs(
            model,
            state,
            torch.zeros(5, dtype=torch.long),
            max_requests=4,
            max_tokens=64,
            inductor=False,
            engram_tables="host",
            dump_dir=str(tmp_path),
        )
        assert sum(p.nbytes for p in steps.engram) == 202758032400
        assert steps.decode([0, 1, 2, 3], [70, 80, 90, 100]).logits.shape == (4, c.vocab_size)
        assert steps.prefill([(0, 0, [3] * 64)])[0].logits.shape == (1, c.vocab_size)
    for graph in ("decode-t4-r4", "prefill-t64-r1"):
        aten = (tmp_path / graph / "01-aten.py").read_text()
        assert aten.count("torch.ops.deepinfer.engram_rows.default(") == 2, graph
