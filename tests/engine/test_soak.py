"""A bounded soak through the public step API: 1,000 requests arriving in random bursts on a pool
smaller than the load (6 slots, a 24-token budget, so requests queue and prompts are chunked),
with random prompt lengths, sampling settings (greedy, temperature, top-k, top-p, min-p, seeds),
max_tokens, stop strings, stop token ids, EOS, and ~10% aborted at random times (waiting or
running). Every request must end exactly once, within its limits and stops, and afterwards the
pool must be whole (every slot and page free) with nothing left unfinished.

Runs in ~30-40 s on one core (the engine's tiny CPU steps are dominated by per-op overhead, and
on a loaded machine more intra-op threads only make them slower, so the test pins one)."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.config import load_config
from deepinfer_fx.engine.cache import state_bytes_per_slot

N_REQUESTS = 1000
SLOTS = 6
MAX_LEN = 64
FINISH_REASONS = {"stop", "length", "abort"}


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _params(rng: random.Random, stop_ids: list[int], stop_strings: list[str]) -> SamplingParams:
    kind = rng.choice(["greedy", "temperature", "top_k", "top_p", "min_p", "all"])
    kw: dict = {"max_tokens": rng.randint(1, 8), "ignore_eos": rng.random() < 0.5}
    if kind != "greedy":
        kw["temperature"] = rng.choice([0.5, 0.8, 1.0, 1.3])
        kw["seq_seed"] = rng.randrange(2**31) if rng.random() < 0.7 else None  # else the engine derives one
    if kind in ("top_k", "all"):
        kw["top_k"] = rng.randint(1, 20)
    if kind in ("top_p", "all"):
        kw["top_p"] = rng.choice([0.3, 0.7, 0.95])
    if kind in ("min_p", "all"):
        kw["min_p"] = rng.choice([0.01, 0.05, 0.2])
    if rng.random() < 0.4:
        kw["stop"] = rng.sample(stop_strings, rng.randint(1, 2))
    if rng.random() < 0.4:
        kw["stop_token_ids"] = rng.sample(stop_ids, rng.randint(1, 3))
    return SamplingParams(**kw)


def _check(out, params: SamplingParams, eos: tuple[int, ...]) -> None:
    c = out.outputs[0]
    ids, reason = c.token_ids, c.finish_reason
    assert out.finished and reason in FINISH_REASONS, (out.request_id, reason)
    assert len(ids) <= params.max_tokens, (out.request_id, ids, params.max_tokens)
    enders = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    assert not enders & set(ids[:-1]), (out.request_id, ids, enders)  # a stop token ends the request where it comes
    assert not any(s in c.text for s in params.stop), (out.request_id, c.text, params.stop)
    if reason == "length":
        assert len(ids) == params.max_tokens and not (ids and ids[-1] in enders), (out.request_id, ids)
    elif reason == "abort":
        assert len(ids) < params.max_tokens and c.stop_reason is None, (out.request_id, ids)
    elif isinstance(c.stop_reason, str):
        assert c.stop_reason in params.stop, (out.request_id, c.stop_reason)
    else:  # a stop token id (stop_reason) or EOS (None): the last token
        assert ids and ids[-1] in enders, (out.request_id, ids, enders)
        assert c.stop_reason == (ids[-1] if ids[-1] in params.stop_token_ids else None), (out.request_id, c.stop_reason)


def test_soak_every_request_ends_once_and_the_pool_is_whole(tmp_path, one_thread) -> None:
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    ckpt = tmp_path / "ckpt"
    # two layers (a window layer and a CSA layer): the invariants are the engine's, and half the layers halve the time
    deepinfer_fx.write_random_checkpoint(
        ckpt, tiny_v4(num_hidden_layers=2, compress_ratios=[0, 4, 0]), seed=seed % 1000
    )
    per_slot = state_bytes_per_slot(load_config(ckpt), MAX_LEN, torch.float32)["total"]
    # the memory budget, not max_num_seqs, is what holds the pool to SLOTS (+1 scratch)
    llm = LLM(
        ckpt,
        dtype="float32",
        device="cpu",
        fake_quant=False,
        max_model_len=MAX_LEN,
        max_num_seqs=2 * SLOTS,
        max_num_batched_tokens=24,
        memory_budget=(SLOTS + 1) * per_slot,
        seed=seed,
    )
    assert llm.plan.slots == SLOTS
    eos = llm.model.config.eos_token_ids

    # stops that fire: the tokens and text pieces this random model actually produces
    probe = llm.generate(
        [[rng.randrange(3, 300) for _ in range(rng.randint(1, 20))] for _ in range(24)],
        SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True, seq_seed=seed),
    )
    made = Counter(t for o in probe for t in o.outputs[0].token_ids)
    stop_ids = [t for t, _ in made.most_common(8)]
    pieces = Counter(
        t[i : i + n] for t in (o.outputs[0].text for o in probe) for n in (1, 2) for i in range(len(t) - n + 1)
    )
    stop_strings = [p for p, _ in pieces.most_common() if "\ufffd" not in p and p.strip()][:12]  # no half-decoded bytes
    assert stop_ids and stop_strings, f"seed={seed}"

    params: dict[int, SamplingParams] = {}
    abort_at: dict[int, int] = {}  # request id -> the turn it is aborted at
    ended: dict[int, object] = {}
    ends = Counter()
    turn = 0

    def record(out) -> None:
        ends[out.request_id] += 1
        ended[out.request_id] = out

    while len(params) < N_REQUESTS or llm.has_unfinished_requests():
        for _ in range(min(rng.choice([0, 0, 1, 2, 3, 6, 9]), N_REQUESTS - len(params))):
            n = rng.randint(1, 40)
            prompt = (
                [rng.randrange(3, 300) for _ in range(n)]
                if rng.random() < 0.8
                else " ".join(["the weather is"] * rng.randint(1, 6))
            )
            sp = _params(rng, stop_ids, stop_strings)
            rid = llm.add_request(prompt, sp)
            assert rid not in params, f"seed={seed}: request id {rid} handed out twice"
            params[rid] = sp
            if rng.random() < 0.05:  # aborted a few turns after it arrives: mostly still queued
                abort_at[rid] = turn + rng.choice([0, 1, 2, 5, 10, 20, 40])
        targets = [r for r, t in abort_at.items() if t == turn]
        if rng.random() < 0.05:  # the oldest open request: admission is FIFO, so mostly a running one
            targets.append(min((r for r in params if r not in ends), default=None))
        for rid in [r for r in targets if r is not None and r not in ends]:
            out = llm.abort(rid)
            if out is not None:  # else it had already finished
                assert out.outputs[0].finish_reason == "abort", f"seed={seed}: {out}"
                record(out)
            assert llm.abort(rid) is None, f"seed={seed}: request {rid} aborted twice"
        for out in llm.step():
            if out.finished:  # step() may also report requests that only made progress
                record(out)
        turn += 1
        assert turn < 20 * N_REQUESTS, f"seed={seed}: the engine stopped making progress"

    assert sorted(ends) == sorted(params), (
        f"seed={seed}: requests that never ended: {sorted(set(params) - set(ends))[:10]}"
    )
    twice = [r for r, n in ends.items() if n != 1]
    assert not twice, f"seed={seed}: requests that ended more than once: {twice[:10]}"
    for rid, out in ended.items():
        try:
            _check(out, params[rid], eos)
        except AssertionError as e:
            raise AssertionError(f"seed={seed}: {e} ({params[rid]})") from None
    reasons = Counter(o.outputs[0].finish_reason for o in ended.values())
    by_string = sum(isinstance(o.outputs[0].stop_reason, str) for o in ended.values())
    by_id = sum(isinstance(o.outputs[0].stop_reason, int) for o in ended.values())
    aborted = [o for o in ended.values() if o.outputs[0].finish_reason == "abort"]
    waiting_aborts = sum(o.metrics.first_scheduled_time is None for o in aborted)
    # the battery exercised what it claims: every ending, aborts of queued and of running requests
    assert by_string and by_id and reasons["length"] and 0.04 * N_REQUESTS <= len(aborted) <= 0.15 * N_REQUESTS, (
        seed,
        reasons,
        by_string,
        by_id,
    )
    assert 0 < waiting_aborts < len(aborted), (seed, waiting_aborts, len(aborted))

    assert not llm.has_unfinished_requests()
    assert not llm.scheduler.waiting and not llm.scheduler.running, f"seed={seed}"
    assert llm.pool.num_free == llm.pool.slots and llm.pool.in_use == set(), f"seed={seed}: slots still held"
    assert llm.pool.free_pages == llm.pool.num_pages, f"seed={seed}: pages still reserved"
