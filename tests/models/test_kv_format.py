"""The state in its trained format (``init_state(..., kv_format="trained")``): window rings,
compressed entries and index keys held as fp8 / fp4 codes and scales. What users rely on:

- each row codec gives back exactly what its fake-quant point produces (bit for bit, fp32 and
  bf16, blocks from 1e-12 to 1e3 and all-zero ones), and its rows have the byte counts the spec
  gives for the released widths (V4: 584 B a window row at bf16; V4.1: 528 B window, 288 B entry,
  68 B index key);
- a model run on a trained-format state gives the logits of the same run on a model-format state,
  bit for bit in fp32 and bf16, whatever the chunking; and every state tensor it wrote holds the values
  the model-format state holds (stored == fake-quantised);
- the indexer scores a trained-format state's index keys where they lie: its places get the packed
  rows and their layout (the CUDA kernel decodes the tiles it reads), eagerly and in the compiled
  graph, and no index key is read through ``fake_quant.read``;
- a model without fake-quant, or an unknown format, is refused in one line.
"""

from __future__ import annotations

import inspect
import random

import pytest
import torch
from released import released_config
from tiny import tiny_v4, tiny_v41

from deepinfer_fx import random_model
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.engine.cache import iter_tensors, state_bytes_per_slot
from deepinfer_fx.engine.steps import decode_logits
from deepinfer_fx.graphs import fake_quant as fq
from deepinfer_fx.graphs.model import forward
from deepinfer_fx.graphs.mtp import mtp_forward
from deepinfer_fx.graphs.state import init_state
from deepinfer_fx.graphs.swap import reference, swapped
from deepinfer_fx.kernels.ops import OPS
from deepinfer_fx.passes.compiler import compile_graph, make_backend

CONFIGS = {"v4": tiny_v4, "v41": tiny_v41}
POINTS = {"window": fq.window_kv, "entry": fq.compressed_entry, "index": fq.index_vector}


def _config(family: str):
    cfg = CONFIGS[family]()
    return config_from_dict(cfg if family == "v4" else {"model_type": "deepseek_v41", "text_config": cfg})


def _spread(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Random rows whose magnitudes span 1e-12 .. 1e3 (subnormal fp8/fp4 scales included), one row zero."""
    x = torch.randn(shape, generator=g) * torch.logspace(-12, 3, shape[-2])[:, None]
    x[..., 0, :] = 0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_rows_give_back_the_fake_quantised_values(family: str, dtype: torch.dtype) -> None:
    c = _config(family)
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    for kind, point in POINTS.items():
        dim = c.index_head_dim if kind == "index" else c.head_dim
        x = _spread((3, 16, dim), dtype, g)
        rows = point(c, x, packed=True)
        assert rows.dtype == torch.uint8 and rows.shape == (3, 16, fq.codec(c, kind).nbytes(dtype))
        assert torch.equal(fq.read(c, kind, rows, dtype), point(c, x)), kind
        if dtype == torch.bfloat16:  # fp32 compressor latents into a bf16 state: the tail rounds to bf16
            x32 = x.float() * 1.001
            assert torch.equal(fq.read(c, kind, point(c, x32, True, dtype), dtype), point(c, x32).to(dtype)), kind
        if kind == "window":  # a ring stores rows its fake-quant point already rounded
            once = point(c, x)
            assert torch.equal(fq.read(c, kind, point(c, once, packed=True), dtype), once)


@pytest.mark.parametrize(
    ("name", "bytes_"),
    [
        ("v4-flash", {"window": 584, "entry": 584, "index": 68}),
        ("v4-pro", {"window": 584, "entry": 584, "index": 68}),
        ("v41-flash", {"window": 528, "entry": 288, "index": 68}),
    ],
)
def test_released_row_bytes(name: str, bytes_: dict) -> None:
    """The spec's bytes per row (§4.1, §8.1) at bf16."""
    c = released_config(name)
    assert {k: fq.codec(c, k).nbytes(torch.bfloat16) for k in fq.KINDS} == bytes_


def _run(model, ids: torch.Tensor, chunks: list[int], kv_format: str) -> tuple[torch.Tensor, dict]:
    """Feed ``ids`` but the last in ``chunks`` (the last id is the MTP block's next token)."""
    c, params = model
    state = init_state(c, ids.numel(), model.dtype, kv_format=kv_format)
    outs, start = [], 0
    with torch.no_grad():
        for n in chunks:
            logits, X = forward(params, state, c, ids[start : start + n], start)
            if params.get("mtp") and not c.dspark_stages:  # its window ring is state too
                mtp_forward(params, state, c, X, ids[start + 1 : start + n + 1], start)
            outs.append(logits)
            start += n
    return torch.cat(outs), state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_trained_state_gives_the_model_format_logits(family: str, dtype: torch.dtype) -> None:
    """bf16 too: the compressors pool in fp32, and a bf16 state rounds what they store (V4's
    rotary tail) to bf16 either way."""
    seed = random.randrange(1 << 30)
    model = random_model(CONFIGS[family](), seed=seed, dtype=dtype)
    c = model.config
    assert c.fake_quant
    rng = random.Random(seed)
    T = 37
    ids = torch.randint(0, c.vocab_size, (T + 1,), generator=torch.Generator().manual_seed(seed))
    chunks = []
    while sum(chunks) < T:
        chunks.append(min(rng.randint(1, 9), T - sum(chunks)))
    for split in ([1] * T, chunks, [T]):  # the same split both ways: another split rounds otherwise
        want, plain = _run(model, ids, split, "model")
        got, held = _run(model, ids, split, "trained")
        assert torch.equal(got, want), f"seed {seed}, chunks {split}"
    values = {p: t[:-1] for p, t in iter_tensors(plain)}  # the last slot is scratch: written, never read
    packed = {p: t[:-1] for p, t in iter_tensors(held)}
    kinds = {"window": "window", "entries": "entry", "index_keys": "index"}
    checked = 0
    for path, t in packed.items():
        kind = kinds.get(path.rsplit(".", 1)[-1])
        if kind is None:
            assert torch.equal(t, values[path]), path  # compressor rings, Engram history: as before
            continue
        if path.startswith("layers.") and ".index." in path:
            kind = "index"  # V4's indexer compressor holds index keys as its entries
        assert fq.is_packed(t), path
        assert torch.equal(fq.read(c, kind, t, dtype), values[path]), f"seed {seed}: {path}"
        checked += 1
    assert checked >= c.num_hidden_layers


SCORING = ("indexer.score_topk", "indexer.index_scores")


@pytest.mark.parametrize(
    "family, quirk", [("v4", False), ("v41", False), ("v41", True)], ids=["v4", "v41", "v41-index-key-quirk"]
)
def test_index_keys_are_scored_where_they_lie(family: str, quirk: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With a trained-format state every call of the scoring places (V4's ``select_entries``,
    V4.1's selections, the index-key quirk's gathered keys too) gets the uint8 rows and the index
    layout's spec, the pool read by slot where it is the pool, and the logits stay the model
    format's; no index key goes through ``fake_quant.read`` (the whole-pool unpack it replaced).
    A compiled decode step (aot_eager, the cpu pipeline's kernel swaps): its indexer ops read the
    packed rows."""
    seed = random.randrange(1 << 30)
    model = random_model(CONFIGS[family](), seed=seed)
    model.config = c = model.config.replace(index_key_quirk=quirk)
    spec = fq.codec(c, "index").spec
    T = 13
    ids = torch.randint(0, c.vocab_size, (T + 1,), generator=torch.Generator().manual_seed(seed))
    calls: list[tuple[str, torch.dtype, int, bool, str | None]] = []

    def spy(place: str):
        ref = reference(place)
        sig = inspect.signature(ref)

        def call(*args, **kwargs):
            a = sig.bind(*args, **kwargs)
            a.apply_defaults()
            keys = a.arguments["keys"]
            calls.append((place, keys.dtype, keys.shape[-1], a.arguments["slots"] is not None, a.arguments["key_rows"]))
            return ref(*args, **kwargs)

        return call

    read = fq.read

    def no_index_read(cfg, kind, t, dtype):
        assert kind != "index", "index keys unpacked before scoring"
        return read(cfg, kind, t, dtype)

    monkeypatch.setattr(fq, "read", no_index_read)
    split = [4] + [1] * (T - 4)  # token by token after a prefill: the quirk's open groups
    with swapped({place: spy(place) for place in SCORING}):
        got, _ = _run(model, ids, split, "trained")
    want, _ = _run(model, ids, split, "model")
    assert torch.equal(got, want), f"seed {seed}"
    row = (torch.uint8, fq.codec(c, "index").nbytes(model.dtype))
    assert calls and all(call[1:3] == row and call[4] == spec for call in calls), f"seed {seed}: {calls}"
    assert any(call[3] for call in calls), f"seed {seed}: the pool is read by slot"
    if quirk:
        assert any(not call[3] for call in calls), f"seed {seed}: the quirk's gathered keys"

    torch._dynamo.reset()
    be = make_backend("cpu")
    state = init_state(c, T, model.dtype, mtp=False, kv_format="trained")
    step = compile_graph(lambda *a: decode_logits(model.params, state, c, *a), be)
    with torch.no_grad(), swapped(be.pipeline.swaps()), torch._functorch.config.patch(enable_autograd_cache=False):
        step(ids[:2], *torch.tensor([[0], [T - 1], [1]]))  # a decode step at the last position
    torch._dynamo.reset()
    ops = (OPS["indexer_topk"], OPS["indexer_scores"])
    nodes = [n for gm in be.graphs for n in gm.graph.nodes if n.op == "call_function" and n.target in ops]
    assert nodes, "no indexer op in the compiled graph"
    for n in nodes:
        args = dict(zip((a.name for a in n.target._schema.arguments), n.args)) | n.kwargs
        assert args["keys"].meta["val"].dtype == torch.uint8 and args.get("key_rows") == spec, n.format_node()


def test_trained_state_bytes_per_token() -> None:
    """The growing part of a V4.1-Flash slot drops to the spec's 890 B a token (720 entries + 170 keys)."""
    c = released_config("v41-flash")
    trained = state_bytes_per_slot(c, 4096, torch.bfloat16, mtp=False, kv_format="trained")
    model = state_bytes_per_slot(c, 4096, torch.bfloat16, mtp=False)
    assert trained["per_token"] == 890
    assert model["per_token"] / trained["per_token"] > 3.5


def test_refusals() -> None:
    c = _config("v4")
    with pytest.raises(ValueError, match="fake_quant off"):
        init_state(c.replace(fake_quant=False), 16, kv_format="trained")
    with pytest.raises(ValueError, match="kv_format='fp8' is not one of"):
        init_state(c, 16, kv_format="fp8")
