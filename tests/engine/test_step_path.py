"""The one step path (CPU, fp32): compiled steps (our passes on aot_eager) sample exactly as
the eager steps do in every sampler mode; a warm-up covers what a generate then runs; streamed
deltas add up to the final outputs; requests of ``add_request`` survive a ``generate``."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.engine.sampler import MODES


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-step")
    deepinfer_fx.write_random_checkpoint(path, tiny_v4(), seed=23)
    return path


def make_llm(ckpt, **kw) -> LLM:
    kw.setdefault("max_model_len", 96)
    return LLM(ckpt, dtype="float32", device="cpu", fake_quant=False, **kw)


def _mixed_params(seed: int, n: int) -> list[SamplingParams]:
    """Rows of every sampler mode side by side, seeded, some with logprobs."""
    rng = random.Random(seed)
    kinds = [
        dict(temperature=0),
        dict(temperature=0.8),
        dict(temperature=0.9, min_p=0.05),
        dict(temperature=0.7, top_p=0.9),
        dict(temperature=1.1, top_k=20),
        dict(temperature=0.6, top_p=0.8, top_k=30),
    ]
    return [
        SamplingParams(
            **kinds[i % len(kinds)],
            max_tokens=rng.randint(2, 9),
            ignore_eos=True,
            seq_seed=rng.randrange(2**40),
            logprobs=3 if i % 4 == 1 else None,
        )
        for i in range(n)
    ]


def test_compiled_sampling_equals_eager_after_warm_up(ckpt) -> None:
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    # four prompts of 16 tokens: one prefill step of 4 x 16 (a warm-up bucket), then decode buckets 4, 2, 1
    prompts = [[rng.randrange(3, 300) for _ in range(16)] for _ in range(4)]
    compiled = make_llm(ckpt, eager=False, warmup=True, max_num_seqs=4, max_num_batched_tokens=64)
    warmed = {r["graph"]: r["calls"] for r in compiled.runner.steps.report()}
    assert {name.rsplit("-", 1)[1] for name in warmed} == set(MODES)
    assert compiled.warmup_s is not None and compiled.warmup_s > 0
    eager = make_llm(ckpt, max_num_seqs=4, max_num_batched_tokens=64)
    for round_ in range(3):
        params = _mixed_params(seed + round_, 4)
        if round_ == 2:  # one mode for the whole batch: the step runs that mode's graph
            params = [SamplingParams(temperature=0, max_tokens=p.max_tokens, ignore_eos=True) for p in params]
        got, want = compiled.generate(prompts, params), eager.generate(prompts, params)
        for g, w, p in zip(got, want, params):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids, f"seed={seed} round {round_} {p}"
            if p.logprobs is not None:
                for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                    assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a), f"seed={seed}"
    # no compile inside generate: every graph it ran was compiled by the warm-up (logprob rows
    # run their own small sampler graph, outside the warm-up's modes)
    after = {r["graph"]: r for r in compiled.runner.steps.report()}
    new = {name for name in after if name not in warmed and "-k" not in name}
    assert not new, f"seed={seed}: compiled after the warm-up: {sorted(new)}"
    assert sum(after[name]["calls"] - warmed[name] for name in warmed) > 0


def test_streamed_deltas_add_up(ckpt) -> None:
    seed = random.SystemRandom().randrange(2**31)
    llm = make_llm(ckpt, max_num_seqs=3, max_num_batched_tokens=24)
    rng = random.Random(seed)
    ids = [
        llm.add_request(
            "the weather today is" + " a" * rng.randint(0, 20),
            SamplingParams(
                temperature=0.8,
                max_tokens=rng.randint(3, 16),
                seq_seed=rng.randrange(1000),
                stop=["e"] if i == 2 else None,
            ),
        )
        for i in range(5)
    ]
    text = {i: "" for i in ids}
    tokens = {i: [] for i in ids}
    final = {}
    steps_with_progress = 0
    while llm.has_unfinished_requests():
        outs = llm.step()
        steps_with_progress += bool(outs)
        for o in outs:
            assert o.request_id not in final, f"seed={seed}: output after finishing"
            c = o.outputs[0]
            text[o.request_id] += c.delta_text
            tokens[o.request_id] += c.delta_token_ids
            assert c.text == text[o.request_id] and c.token_ids == tokens[o.request_id], f"seed={seed}"
            if o.finished:
                final[o.request_id] = c
    assert sorted(final) == ids and steps_with_progress > 5
    for i in ids:
        c = final[i]
        assert c.text == text[i] and c.token_ids == tokens[i]
        if c.finish_reason == "length":  # the whole output decoded at once equals the streamed text
            assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True), f"seed={seed}"
        if c.stop_reason == "e":
            assert "e" not in c.text


def test_add_request_then_generate_loses_nothing(ckpt) -> None:
    llm = make_llm(ckpt, max_num_seqs=4)
    early = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    outs = llm.generate([[8, 9], [10, 11, 12]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3] and early not in [o.request_id for o in outs]
    assert llm.has_unfinished_requests()
    done = []
    while llm.has_unfinished_requests():
        done += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in done] == [early] and len(done[0].outputs[0].token_ids) == 20
    alone = make_llm(ckpt).generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert done[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert llm.pool.num_free == llm.pool.slots


def test_nan_logits_end_the_request_with_an_error(ckpt) -> None:
    llm = make_llm(ckpt)
    c, params = llm.model
    ok = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    with torch.no_grad():
        head = params["head"]["weight"] if isinstance(params["head"], dict) else params["head"]
        saved = head[7].clone()
        head[7] = float("nan")  # one vocabulary row: every request's logits hold a NaN
    try:
        out = llm.generate([[8, 9]], SamplingParams(temperature=0.5, max_tokens=4))[0].outputs[0]
    finally:
        with torch.no_grad():
            head[7] = saved
    assert out.finish_reason == "error" and "not finite" in out.error and out.token_ids == []
    done = []
    while llm.has_unfinished_requests():
        done += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in done] == [ok] and done[0].outputs[0].finish_reason == "error"
    assert llm.pool.num_free == llm.pool.slots
