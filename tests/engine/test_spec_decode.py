"""Speculative decoding end to end (tiny V4 and V4.1 with Engram, fp32, CPU): outputs with
speculation on equal outputs with it off, token for token, where drafts are accepted and where
they are rejected (so the rollback runs), and nothing is left behind."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import tiny_v4, tiny_v41

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.config import config_from_dict
from deepinfer_fx.engine.cache import GROWING_KEYS
from deepinfer_fx.engine.state_io import rekey_ring, ring_widths

MAX_LEN = 96
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module", params=["v4", "v41"])
def model(request):
    return _tiny_model(request.param)


def _tiny_model(kind: str):
    cfg = tiny_v4() if kind == "v4" else tiny_v41()
    return deepinfer_fx.random_model(config_from_dict(cfg).replace(fake_quant=False), seed=5)


def cycling(model):
    """``model`` with a large embedding and the head set to follow each token t by
    ``3 * (t // 3) + (t + 1) % 3``: greedy text cycles through three tokens (random weights
    never repeat themselves), the kind of text prompt lookup drafts well."""
    c, params = model
    params = {**params, "embed": params["embed"] * 20}
    t = torch.arange(c.vocab_size)
    after = 3 * (t // 3) + (t + 1) % 3
    inverse = torch.empty_like(after)
    inverse[after] = t
    params["head"] = params["embed"][inverse].clone()
    return deepinfer_fx.api.Model(c, params)


def make_llm(model, **kw) -> LLM:
    kw.setdefault("max_model_len", MAX_LEN)
    kw.setdefault("num_threads", 1)  # the test machine's cores are shared: one thread runs fastest
    return LLM(model, device="cpu", eager=kw.pop("eager", True), **kw)


def _requests(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randint(2, 30))] for _ in range(n)]


def oracle(llm: LLM, reference: dict[tuple, list[int]], wrong_every: int = 3) -> None:
    """Drafts from the tokens a plain run produced, every ``wrong_every``-th one corrupted: a mix
    of fully accepted, partly accepted and rejected verify steps, whatever the random model says."""

    def drafts(seq, limit):
        ref = reference[tuple(seq.prompt_ids)]
        done = len(seq.output_ids)
        out = ref[done : done + min(limit, llm.speculator.config.num_speculative_tokens)]
        return tuple(t if (done + j) % wrong_every else (t + 1) % 300 for j, t in enumerate(out))

    llm.speculator.drafts = drafts


def _run_with_abort(llm: LLM, prompts, params, abort_id: int, after: int) -> dict[int, list[int]]:
    ids = [llm.add_request(p, sp) for p, sp in zip(prompts, params)]
    out, steps = {}, 0
    while llm.has_unfinished_requests():
        for o in llm.step():
            out[o.request_id] = o
        steps += 1
        if steps == after:
            out[ids[abort_id]] = llm.abort(ids[abort_id])
    return {i - ids[0]: out[i] for i in ids}


PROMPTS = _requests(3, 4)
GREEDY = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (8, 3, 10, 7)]


@pytest.fixture(scope="module")
def greedy_ref(model) -> dict[tuple, list[int]]:
    plain = make_llm(model, max_num_batched_tokens=16).generate(PROMPTS, GREEDY)
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(PROMPTS, plain)}


@pytest.mark.parametrize("overlap", [True, False])
def test_greedy_outputs_equal_with_rollback(model, greedy_ref, overlap: bool) -> None:
    """Mixed requests, prompts chunked under a 16-token budget, one abort mid-run."""
    prompts, params, ref = PROMPTS, GREEDY, greedy_ref
    llm = make_llm(model, overlap=overlap, max_num_batched_tokens=16, speculative_config=NGRAM)
    oracle(llm, ref)
    outs = _run_with_abort(llm, prompts, params, abort_id=2, after=4)
    for i, p in enumerate(prompts):
        got = outs[i].outputs[0]
        if i == 2:
            assert got.finish_reason == "abort" and got.token_ids == ref[tuple(p)][: len(got.token_ids)]
        else:
            assert got.token_ids == ref[tuple(p)], f"request {i}"
    st = llm.speculator.stats
    assert 0 < st.accepted_tokens < st.draft_tokens, st  # accepted and rejected drafts
    assert sum(o.metrics.num_accepted_tokens for o in outs.values()) == st.accepted_tokens
    assert llm.pool.num_free == llm.pool.slots and llm.pool.free_pages == llm.pool.num_pages


def test_sampled_outputs_equal(model) -> None:
    """Point-mass drafts are accepted when the target's own sample (same seed, same position)
    equals them, so sampled requests get exactly the tokens they get without speculation."""
    seed = random.SystemRandom().randrange(2**31)
    prompts = _requests(seed, 3)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9 if i % 2 else 1.0, max_tokens=8, ignore_eos=True, seq_seed=seed + i)
        for i in range(3)
    ]
    plain, got, llm = _plain_and_speculative(model, prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain], f"seed={seed}"
    assert 0 < llm.speculator.stats.accepted_tokens < llm.speculator.stats.draft_tokens


def _plain_and_speculative(model, prompts, params):
    """(plain outputs, outputs with the oracle's n-gram drafts, that engine)."""
    plain = make_llm(model).generate(prompts, params)
    llm = make_llm(model, speculative_config=NGRAM)
    oracle(llm, {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)})
    return plain, llm.generate(prompts, params), llm


def test_logprobs_requests_speculate(model) -> None:
    """A request asking for logprobs speculates too: every verify row's logprobs come back and
    each emitted token keeps its own, as plain decoding reports them."""
    seed = random.SystemRandom().randrange(2**31)
    prompts = _requests(seed, 3)
    params = [
        SamplingParams(temperature=0.7 * (i % 2), max_tokens=8, ignore_eos=True, logprobs=2 + i, seq_seed=seed + i)
        for i in range(3)
    ]
    plain, got, llm = _plain_and_speculative(model, prompts, params)
    st = llm.speculator.stats
    assert 0 < st.accepted_tokens < st.draft_tokens, f"seed={seed}: {st}"
    for i, (a, b) in enumerate(zip(plain, got)):
        a, b = a.outputs[0], b.outputs[0]
        assert b.token_ids == a.token_ids, f"seed={seed} request {i}"
        assert len(b.logprobs) == len(a.logprobs) == len(a.token_ids)
        for j, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
            assert x.keys() == y.keys(), f"seed={seed} request {i} token {j}: {x} vs {y}"
            for t in x:
                assert abs(x[t] - y[t]) < 1e-4, f"seed={seed} request {i} token {j}: {x} vs {y}"


def _slot_state(llm: LLM, slot: int, length: int) -> dict[str, torch.Tensor]:
    """A slot's state as a later query can see it: entries past ``length`` are never read, and
    a ring with spare rows (a speculating engine's) holds the last positions before ``length``
    where a ring without them would (``state_io.rekey_ring``, as an export stores it)."""
    out, rings = {}, ring_widths(llm.pool)
    for path, t in llm.pool.slot_tensors(slot).items():
        if path.endswith(GROWING_KEYS):
            ratio = llm.max_model_len // t.shape[0]
            t = t[: length // ratio]
        elif path in rings:
            t = rekey_ring(t, length, rings[path])
        out[path] = t.clone()
    return out


def test_no_leak_state_as_plain_run(model) -> None:
    """After a run with rejected drafts, the slot holds what a run without speculation leaves."""
    prompt = _requests(7, 1)[0]
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    plain = make_llm(model, max_num_seqs=1)
    ref = plain.generate([prompt], sp)[0].outputs[0].token_ids
    llm = make_llm(model, max_num_seqs=1, speculative_config=NGRAM)
    oracle(llm, {tuple(prompt): ref})
    assert llm.generate([prompt], sp)[0].outputs[0].token_ids == ref
    assert llm.speculator.stats.accepted_tokens < llm.speculator.stats.draft_tokens  # a rollback ran
    length = len(prompt) + len(ref) - 1  # the last token is sampled, never fed
    a, b = _slot_state(plain, 0, length), _slot_state(llm, 0, length)
    for path in a:
        torch.testing.assert_close(b[path], a[path], atol=1e-4, rtol=1e-4, msg=path)
    assert llm.pool.num_free == 1 and llm.pool.free_pages == llm.pool.num_pages


def test_ngram_drafter_accepts_on_repetitive_text(model) -> None:
    """The n-gram drafter itself, on a model whose text cycles: its first drafts (from the
    prompt's pattern) are rejected, later ones (from the output's cycle) accepted; outputs and
    the slots' states stay those of plain decoding."""
    model = cycling(model)
    prompts = [[5, 6, 7, 8] * 6 + [7], [9, 10] * 10 + [11]]  # the first one's pattern is not its cycle
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = make_llm(model)
    ref = plain.generate(prompts, sp)
    llm = make_llm(model, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    got = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref]
    st = llm.speculator.stats
    assert 0 < st.accepted_tokens < st.draft_tokens and st.mean_accepted_length > 2, st
    for slot, (p, o) in enumerate(zip(prompts, ref)):
        n = len(p) + len(o.outputs[0].token_ids) - 1
        a, b = _slot_state(plain, slot, n), _slot_state(llm, slot, n)
        for path in a:
            torch.testing.assert_close(b[path], a[path], atol=1e-4, rtol=1e-4, msg=path)


def test_compiled_verify_step() -> None:
    """The verify step compiled (aot_eager on the CPU) like the decode and prefill steps: the
    same tokens as eager plain decoding, with rollbacks (on V4 only: each graph compiles for
    seconds, and the eager tests cover V4.1)."""
    model = _tiny_model("v4")
    prompt, ref = PROMPTS[0], None
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    ref = make_llm(model, max_num_seqs=1).generate([prompt], sp)[0].outputs[0].token_ids
    llm = make_llm(
        model, eager=False, warmup=False, max_num_seqs=1, max_num_batched_tokens=16, speculative_config=NGRAM
    )
    oracle(llm, {tuple(prompt): ref})
    assert llm.generate([prompt], sp)[0].outputs[0].token_ids == ref
    assert 0 < llm.speculator.stats.accepted_tokens < llm.speculator.stats.draft_tokens
    assert any(r["graph"].startswith("verify") for r in llm.runner.steps.report()), llm.runner.steps.report()


def test_stop_token_and_prompt_completion_split(model, greedy_ref, tmp_path) -> None:
    """A stop token inside an accepted run of drafts ends the request there; a COMPLETION
    engine that speculates continues exported states as a NORMAL one without speculation."""
    prompt = PROMPTS[2]
    ref = greedy_ref[tuple(prompt)]
    stop = ref[5]
    llm = make_llm(model, speculative_config=NGRAM)
    oracle(llm, greedy_ref, wrong_every=50)  # drafts all right: the stop token arrives inside a verify step
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[stop]))[0].outputs[0]
    assert out.token_ids == ref[: ref.index(stop) + 1] and out.finish_reason == "stop"
    make_llm(model, engine_type="prompt", state_dir=tmp_path).generate(PROMPTS, GREEDY)
    done = make_llm(model, engine_type="completion", state_dir=tmp_path, speculative_config=NGRAM)
    oracle(done, greedy_ref)
    got = done.generate(None, GREEDY)
    assert [o.outputs[0].token_ids for o in got] == [greedy_ref[tuple(p)] for p in PROMPTS]
    assert done.speculator.stats.accepted_tokens > 0
