"""The offline engine end to end on a tiny random model (fp32, CPU)."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams

MAX_LEN = 96


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    deepinfer_fx.write_random_checkpoint(path, tiny_v4(), seed=11)
    return path


def make_llm(ckpt, **kw) -> LLM:
    kw.setdefault("max_model_len", MAX_LEN)
    return LLM(ckpt, dtype="float32", device="cpu", fake_quant=False, **kw)


def _requests(seed: int, n: int, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(1, 40))], rng.randint(1, 12)) for _ in range(n)]


def test_batched_equals_alone(ckpt) -> None:
    seed = random.SystemRandom().randrange(2**31)
    llm = make_llm(ckpt, max_num_seqs=64, max_num_batched_tokens=256)
    reqs = _requests(seed, 64, 300)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=0) for _, m in reqs]
    together = llm.generate([p for p, _ in reqs], params)
    alone_llm = make_llm(ckpt, max_num_seqs=1)
    for (prompt, _), sp, out in zip(reqs, params, together):
        alone = alone_llm.generate([prompt], sp)[0].outputs[0]
        assert out.outputs[0].token_ids == alone.token_ids, f"seed={seed}: prompt {prompt}"
        for a, b in zip(out.outputs[0].logprobs, alone.logprobs):
            assert a.keys() == b.keys()
            for k in a:
                assert abs(a[k] - b[k]) <= 1e-5, f"seed={seed}: logprob of {k} {a[k]} vs {b[k]}"


def test_seeded_sampling_is_reproducible(ckpt) -> None:
    seed = random.SystemRandom().randrange(2**31)
    reqs = _requests(seed, 12, 300)
    prompts = [p for p, _ in reqs]

    def run(llm, seq_seed_base: int, order: list[int]) -> dict[int, list[int]]:
        ps = [
            SamplingParams(
                temperature=0.9, top_p=0.95, top_k=50, max_tokens=10, ignore_eos=True, seq_seed=seq_seed_base + i
            )
            for i in order
        ]
        outs = llm.generate([prompts[i] for i in order], ps)
        return {i: o.outputs[0].token_ids for i, o in zip(order, outs)}

    base = run(make_llm(ckpt), seed, list(range(12)))
    again = run(make_llm(ckpt), seed, list(range(12)))
    assert base == again, f"seed={seed}: same seeds, different tokens"
    shuffled = list(range(12))
    random.Random(seed).shuffle(shuffled)
    assert run(make_llm(ckpt, max_num_seqs=3, overlap=False), seed, shuffled) == base, (
        f"seed={seed}: batch composition changed samples"
    )
    assert run(make_llm(ckpt, max_num_seqs=5, max_num_batched_tokens=7), seed, shuffled[:6]) == {
        i: base[i] for i in shuffled[:6]
    }
    other = run(make_llm(ckpt), seed + 1000, list(range(12)))
    assert sum(other[i] != base[i] for i in range(12)) >= 10, f"seed={seed}: different seeds should differ"


def test_overlap_matches_sync_and_runs_ahead(ckpt) -> None:
    seed = random.SystemRandom().randrange(2**31)
    reqs = _requests(seed, 10, 300)
    ps = [SamplingParams(temperature=0.8, max_tokens=m, seq_seed=seed + i) for i, (_, m) in enumerate(reqs)]
    on = make_llm(ckpt, overlap=True, max_num_batched_tokens=32)
    off = make_llm(ckpt, overlap=False, max_num_batched_tokens=32)
    a = on.generate([p for p, _ in reqs], ps)
    b = off.generate([p for p, _ in reqs], ps)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b], f"seed={seed}"
    ev = on.last_events
    # with overlap, step N+1 is scheduled and launched before step N's results are read
    for n in range(on.last_stats.steps - 1):
        assert ev.index(("launch", n + 1)) < ev.index(("read", n)), (
            f"step {n + 1} not launched before reading {n}: {ev[:12]}"
        )
    ev = off.last_events
    for n in range(off.last_stats.steps - 1):
        assert ev.index(("read", n)) < ev.index(("schedule", n + 1))


def test_prompt_export_then_completion_equals_normal(ckpt, tmp_path) -> None:
    seed = random.SystemRandom().randrange(2**31)
    reqs = _requests(seed, 6, 300)
    prompts = [p for p, _ in reqs]
    ps = SamplingParams(temperature=0.7, max_tokens=9, ignore_eos=True, seq_seed=seed)
    normal = make_llm(ckpt).generate(prompts, ps)
    make_llm(ckpt, engine_type="prompt", state_dir=tmp_path).generate(prompts, ps)
    done = make_llm(ckpt, engine_type="completion", state_dir=tmp_path).generate(None, ps)
    assert [o.prompt_token_ids for o in done] == prompts
    assert [o.outputs[0].token_ids for o in done] == [o.outputs[0].token_ids for o in normal], f"seed={seed}"


def test_stops_and_abort(ckpt) -> None:
    llm = make_llm(ckpt)
    prompt = "the weather is"
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    tok = llm.tokenizer
    # a stop string spanning the boundary between generated tokens 3 and 4
    pieces = [tok.decode(free.token_ids[:i]) for i in range(13)]
    cut = next(i for i in range(3, 11) if len(pieces[i]) > len(pieces[i - 1]) and len(pieces[i + 1]) > len(pieces[i]))
    stop = pieces[cut][-1] + pieces[cut + 1][len(pieces[cut])]
    at = pieces[12].find(stop)
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == pieces[12][:at], (out.text, pieces[12], stop)
    # a stop token id; and EOS (the model's EOS set to a token it will generate)
    target = free.token_ids[4]
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[target]))[0].outputs[0]
    first = free.token_ids.index(target)
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == target
    model = llm.model
    eos_llm = make_llm(deepinfer_fx.api.Model(model.config.replace(eos_token_ids=(target,)), model.params, model.path))
    out = eos_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    assert out.token_ids[-1] == target and out.finish_reason == "stop" and len(out.token_ids) == first + 1
    out = eos_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == free.token_ids

    # abort one running request mid-way; the others finish untouched
    ids = [llm.add_request(prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)) for _ in range(3)]
    for _ in range(4):
        llm.step()
    aborted = llm.abort(ids[1])
    assert aborted.outputs[0].finish_reason == "abort" and 0 < len(aborted.outputs[0].token_ids) < 12
    finished = []
    while llm.has_unfinished_requests():
        finished += [o for o in llm.step() if o.finished]
    assert sorted(o.request_id for o in finished) == [ids[0], ids[2]]
    assert all(o.outputs[0].token_ids == free.token_ids for o in finished)
    assert llm.pool.num_free == llm.pool.slots


def test_pool_exhaustion_queues(ckpt) -> None:
    seed = random.SystemRandom().randrange(2**31)
    llm = make_llm(ckpt, max_num_seqs=8)
    assert llm.plan.slots == 8
    reqs = _requests(seed, 200, 300)
    outs = llm.generate(
        [p for p, _ in reqs], [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    )
    assert all(o.finished and len(o.outputs[0].token_ids) == m for o, (_, m) in zip(outs, reqs))
    assert llm.pool.num_free == llm.pool.slots and llm.pool.free_pages == llm.pool.num_pages


def test_bad_input_is_rejected_and_loses_nothing(ckpt) -> None:
    llm = make_llm(ckpt)
    running = llm.add_request([5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    llm.step()
    with pytest.raises(ValueError, match="top_p"):
        llm.add_request([1, 2], SamplingParams(top_p=1.5))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.add_request(list(range(3, 3 + MAX_LEN)), SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="token ids"):
        llm.add_request([1, 10**6])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[5, 6], list(range(3, 3 + MAX_LEN))])  # validated before anything runs
    done = []
    while llm.has_unfinished_requests():
        done += [o for o in llm.step() if o.finished]
    assert [o.request_id for o in done] == [running] and len(done[0].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="max_model_len"):
        make_llm(ckpt, max_model_len=10**9)
    with pytest.raises(ValueError, match="bad mesh"):
        make_llm(ckpt, mesh="tp8")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphs_recaptured_after_reset_and_in_a_second_engine(ckpt) -> None:
    """Decode replays CUDA graphs from a pool its steps own. Dropping every graph (an EPLB
    shuffle's reset, or a first engine going away, as the mesh bench's one-GPU reference does)
    retires that pool; capturing again must take a fresh one, and give the same tokens."""
    seed = random.SystemRandom().randrange(2**31)
    reqs = _requests(seed, 6, 300)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for _, m in reqs]

    def run(llm: LLM) -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate([p for p, _ in reqs], params)]

    first = LLM(
        ckpt, dtype="float32", device="cuda", fake_quant=False, max_model_len=MAX_LEN, inductor=False, warmup=False
    )
    want = run(first)
    first.runner.steps.reset()
    assert run(first) == want, f"seed={seed}: after reset"
    del first
    gc.collect()
    second = LLM(
        ckpt, dtype="float32", device="cuda", fake_quant=False, max_model_len=MAX_LEN, inductor=False, warmup=False
    )
    assert run(second) == want, f"seed={seed}: second engine"
    assert any(r["captured"] for r in second.runner.steps.report()), "decode was not replayed from a graph"
