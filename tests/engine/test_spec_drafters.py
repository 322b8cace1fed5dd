"""Speculative decoding with the model's own drafters (fp32, CPU): MTP-1 (``method: "mtp"``,
tiny V4) and DSpark (``method: "dspark"``, tiny V4.1 with Engram and tiny V4-Flash-0731).
Outputs with a drafter on equal outputs with it off, token for token (greedy and sampled,
chunked prefill, aborts, overlap on and off, compiled; DSpark under V4.1's compact prefill
too, against compact prefill without it); the MTP block's drafts after chunked steps are the
one-shot block's; after a run with rejected drafts the drafter's windows hold exactly the
verified positions and the target's state is a plain run's.

Random weights draft nothing a random target accepts, so most tests use ``drafting``: a target
whose greedy text cycles (``test_spec_decode.cycling``) and a drafter made to predict that cycle
part of the time: the MTP block through its next-token embedding path (a random streams path
pulls it off course), DSpark through its Markov head (against the random base logits)."""

from __future__ import annotations

import random

import pytest
import torch
from test_dspark import v4_dspark, v41_dspark
from test_spec_decode import _run_with_abort, _slot_state, cycling
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.graphs import model as model_fns
from deepinfer_fx.graphs.batch import Batch, Group, make_batch
from deepinfer_fx.graphs.dspark_context import dspark_capture, dspark_context
from deepinfer_fx.graphs.model import forward, forward_batch
from deepinfer_fx.graphs.mtp import mtp_draft, mtp_forward
from deepinfer_fx.graphs.state import init_state
from deepinfer_fx.graphs.yoco import kept_rows

MAX_LEN = 96
KEEP = 12  # compact prefill's smallest KEEP for 3 drafts in the tiny V4.1: window 8 + 3 + 1
COMPACT = {"yoco_mode": "compact", "yoco_keep_tokens": KEEP}
CONFIGS = {"mtp-v4": tiny_v4, "dspark-v41": v41_dspark, "dspark-v4-0731": v4_dspark}


def method(kind: str) -> str:
    return kind.split("-")[0]


def spec(kind: str, k: int = 3) -> dict:
    return {"method": method(kind), "num_speculative_tokens": k}


def _random(kind: str, seed: int = 5):
    return deepinfer_fx.random_model(config_from_dict(CONFIGS[kind]()).replace(fake_quant=False), seed=seed)


def _after(vocab: int) -> torch.Tensor:
    t = torch.arange(vocab)
    return 3 * (t // 3) + (t + 1) % 3  # cycling's next token


def drafting(kind: str):
    """The cycling target with a drafter that drafts its cycle part of the time (the module
    docstring): MTP-1's next-token embedding scaled up against a random streams path of 45 / sqrt(D);
    DSpark's Markov head made to score the cycle's next token at 140 against the base logits."""
    c, params = cycling(_random(kind))
    if method(kind) == "mtp":
        D = c.hidden_size
        mp = {
            **params["mtp"][0],
            "e_proj": torch.eye(D) * 20,
            "h_proj": torch.randn(D, D, generator=torch.Generator().manual_seed(0)) * 45 / D**0.5,
        }
        return deepinfer_fx.api.Model(c, {**params, "mtp": [mp]})
    inverse = torch.empty(c.vocab_size, dtype=torch.long)
    inverse[_after(c.vocab_size)] = torch.arange(c.vocab_size)
    last = dict(params["mtp"][-1])
    E = torch.nn.functional.normalize(
        torch.randn(last["markov_head"]["embed"].shape, generator=torch.Generator().manual_seed(0)), dim=-1
    )
    last["markov_head"] = {"embed": E, "head": E[inverse] * 140}  # row j scores the token whose next is j
    return deepinfer_fx.api.Model(c, {**params, "mtp": params["mtp"][:-1] + [last]})


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def model(kind):
    return drafting(kind)


def make_llm(model, **kw) -> LLM:
    kw.setdefault("max_model_len", MAX_LEN)
    kw.setdefault("num_threads", 1)
    if model.config.is_v41:
        kw.setdefault("yoco_mode", "off")  # exact prefill unless a test asks for compact (COMPACT)
    return LLM(model, device="cpu", eager=kw.pop("eager", True), **kw)


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(2, 30))] for _ in range(n)]


def _params(n: int, seed: int | None = None) -> list[SamplingParams]:
    lengths = [random.Random(seed).randint(4, 20) for _ in range(n)] if seed is not None else [16, 5, 20, 12][:n]
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_outputs_equal_with_rollback(kind, model, overlap: bool) -> None:
    """Mixed requests, prompts chunked under a 16-token budget, one abort mid-run: the tokens
    of plain decoding, with drafts both accepted and rejected."""
    seed = random.SystemRandom().randrange(2**31)
    prompts, params = _prompts(seed, 4), _params(4)
    ref = [o.outputs[0].token_ids for o in make_llm(model, max_num_batched_tokens=16).generate(prompts, params)]
    llm = make_llm(model, overlap=overlap, max_num_batched_tokens=16, speculative_config=spec(kind))
    outs = _run_with_abort(llm, prompts, params, abort_id=2, after=4)
    for i in range(4):
        got = outs[i].outputs[0]
        if i == 2:
            assert got.finish_reason == "abort" and got.token_ids == ref[i][: len(got.token_ids)], f"seed={seed}"
        else:
            assert got.token_ids == ref[i], f"seed={seed} request {i}"
    st = llm.speculator.stats
    assert 0 < st.accepted_tokens < st.draft_tokens, f"seed={seed}: {st}"
    assert sum(o.metrics.num_accepted_tokens for o in outs.values()) == st.accepted_tokens
    assert llm.pool.num_free == llm.pool.slots and llm.pool.free_pages == llm.pool.num_pages


def test_random_drafter_is_lossless(kind) -> None:
    """Random weights: the drafter's drafts are nearly all rejected, and the tokens stay plain decoding's."""
    seed = random.SystemRandom().randrange(2**31)
    model = _random(kind, seed % 1000)
    prompts, params = _prompts(seed, 3), _params(3, seed)
    ref = [o.outputs[0].token_ids for o in make_llm(model, max_num_batched_tokens=16).generate(prompts, params)]
    llm = make_llm(model, max_num_batched_tokens=16, speculative_config=spec(kind, 2))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref, f"seed={seed}"
    assert llm.speculator.stats.verify_steps > 0


def test_sampled_outputs_equal(kind, model) -> None:
    """Greedy drafts against a sampled target: accepted where the target's own sample (same
    seed, same position) equals them, so every token is the one plain sampling gives."""
    seed = random.SystemRandom().randrange(2**31)
    prompts = _prompts(seed, 3)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9 if i % 2 else 1.0, max_tokens=12, ignore_eos=True, seq_seed=seed + i)
        for i in range(3)
    ]
    ref = [o.outputs[0].token_ids for o in make_llm(model).generate(prompts, params)]
    llm = make_llm(model, speculative_config=spec(kind))
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref, f"seed={seed}"
    assert llm.speculator.stats.accepted_tokens > 0, f"seed={seed}"


def test_windows_hold_verified_positions(kind, model) -> None:
    """After a run with rejections the drafter's windows are those of one pass over the final
    text (chained or rejected rows left nothing), and the target's state is a plain run's."""
    seed = random.SystemRandom().randrange(2**31)
    prompt = _prompts(seed, 1)[0] + [7, 8]  # at least two 16-token-budget chunks with the 20-token decode
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = make_llm(model, max_num_seqs=1, max_num_batched_tokens=16)
    ref = plain.generate([prompt], sp)[0].outputs[0].token_ids
    llm = make_llm(model, max_num_seqs=1, max_num_batched_tokens=16, speculative_config=spec(kind))
    assert llm.generate([prompt], sp)[0].outputs[0].token_ids == ref, f"seed={seed}"
    st = llm.speculator.stats
    assert 0 < st.accepted_tokens < st.draft_tokens, f"seed={seed}: {st}"
    text = prompt + ref
    n = len(text) - 1  # positions the model has seen: the last token is sampled, never fed
    a, b = _slot_state(plain, 0, n), _slot_state(llm, 0, n)
    for path in a:
        if not path.startswith(("mtp.", "dspark.")):
            torch.testing.assert_close(b[path], a[path], atol=1e-4, rtol=1e-4, msg=lambda m: f"seed={seed} {path}: {m}")
    c, params = model
    state = init_state(c, MAX_LEN, torch.float32, "cpu")
    W = c.sliding_window
    live = [p % W for p in range(max(0, n - W), n)]
    if method(kind) == "mtp":
        _, X = forward(params, state, c, torch.tensor(text[:n]), 0)
        mtp_forward(params, state, c, X, torch.tensor(text[1:]), 0)
        pairs = [(llm.pool.state["mtp"][0]["window"], state["mtp"][0]["window"])]
    else:
        batch, captured = make_batch([text[:n]], [0], [0]), dspark_capture(c)
        forward_batch(params, state, c, batch, captured=captured)
        dspark_context(params, state, c, captured, batch)
        pairs = [(got["window"], want["window"]) for got, want in zip(llm.pool.state["dspark"], state["dspark"])]
    for got, want in pairs:
        torch.testing.assert_close(got[0, live], want[0, live], atol=1e-4, rtol=1e-4, msg=lambda m: f"seed={seed}: {m}")


def _chunk_inputs(c, ids: list[int], start: int, slot: int, L: int):
    """One chunk's ``Batch`` for the target, padded to ``L`` rows."""
    index = torch.arange(L)[None]
    group = Group(index, torch.tensor([slot]), torch.tensor([start]), torch.tensor([len(ids)]), packed=True)
    tokens = torch.tensor(ids + [0] * (L - len(ids)))
    return Batch(tokens, group.positions.reshape(-1), (group,)), tokens


def test_chunked_mtp_drafts_equal_one_shot() -> None:
    """``mtp_draft`` after two prompt chunks (the first one's last row waits as ``pending``)
    drafts what the one-shot block does over the whole prompt, chained through the same block."""
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    c, params = _random("mtp-v4", seed % 1000)
    prompt = [rng.randrange(3, c.vocab_size) for _ in range(rng.randint(6, 20))]
    sampled = rng.randrange(3, c.vocab_size)  # the token the prompt's last row samples
    k, cut = 4, rng.randint(1, len(prompt) - 1)
    # one shot: the target over the prompt, the block over every position, then the chain
    ref = init_state(c, MAX_LEN, torch.float32, "cpu")
    _, X = forward(params, ref, c, torch.tensor(prompt), 0)
    logits, Y = mtp_forward(params, ref, c, X, torch.tensor(prompt[1:] + [sampled]), 0)
    want, window = [int(logits[-1].argmax())], ref["mtp"][0]["window"][0].clone()  # the verified positions' entries
    y = Y[-1:]
    for j in range(k - 1):
        logits, y = mtp_forward(params, ref, c, y, torch.tensor(want[-1:]), len(prompt) + j)
        want.append(int(logits[-1].argmax()))
    # chunked, as the engine's prefill steps call it (each chunk padded to 24 rows)
    state, L = init_state(c, MAX_LEN, torch.float32, "cpu"), 24
    one = torch.tensor([0])
    for start, ids, samples in ((0, prompt[:cut], False), (cut, prompt[cut:], True)):
        batch, tokens = _chunk_inputs(c, ids, start, 0, L)
        _, X = forward_batch(params, state, c, batch)
        nexts = torch.cat([tokens[1:], tokens[:1]])[None].clone()
        nexts[0, len(ids) - 1] = sampled
        known = torch.tensor([len(ids) - 1 + int(samples)])
        got = mtp_draft(
            params,
            state,
            c,
            X,
            one,
            torch.tensor([start]),
            torch.tensor([len(ids)]),
            tokens[:1],
            nexts,
            known,
            torch.tensor([start > 0]),
            k,
        )
    assert got[0].tolist() == want, f"seed={seed}"
    W = c.sliding_window
    live = [p % W for p in range(max(0, len(prompt) - W), len(prompt))]
    torch.testing.assert_close(
        state["mtp"][0]["window"][0, live], window[live], atol=1e-5, rtol=1e-5, msg=lambda m: f"seed={seed}: {m}"
    )


@pytest.mark.parametrize("compiled_kind", ["mtp-v4", "dspark-v41"])
def test_compiled_drafter_steps(compiled_kind: str) -> None:
    """The steps compiled (aot_eager on the CPU) with the drafter inside them and warmed up:
    plain decoding's tokens, drafts accepted and rejected, and no step of the run (a rollback's
    replay included) compiles after the warm-up. DSpark runs under V4.1's default, compact
    prefill (KEEP 12 of a 25-token prompt in two chunks), against compact prefill without it,
    drafting through the block-FP8 copy of the head (``draft_head``)."""
    model = drafting(compiled_kind)
    prompt, yoco = _prompts(3, 1)[0], {}
    if model.config.is_v41:
        prompt, yoco = (prompt * 25)[:25], COMPACT
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = make_llm(model, max_num_seqs=1, **yoco).generate([prompt], sp)[0].outputs[0].token_ids
    llm = make_llm(
        model,
        eager=False,
        warmup=True,
        max_num_seqs=1,
        max_num_batched_tokens=16,
        speculative_config={**spec(compiled_kind), **({"draft_head": "fp8"} if model.config.is_v41 else {})},
        **yoco,
    )
    warmed = [r["graph"] for r in llm.runner.steps.report()]
    assert llm.generate([prompt], sp)[0].outputs[0].token_ids == ref
    st = llm.speculator.stats
    assert 0 < st.accepted_tokens < st.draft_tokens, st
    names = [r["graph"] for r in llm.runner.steps.report()]
    assert names == warmed, f"compiled after the warm-up: {names[len(warmed) :]}"
    assert any(n.startswith("verify") and n.endswith("-draft3") for n in names), names
    if yoco:
        assert any(n.startswith("prefill") and f"-kept{KEEP}" in n and "-streams" in n for n in names), names


@pytest.fixture(scope="module")
def v41_drafting():
    return drafting("dspark-v41")


def _count_dropped(monkeypatch) -> list[int]:
    """Per compact forward, the prompt rows its decoder left out (``model.kept_rows`` wrapped)."""
    dropped = []

    def counted(batch, replay):
        kept = kept_rows(batch, replay)
        dropped.append(sum(int(g.lens.sum()) for g in batch.groups) - sum(int(g.lens.sum()) for g in kept.batch.groups))
        return kept

    monkeypatch.setattr(model_fns, "kept_rows", counted)
    return dropped


@pytest.mark.parametrize("overlap", [True, False])
def test_compact_prefill_greedy_equal(v41_drafting, overlap: bool, monkeypatch) -> None:
    """V4.1's compact prefill at the smallest KEEP for 3 drafts: DSpark's context comes from the
    kept rows' streams; mixed prompts (some longer than KEEP: rows dropped) chunked under a
    16-token budget give, with the drafter on, compact prefill's own tokens with it off."""
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    lengths = [rng.randint(2, KEEP), rng.randint(KEEP + 1, 40), rng.randint(KEEP + 1, 60), rng.randint(2, 60)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in lengths]
    params = _params(4, seed)
    dropped = _count_dropped(monkeypatch)
    plain = make_llm(v41_drafting, max_num_batched_tokens=16, **COMPACT)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    assert sum(dropped) > 0, f"seed={seed}: compact prefill dropped no row"
    dropped.clear()
    llm = make_llm(
        v41_drafting, overlap=overlap, max_num_batched_tokens=16, speculative_config=spec("dspark"), **COMPACT
    )
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert got == ref, f"seed={seed} lengths={lengths}"
    assert sum(dropped) > 0, f"seed={seed}: compact prefill dropped no row"
    st = llm.speculator.stats
    assert 0 < st.accepted_tokens < st.draft_tokens, f"seed={seed}: {st}"
    assert llm.pool.num_free == llm.pool.slots and llm.pool.free_pages == llm.pool.num_pages


def test_compact_windows_at_the_exact_bound(v41_drafting) -> None:
    """At KEEP 29 (window 8 + 3 later decoder layers x 7) compact prefill is exact, so DSpark's
    windows, written from the kept rows only, are exact prefill's: a prompt of 45+ tokens in
    16-token chunks, whose first chunk keeps no row and whose last window spans chunks."""
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    prompt = [rng.randrange(3, 300) for _ in range(rng.randint(45, 70))]
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)  # the windows of the prompt alone
    windows = []
    for yoco in ({"yoco_mode": "off"}, {"yoco_mode": "compact", "yoco_keep_tokens": 29}):
        llm = make_llm(
            v41_drafting, max_num_seqs=1, max_num_batched_tokens=16, speculative_config=spec("dspark"), **yoco
        )
        llm.generate([prompt], sp)
        windows.append([st["window"][0] for st in llm.pool.state["dspark"]])
    c = v41_drafting.config
    live = [p % c.sliding_window for p in range(len(prompt) - c.sliding_window, len(prompt))]
    for want, got in zip(*windows):
        assert want[live].abs().max() > 0, f"seed={seed}: the window was never written"
        torch.testing.assert_close(got[live], want[live], atol=1e-4, rtol=1e-4, msg=lambda m: f"seed={seed}: {m}")


def test_refusals(tmp_path) -> None:
    model = _random("mtp-v4")
    with pytest.raises(ValueError, match="'mtp' with engine_type='prompt'"):
        make_llm(model, engine_type="prompt", state_dir=tmp_path, speculative_config=spec("mtp-v4"))
