"""Confidence-scheduled verification (``DEEPINFER_ENABLE_MTP_VARLEN=1``, ``spec_schedule.py``):
the greedy plan against brute force where the step time is additive in drafts (there the greedy
is optimal), its fallbacks, the step-time estimates, and the engine with DSpark scheduling
lengths per request: plain decoding's tokens, lengths that vary, compiled and warmed up."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from test_spec_drafters import _prompts, drafting, make_llm, spec

from deepinfer_fx import SamplingParams
from deepinfer_fx.api import Model
from deepinfer_fx.engine.spec_schedule import StepTimes, plan_lengths, survival

VARLEN = "DEEPINFER_ENABLE_MTP_VARLEN"


def _rate(conf, lengths, step_time) -> float:
    return (len(conf) + sum(sum(survival(c)[:n]) for c, n in zip(conf, lengths))) / step_time(lengths)


def test_greedy_is_optimal_for_additive_costs() -> None:
    """Step time 1 + beta * (drafts verified): expected tokens per second is then maximised by
    the top drafts by survival, which the greedy finds; checked against every plan."""
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    for _ in range(30):
        conf = [[rng.random() for _ in range(rng.randint(0, 3))] for _ in range(rng.randint(1, 3))]
        beta = rng.choice([0.0, 0.05, 0.3, 2.0])

        def step_time(lengths):
            return 1.0 + beta * sum(lengths)

        got = plan_lengths(conf, step_time)
        best = max(_rate(conf, p, step_time) for p in itertools.product(*[range(len(c) + 1) for c in conf]))
        assert all(0 <= n <= len(c) for n, c in zip(got, conf)), (seed, conf, got)
        assert _rate(conf, got, step_time) == pytest.approx(best), (seed, conf, beta, got)
        if beta == 0.0:
            assert got == [len(c) for c in conf], (seed, conf, got)  # free drafts: all of them


def test_a_second_part_is_paid_once() -> None:
    """A decode part and a verify part run two graphs: when verifying costs a whole part, the
    plan verifies everyone (or no one) rather than stopping at the first verifying request."""
    conf = [[0.9, 0.8], [0.9, 0.8], [0.9, 0.8]]

    def step_time(lengths):  # one second per part, whatever its rows
        return float(any(n == 0 for n in lengths)) + float(any(n > 0 for n in lengths))

    assert plan_lengths(conf, step_time) == [2, 2, 2]


def test_unmeasured_steps_verify_every_draft() -> None:
    assert plan_lengths([[0.1, 0.1], [0.2]], lambda lengths: None) == [2, 1]


def test_step_times_estimate_by_rows() -> None:
    t = StepTimes(torch.device("cpu"))
    assert t.estimate(("decode", 4, 1)) is None
    t.record(("verify", 2, 4), 0.8)
    assert t.estimate(("verify", 2, 4)) == 0.8
    assert t.estimate(("verify", 4, 4)) == pytest.approx(1.6)  # nearest of its kind, scaled by rows
    assert t.estimate(("decode", 4, 1)) == pytest.approx(0.4)  # no decode measured yet: any kind's
    t.record(("verify", 2, 4), 0.3)
    assert t.estimate(("verify", 2, 4)) == pytest.approx(0.8 * 0.8 + 0.2 * 0.3)


@pytest.mark.parametrize("eager", [True, False])
def test_engine_schedules_lengths(monkeypatch, eager: bool) -> None:
    """DSpark with confidence scheduling on tiny V4.1, its confidence head zeroed (every draft
    0.5, so survivals 0.5, 0.25, ...) and a step costing 1 + 0.15 per verified draft: the plan is
    two drafts a step (a third's 0.125 does not pay), each step verifies exactly that, and the
    tokens stay plain decoding's. Compiled: warmed up with every verify length, timed at
    warm-up, and nothing compiles after it."""
    c, params = drafting("dspark-v41")
    last = dict(params["mtp"][-1])
    last["confidence_head"] = {"proj": torch.zeros_like(last["confidence_head"]["proj"])}
    model = Model(c, {**params, "mtp": params["mtp"][:-1] + [last]})
    seed = random.SystemRandom().randrange(2**31)
    prompt = _prompts(seed, 1)
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = (
        dict(max_num_seqs=1, max_num_batched_tokens=16)
        if eager
        else dict(eager=False, warmup=True, max_num_seqs=1, max_num_batched_tokens=16)
    )
    # the eager plain run: compiled == eager is test_compiled_drafter_steps' comparison too
    ref = [
        o.outputs[0].token_ids for o in make_llm(model, max_num_seqs=1, max_num_batched_tokens=16).generate(prompt, sp)
    ]
    monkeypatch.setenv(VARLEN, "1")
    llm = make_llm(model, speculative_config=spec("dspark-v41", 4), **kw)
    if not eager:
        assert llm.runner.steps.verify_buckets == (2, 3, 4, 5)
        assert {k[2] for k in llm.runner.steps.times.seconds if k[0] == "verify"} == {2, 3, 4, 5}  # timed at warm-up
        warmed = [r["graph"] for r in llm.runner.steps.report()]
    llm.speculator.step_time = lambda lengths: 1.0 + 0.15 * sum(lengths)
    got = [o.outputs[0].token_ids for o in llm.generate(prompt, sp)]
    assert got == ref, f"seed={seed}"
    st = llm.speculator.stats
    assert st.accepted_tokens > 0 and len(st.proposed_at) == 2, f"seed={seed}: {st}"  # never a third draft
    assert st.proposed_at[1] >= st.verify_steps - 1, (
        f"seed={seed}: {st}"
    )  # two drafts, but where the request's end caps it
    if not eager:
        assert [r["graph"] for r in llm.runner.steps.report()] == warmed


def test_varlen_needs_dspark(monkeypatch) -> None:
    from test_spec_drafters import _random

    monkeypatch.setenv(VARLEN, "1")
    for kind, cfg in (
        ("mtp-v4", spec("mtp-v4")),
        ("mtp-v4", {"method": "ngram", "num_speculative_tokens": 2}),
        ("mtp-v4", None),
    ):
        with pytest.raises(ValueError, match="DEEPINFER_ENABLE_MTP_VARLEN=1 .* reads DSpark's confidence head"):
            make_llm(_random(kind), speculative_config=cfg)
