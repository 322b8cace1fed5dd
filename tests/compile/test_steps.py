"""Compiled engine steps == the same step functions run eagerly (tiny V4 and V4.1, fp32; CPU, and
on CUDA with captured graphs replayed).

Each check runs two rounds of prefill of several padded chunks, then decode steps with a padded request
bucket, on two copies of one state: the eager twin on one, ``StepGraphs`` on the other. Logits
and every state tensor (the real slots) must agree. Compiling costs ~10 s per graph here, so
each model compiles one prefill and one decode bucket."""

from __future__ import annotations

import copy
import json
import random

import pytest
import torch
from tiny import FP8_EXPERTS, tiny_v4, tiny_v41

from deepinfer_fx.api import random_model
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.engine.graph_runner import StepGraphs
from deepinfer_fx.engine.steps import decode_logits, prefill_logits
from deepinfer_fx.graphs import attention
from deepinfer_fx.graphs.model import cached_engram_layout
from deepinfer_fx.graphs.state import init_state

pytestmark = pytest.mark.usefixtures("fresh_compile")


def _real_slots(state: dict, n: int):
    """(path, tensor) of every state tensor restricted to the first n slots (not the scratch)."""

    def walk(tree, prefix):
        for k, v in tree.items():
            if isinstance(v, dict):
                yield from walk(v, f"{prefix}{k}.")
            elif isinstance(v, list):
                for i, x in enumerate(v):
                    yield from walk(x, f"{prefix}{k}.{i}.")
            elif isinstance(v, torch.Tensor):
                yield prefix + k, v[:n]

    return list(walk(state, ""))


def _run(
    cfg: dict, seed: int, tmp_path, inductor: bool = False, disabled=(), device: str = "cpu", graphs: bool | None = None
):
    """Prefill in two rounds (each prompt cut in two chunks, the second round replays the first
    round's bucket), then decode steps; the prefill returns every row's logits on CPU and only
    the last rows where graphs are captured (prompt-logprob prefills are not captured).
    Returns the steps, each slot's next position and the logits of every step."""
    rng = random.Random(seed)
    # fake-quant off: its rounding steps turn ulp-level differences into visible ones (see the
    # state-equivalence tests); here the paths must agree to fp32 precision. Block-FP8 experts
    # are held as stored, as a CUDA load does.
    c = config_from_dict(cfg).replace(fake_quant=False)
    model = random_model(c.replace(held_experts="fp8" if c.expert_dtype == "fp8" else None), seed=seed, device=device)
    c, params = model
    slots = 3
    state = init_state(c, 64, torch.float32, device=device, mtp=False, slots=slots)
    eager_state = copy.deepcopy(state)
    next_token = torch.zeros(slots + 1, dtype=torch.long, device=device)
    steps = StepGraphs(
        model,
        state,
        next_token,
        max_requests=4,
        max_tokens=16,
        inductor=inductor,
        dump_dir=tmp_path / "dump",
        disabled=disabled,
        graphs=graphs,
    )
    all_rows = not steps.graphs
    pos = [0] * slots
    outs = []
    with torch.no_grad():
        for _ in range(2):
            lens = [rng.randint(5, 16) for _ in range(slots)]
            prompts = [[rng.randrange(3, c.vocab_size) for _ in range(n)] for n in lens]
            got, first = steps.prefill([(s, pos[s], p) for s, p in enumerate(prompts)], all_rows=all_rows)
            got = got.logits
            outs.append(got.clone())
            # the eager twin on the same padded layout: bucket of 4 chunks x 16 rows
            ids = torch.zeros(4, 16, dtype=torch.long)
            for s, p in enumerate(prompts):
                ids[s, : len(p)] = torch.tensor(p)
            meta = torch.tensor([[0, 1, 2, slots], [*pos, 0], [*lens, 0]])
            rows = torch.arange(64) if all_rows else torch.arange(4) * 16 + (meta[2] - 1).clamp(min=0)
            want = prefill_logits(params, eager_state, c, ids.reshape(-1).to(device), *meta.to(device), rows.to(device))
            for s, n in enumerate(lens):
                if all_rows:
                    torch.testing.assert_close(
                        got[first[s] : first[s] + n], want[s * 16 : s * 16 + n], rtol=1e-5, atol=1e-5
                    )
                else:
                    torch.testing.assert_close(got[first[s]], want[s], rtol=1e-5, atol=1e-5)
            pos = [p + n for p, n in zip(pos, lens)]
        for _ in range(3):
            next_token[:slots] = torch.tensor([rng.randrange(3, c.vocab_size) for _ in range(slots)])
            fed = next_token.clone()  # the step writes its greedy samples back to next_token
            out = steps.decode([0, 1, 2], pos)
            got = out.logits[:slots]
            outs.append(got.clone())
            meta = torch.tensor([[0, 1, 2, slots], [*pos, 0], [1, 1, 1, 0]], device=device)
            want = decode_logits(params, eager_state, c, fed, *meta)[:slots]
            assert torch.equal(out.tokens[:slots], got[:slots].argmax(-1)) and torch.equal(
                next_token[:slots], out.tokens[:slots]
            )
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            pos = [p + 1 for p in pos]
    # On CUDA the fused kernels sum in another order than eager's: one compressor entry in 6144
    # came 1.3e-5 off (H200, fp32); the logits still agree to 1e-5.
    tol = 1e-5 if device == "cpu" else 3e-5
    for (path, a), (_, b) in zip(_real_slots(state, slots), _real_slots(eager_state, slots)):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"state {path}: {m}")
    return steps, pos, outs


@pytest.mark.parametrize("which", ["v4", "v41"])
def test_compiled_prefill_and_decode_equal_eager(which: str, tmp_path, monkeypatch) -> None:
    seed = random.SystemRandom().randrange(2**31)
    monkeypatch.setattr(attention, "RING_MIN_CHUNKS", 1)  # this bucket of 4 decodes in place
    cfg = tiny_v4() if which == "v4" else tiny_v41()
    graphs, _, _ = _run(cfg, seed, tmp_path)
    report = {r["graph"]: r for r in graphs.report()}
    assert set(report) == {"prefill-t64-r4-all-greedy", "decode-t4-r4-greedy"}, f"seed={seed}"
    # V4 selects with the whole indexer op; V4.1 takes the scores op and selects in two levels
    indexer = {"v4": ("indexer_topk_kernel",), "v41": ("indexer_scores_kernel", "topk_mask_kernel")}
    for r in report.values():  # the fusion passes fired in both graphs, and every kernel swap
        # decode attention reads the window ring and the entry pools in place; prefill gathers
        attn, gathered = ("ring_mqa_kernel", "sparse_mqa_kernel")[:: 1 if r["graph"].startswith("decode") else -1]
        for name in (
            "rms_norm_fusion",
            "moe_shared_fused_kernel",
            "mhc_site_kernel",
            attn,
            "compressor_kernel",
            "norm_rope_kernel",
            "route_topk_kernel",
            *indexer[which],
        ):
            assert r["rewrites"].get(name, 0) > 0, (name, r["graph"])
        assert r["rewrites"].get(gathered, 0) == 0, (gathered, r["graph"])
        # one pair of rope tables a forward for each kind of attention layer (window-only, compressed)
        assert r["rewrites"].get("rope_table_op", 0) == len({ratio != 0 for ratio in cfg["compress_ratios"]}), r[
            "graph"
        ]
        # V4 ends with a learned hc_head, V4.1 collapses with the last site's pre
        assert (r["rewrites"].get("mhc_head_kernel", 0) > 0) == (which == "v4"), r["graph"]
        # the routed experts and the shared expert's SwiGLU are inside the fused MoE op
        assert r["rewrites"].get("moe_experts_kernel", 0) == 0 and r["rewrites"].get("swiglu_clamp_fusion", 0) == 0, r[
            "graph"
        ]
        for other in indexer["v41" if which == "v4" else "v4"]:  # replaced whole (V4) or never called (V4.1)
            assert r["rewrites"].get(other, 0) == 0, (other, r["graph"])
    index = json.loads((tmp_path / "dump" / "index.json").read_text())
    assert {"prefill-t64-r4-all", "decode-t4-r4"} <= set(json.dumps(index).split('"')), (
        "every graph is in the dump index"
    )


def test_disabled_pass_leaves_no_rewrite_and_same_result(tmp_path) -> None:
    seed = random.SystemRandom().randrange(2**31)
    # with the whole-site swap off, the site's Sinkhorn is traced and its own swap fills it; with
    # the fused MoE op off, the shared expert's SwiGLU is traced and fused
    disabled = (
        "rms_norm_fusion",
        "moe_experts_kernel",
        "moe_shared_fused_kernel",
        "indexer_topk_kernel",
        "mhc_site_kernel",
    )
    graphs, _, _ = _run(tiny_v4(), seed, tmp_path, disabled=disabled)
    for r in graphs.report():
        for off in disabled:  # a disabled swap traces the reference
            assert r["rewrites"].get(off, 0) == 0, f"seed={seed} {off}"
        assert r["rewrites"].get("swiglu_clamp_fusion", 0) > 0 and r["rewrites"].get("mhc_sinkhorn_kernel", 0) > 0
        # the top-k's reference scores through the scores place, which its own swap still fills
        assert r["rewrites"].get("indexer_scores_kernel", 0) > 0, f"seed={seed}"


def test_fp8_experts_compiled_equal_eager(tmp_path) -> None:
    """Routed experts held in fp8: the fused MoE swap falls back, the routed swap puts
    ``moe_experts_fp8`` in both graphs, and they equal the eager twin, which dequantises the
    experts on every call."""
    seed = random.SystemRandom().randrange(2**31)
    graphs, _, _ = _run(tiny_v4(num_hidden_layers=2, compress_ratios=[0, 4], **FP8_EXPERTS), seed, tmp_path)
    for r in graphs.report():
        assert r["rewrites"].get("moe_experts_kernel", 0) > 0, f"seed={seed} {r['graph']}"
        assert r["rewrites"].get("moe_shared_fused_kernel", 0) == 0, f"seed={seed} {r['graph']}"
        final = sorted((tmp_path / "dump" / r["model_graph"]).glob("*.py"))[-1].read_text()
        assert "deepinfer.moe_experts_fp8" in final and "deepinfer.moe_experts." not in final, (
            f"seed={seed} {r['graph']}"
        )


def test_inductor_steps_equal_eager(tmp_path) -> None:
    seed = random.SystemRandom().randrange(2**31)
    cfg = tiny_v4(num_hidden_layers=2, compress_ratios=[0, 4])
    _run(cfg, seed, tmp_path, inductor=True)


def test_decode_step_is_one_graph_without_host_syncs() -> None:
    """A host sync (``.item()``, ``.tolist()``, a data-dependent shape) would break the graph;
    the decode step must trace as exactly one graph with no break."""
    model = random_model(tiny_v41(), seed=5)  # fake-quant on: its ops must trace too
    c, params = model
    state = init_state(c, 64, torch.float32, mtp=False, slots=2)
    nt = torch.zeros(3, dtype=torch.long)
    meta = [torch.tensor(v) for v in ([0, 2], [7, 0], [1, 0])]
    cached_engram_layout(c)  # built with numpy before tracing, as StepGraphs does

    def step(params, state, nt, slots, starts, lens):
        return decode_logits(params, state, c, nt, slots, starts, lens)

    explained = torch._dynamo.explain(step)(params, state, nt, *meta)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons

    def with_sync(params, state, nt, slots, starts, lens):  # the check notices a sync
        return step(params, state, nt, slots, starts + int(lens.sum().item() * 0), lens)

    assert torch._dynamo.explain(with_sync)(params, state, nt, *meta).graph_break_count > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("ring", [False, True], ids=["gathered", "ring"])
@pytest.mark.parametrize("which", ["v4", "v41"])
def test_captured_prefill_and_decode_replay_equal_eager_on_cuda(which: str, ring: bool, tmp_path, monkeypatch) -> None:
    """Both kinds of step are captured after their compiling run and replayed from then on;
    a replay (new slots, positions and tokens in the static buffers) equals the eager twin.
    ``ring``: the decode bucket of 4 reads its keys in place (the Triton ``ring_mqa``)."""
    seed = random.SystemRandom().randrange(2**31)
    monkeypatch.setattr(attention, "RING_MIN_CHUNKS", 1 if ring else 10**9)
    steps, pos, _ = _run(
        tiny_v4() if which == "v4" else tiny_v41(), seed, tmp_path, inductor=True, device="cuda", graphs=True
    )
    report = {r["graph"]: r for r in steps.report()}
    assert set(report) == {"prefill-t64-r4-greedy", "decode-t4-r4-greedy"}, f"seed={seed}"
    for r in report.values():
        assert r["captured"] and r["calls"] >= 2, f"seed={seed} {r}"
    # A mixed step replays the decode graph, then the prefill graph (captured first), and only
    # then reads the decode logits: the prefill replay must not have written over them.
    decoded = steps.decode([0, 1, 2], pos).logits[:3]
    want = decoded.clone()
    steps.prefill([(s, p + 1, [5, 6, 7]) for s, p in enumerate(pos)])
    assert torch.equal(decoded, want), f"seed={seed}: the prefill replay overwrote the decode logits"


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9, reason="PDL needs sm_90+"
)
def test_pdl_on_and_off_replay_the_same_bits_on_cuda(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Programmatic dependent launch only moves when kernels start (``kernels/triton/pdl.py``,
    ``passes/inductor_pdl.py``): captured steps with it (our kernels and Inductor's) and without
    it must give the same bits; a kernel that read before its wait would show here as a
    difference."""
    from deepinfer_fx.kernels import launch_options
    from deepinfer_fx.passes import inductor_pdl

    seed = random.SystemRandom().randrange(2**31)
    outs = {}
    try:
        for on in (True, False):
            launch_options.use_pdl(on)  # what LLM does with its DEEPINFER_PDL: our launchers and the backend read it
            _, _, outs[on] = _run(tiny_v4(), seed, tmp_path / f"pdl-{on}", inductor=True, device="cuda", graphs=True)
            if on:
                assert inductor_pdl.installed()
    finally:
        launch_options.use_pdl(True)
    assert len(outs[True]) == len(outs[False]) == 5
    for i, (a, b) in enumerate(zip(outs[True], outs[False])):
        assert torch.equal(a, b), f"seed={seed}: step {i} differs with PDL"
