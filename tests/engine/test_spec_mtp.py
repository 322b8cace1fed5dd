"""Speculative decoding with the MTP-1 drafter (``method: "mtp"``, tiny V4, fp32, CPU): outputs
with it on equal outputs with it off, token for token (greedy and sampled, chunked prefill,
aborts, overlap on and off, compiled); its drafts after chunked steps are the one-shot block's;
after a run with rejected drafts the block's window holds exactly the verified positions and
the target's state is a plain run's.

Random weights draft nothing a random target accepts, so most tests use ``drafting``: a target
whose greedy text cycles (``test_spec_decode.cycling``) and an MTP block whose embedding path
predicts that cycle while a random streams path pulls it off course often enough to reject."""

from __future__ import annotations

import random

import pytest
import torch
from test_spec_decode import _run_with_abort, _slot_state, cycling
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.graphs.batch import Batch, Group
from deepinfer_fx.graphs.model import forward
from deepinfer_fx.graphs.mtp import mtp_draft, mtp_forward
from deepinfer_fx.graphs.state import init_state

MAX_LEN = 96
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def _random_v4(seed: int = 5):
    return deepinfer_fx.random_model(config_from_dict(tiny_v4()).replace(fake_quant=False), seed=seed)


def drafting(noise: float = 45.0):
    """The cycling target with an MTP block that drafts its cycle: the next token's embedding,
    scaled up, carries the block's prediction (the cycle's token after it); the streams path,
    random at ``noise``, decides how often it wins instead."""
    c, params = cycling(_random_v4())
    D = c.hidden_size
    mp = {**params["mtp"][0], "e_proj": torch.eye(D) * 20,
          "h_proj": torch.randn(D, D, generator=torch.Generator().manual_seed(0)) * noise / D**0.5}
    return deepinfer_fx.api.Model(c, {**params, "mtp": [mp]})


@pytest.fixture(scope="module")
def model():
    return drafting()


def make_llm(model, **kw) -> LLM:
    kw.setdefault("max_model_len", MAX_LEN)
    kw.setdefault("num_threads", 1)
    return LLM(model, device="cpu", eager=kw.pop("eager", True), **kw)


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(2, 30))] for _ in range(n)]


def _params(n: int, seed: int | None = None) -> list[SamplingParams]:
    lengths = [random.Random(seed).randint(4, 20) for _ in range(n)] if seed is not None else [16, 5, 20, 12][:n]
    return [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in lengths]


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_outputs_equal_with_rollback(model, overlap: bool) -> None:
    """Mixed requests, prompts chunked under a 16-token budget, one abort mid-run: the tokens
    of plain decoding, with drafts both accepted and rejected."""
    seed = random.SystemRandom().randrange(2**31)
    prompts, params = _prompts(seed, 4), _params(4)
    ref = [o.outputs[0].token_ids for o in make_llm(model, max_num_batched_tokens=16).generate(prompts, params)]
    llm = make_llm(model, overlap=overlap, max_num_batched_tokens=16, speculative_config=MTP)
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


def test_random_drafter_is_lossless() -> None:
    """Random weights: the block's drafts are nearly all rejected, and the tokens stay plain decoding's."""
    seed = random.SystemRandom().randrange(2**31)
    model = _random_v4(seed % 1000)
    prompts, params = _prompts(seed, 3), _params(3, seed)
    ref = [o.outputs[0].token_ids for o in make_llm(model, max_num_batched_tokens=16).generate(prompts, params)]
    llm = make_llm(model, max_num_batched_tokens=16, speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref, f"seed={seed}"
    assert llm.speculator.stats.verify_steps > 0


def test_sampled_outputs_equal(model) -> None:
    """Greedy drafts against a sampled target: accepted where the target's own sample (same
    seed, same position) equals them, so every token is the one plain sampling gives."""
    seed = random.SystemRandom().randrange(2**31)
    prompts = _prompts(seed, 3)
    params = [SamplingParams(temperature=0.8, top_p=0.9 if i % 2 else 1.0, max_tokens=12, ignore_eos=True, seq_seed=seed + i)
              for i in range(3)]
    ref = [o.outputs[0].token_ids for o in make_llm(model).generate(prompts, params)]
    llm = make_llm(model, speculative_config=MTP)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == ref, f"seed={seed}"
    assert llm.speculator.stats.accepted_tokens > 0, f"seed={seed}"


def test_window_holds_verified_positions(model) -> None:
    """After a run with rejections the block's window is the one-shot block's over the final
    text (chained drafts and rejected rows left nothing), the target's state is a plain run's,
    and the first step after the prompt verifies drafts the prompt's last chunk made."""
    seed = random.SystemRandom().randrange(2**31)
    prompt = _prompts(seed, 1)[0] + [7, 8]  # at least two 16-token-budget chunks with the 20-token decode
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = make_llm(model, max_num_seqs=1, max_num_batched_tokens=16)
    ref = plain.generate([prompt], sp)[0].outputs[0].token_ids
    llm = make_llm(model, max_num_seqs=1, max_num_batched_tokens=16, speculative_config=MTP)
    assert llm.generate([prompt], sp)[0].outputs[0].token_ids == ref, f"seed={seed}"
    st = llm.speculator.stats
    assert 0 < st.accepted_tokens < st.draft_tokens, f"seed={seed}: {st}"
    text = prompt + ref
    n = len(text) - 1  # positions the model has seen: the last token is sampled, never fed
    a, b = _slot_state(plain, 0, n), _slot_state(llm, 0, n)
    for path in a:
        if not path.startswith("mtp."):
            torch.testing.assert_close(b[path], a[path], atol=1e-4, rtol=1e-4, msg=lambda m: f"seed={seed} {path}: {m}")
    c, params = model
    state = init_state(c, MAX_LEN, torch.float32, "cpu")
    _, X = forward(params, state, c, torch.tensor(text[:n]), 0)
    mtp_forward(params, state, c, X, torch.tensor(text[1:]), 0)
    W = c.sliding_window
    live = [p % W for p in range(max(0, n - W), n)]
    torch.testing.assert_close(llm.pool.state["mtp"][0]["window"][0, live], state["mtp"][0]["window"][0, live],
                               atol=1e-4, rtol=1e-4, msg=lambda m: f"seed={seed}: {m}")


def _chunk_inputs(c, ids: list[int], start: int, slot: int, L: int):
    """One chunk's ``Batch`` for the target, padded to ``L`` rows."""
    index = torch.arange(L)[None]
    group = Group(index, torch.tensor([slot]), torch.tensor([start]), torch.tensor([len(ids)]), packed=True)
    tokens = torch.tensor(ids + [0] * (L - len(ids)))
    return Batch(tokens, group.positions.reshape(-1), (group,)), tokens


def test_chunked_drafts_equal_one_shot() -> None:
    """``mtp_draft`` after two prompt chunks (the first one's last row waits as ``pending``)
    drafts what the one-shot block does over the whole prompt, chained through the same block."""
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    c, params = _random_v4(seed % 1000)
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
        _, X = deepinfer_fx.graphs.model.forward_batch(params, state, c, batch)
        nexts = torch.cat([tokens[1:], tokens[:1]])[None].clone()
        nexts[0, len(ids) - 1] = sampled
        known = torch.tensor([len(ids) - 1 + int(samples)])
        got = mtp_draft(params, state, c, X, one, torch.tensor([start]), torch.tensor([len(ids)]), tokens[:1], nexts, known,
                        torch.tensor([start > 0]), k)
    assert got[0].tolist() == want, f"seed={seed}"
    W = c.sliding_window
    live = [p % W for p in range(max(0, len(prompt) - W), len(prompt))]
    torch.testing.assert_close(state["mtp"][0]["window"][0, live], window[live], atol=1e-5, rtol=1e-5, msg=lambda m: f"seed={seed}: {m}")


def test_compiled_mtp_steps(model) -> None:
    """The steps compiled (aot_eager on the CPU) with the drafter inside them and warmed up:
    plain decoding's tokens, drafts accepted and rejected, and no step of the run (a rollback's
    replay included) compiles after the warm-up."""
    prompt = _prompts(3, 1)[0]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref = make_llm(model, max_num_seqs=1).generate([prompt], sp)[0].outputs[0].token_ids
    llm = make_llm(model, eager=False, warmup=True, max_num_seqs=1, max_num_batched_tokens=16, speculative_config=MTP)
    warmed = [r["graph"] for r in llm.runner.steps.report()]
    assert llm.generate([prompt], sp)[0].outputs[0].token_ids == ref
    st = llm.speculator.stats
    assert 0 < st.accepted_tokens < st.draft_tokens, st
    names = [r["graph"] for r in llm.runner.steps.report()]
    assert names == warmed, f"compiled after the warm-up: {names[len(warmed):]}"
    assert any(n.startswith("verify") and n.endswith("-mtp3") for n in names), names


def test_refusals(model, tmp_path) -> None:
    with pytest.raises(ValueError, match="'mtp' with engine_type='prompt'"):
        make_llm(model, engine_type="prompt", state_dir=tmp_path, speculative_config=MTP)
