"""Structured output through the engine (CPU, fp32, a tiny random checkpoint with its tokenizer):
every request that finishes with "stop" matches its regex / validates against its JSON schema /
parses by its EBNF grammar, and one cut by max_tokens is a prefix the grammar accepts, in every
sampler mode, mixed with unconstrained requests, overlap on and off; unconstrained requests keep
their tokens; bad specs fail the request naming it and the engine goes on; a grammar no token can
follow ends its request with an error; constrained requests speculate; a step's masks wait for the
previous token. The compiled steps: test_structured_compiled.py; the pieces without a model:
test_structured_parts.py."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from structured_helpers import (
    REGEXES,
    SCHEMAS,
    SETTINGS,
    TOKENIZER_VOCAB,
    check_outputs,
    make_llm,
    so_cases,
    write_checkpoint,
)

from deepinfer_fx import SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("tiny-so"))


@pytest.fixture(scope="module")
def llm(ckpt):
    return make_llm(ckpt, max_num_seqs=32, max_num_batched_tokens=512)


@pytest.mark.parametrize("round_", [0, 1])
@pytest.mark.parametrize("overlap", [True, False])
def test_outputs_match_their_grammars(llm, overlap: bool, round_: int) -> None:
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    llm._loop().overlap = overlap
    names, params = [], []
    for name, so in so_cases():
        for st in SETTINGS:
            names.append(name)
            params.append(SamplingParams(**st, max_tokens=64, seq_seed=rng.randrange(2**40), so_args=so))
    free = [
        SamplingParams(temperature=0.8, max_tokens=rng.randint(4, 12), seq_seed=rng.randrange(2**40), ignore_eos=True)
        for _ in range(4)
    ]
    order = list(range(len(params) + len(free)))
    rng.shuffle(order)  # constrained and unconstrained rows interleaved
    allp = params + free
    alln = names + [None] * len(free)
    prompts = [[rng.randrange(3, TOKENIZER_VOCAB) for _ in range(rng.randint(3, 9))] for _ in order]
    outs = llm.generate(prompts, [allp[i] for i in order])
    counts = check_outputs(
        llm, outs, [alln[i] for i in order], [allp[i] for i in order], f"seed={seed} overlap={overlap}"
    )
    assert counts["stop"] >= len(params) // 2, (seed, counts)
    if overlap:
        assert llm.last_stats.synced > 0  # constrained turns read the previous step first
    # the unconstrained requests sample as they do without constrained neighbours
    at = [order.index(len(params) + k) for k in range(len(free))]  # where free request k sat in the batch
    alone = llm.generate([prompts[j] for j in at], free)
    assert [outs[j].outputs[0].token_ids for j in at] == [o.outputs[0].token_ids for o in alone], seed
    # every step's host mask buffers came back once it was done: two parts a step, two steps in flight
    filler = llm._loop().runner.grammar_masks._filler
    assert not filler._lent and filler._free and all(1 <= len(p) <= 4 for p in filler._free.values())


def test_bad_specs_fail_their_request_and_the_engine_goes_on(llm) -> None:
    bad = [
        ({"regex": "(unclosed"}, "regular expression"),
        ({"schema_type": "json", "schema": {"type": "objec"}}, "JSON schema"),
        ({"grammar": "root ::= foo"}, "EBNF grammar"),
        ({"schema_type": "ebnf", "schema": 'root ::= "a" |'}, "EBNF grammar"),
    ]
    for so, what in bad:
        with pytest.raises(ValueError) as e:
            llm.add_request([5, 6], SamplingParams(so_args=so))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("prompt: SamplingParams.so_args: invalid " + what), msg
        with pytest.raises(ValueError, match=r"^prompts\[1\]: SamplingParams.so_args: invalid"):
            llm.generate([[5], [6], [7]], [SamplingParams(), SamplingParams(so_args=so), SamplingParams()])
    assert not llm.has_unfinished_requests()
    compiles = llm._grammars.compiles
    ok = SamplingParams(temperature=0, max_tokens=20, so_args={"regex": REGEXES[0]})
    outs = llm.generate([[5, 6], [7]], [ok, ok])
    assert llm._grammars.compiles <= compiles + 1  # two requests, one spec: one compile at most
    outs += llm.generate(
        [[8]], [SamplingParams(temperature=0, max_tokens=20, so_args={"schema_type": "regex", "schema": REGEXES[0]})]
    )
    assert llm._grammars.compiles <= compiles + 1  # the other spelling, the same spec
    assert [o.outputs[0].finish_reason for o in outs] == ["stop"] * 3
    assert all(re.fullmatch(REGEXES[0], o.outputs[0].text) for o in outs)


def test_grammar_with_no_spellable_token_ends_with_an_error(ckpt, tmp_path) -> None:
    """A word-level tokenizer that has no "z": the regex can never start, so the request ends
    with finish_reason "error" at once, and its neighbour runs on."""
    for f in Path(ckpt).iterdir():
        if not f.name.startswith("tokenizer"):
            (tmp_path / f.name).symlink_to(f)
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    words = ["a", "b", "c", " "]
    tok = Tokenizer(
        models.WordLevel(
            {"<s>": 0, "</s>": 1, "<pad>": 2, **{w: 3 + i for i, w in enumerate(words)}}, unk_token="<pad>"
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<pad>")])
    tok.save(str(tmp_path / "tokenizer.json"))
    llm = make_llm(tmp_path, max_num_seqs=4, max_num_batched_tokens=64)
    outs = llm.generate(
        [[3, 4], [3]],
        [
            SamplingParams(max_tokens=8, so_args={"regex": "z+"}),
            SamplingParams(temperature=0, max_tokens=8, so_args={"regex": "(a|b)c"}),
        ],
    )
    dead, ok = outs[0].outputs[0], outs[1].outputs[0]
    assert dead.finish_reason == "error" and "allows no token" in dead.error, dead
    assert ok.finish_reason == "stop" and ok.token_ids[-1] == 1 and ok.token_ids[1] == 5, ok


@pytest.mark.parametrize("eager", [True, False])
def test_constrained_requests_speculate(ckpt, eager: bool) -> None:
    """Constrained requests with n-gram speculation (drafts from a plain run, every third one
    corrupted, so some are tokens the grammar refuses): each verify row is masked by the grammar
    after the drafts before it, and every request gets exactly its plain-run tokens; compiled too
    (the masked acceptor, one request: the fewest compiles)."""
    from test_spec_decode import oracle

    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    cases = so_cases() if eager else so_cases()[:1]
    settings = SETTINGS if eager else SETTINGS[:2]
    params = [
        SamplingParams(**st, max_tokens=24, seq_seed=rng.randrange(2**40), so_args=so)
        for _, so in cases
        for st in settings
    ]
    names = [name for name, _ in cases for _ in settings]
    params.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))  # an unconstrained neighbour
    names.append(None)
    prompts = [
        [rng.randrange(3, TOKENIZER_VOCAB) for _ in range(rng.randint(3, 9))] + [len(params) + i]
        for i in range(len(params))
    ]
    kw = (
        dict(max_num_seqs=32, max_num_batched_tokens=512)
        if eager
        else dict(eager=False, warmup=False, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=64)
    )
    plain = make_llm(ckpt, **kw).generate(prompts, params)
    ref = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}
    llm = make_llm(ckpt, speculative_config={"method": "ngram", "num_speculative_tokens": 3}, **kw)
    oracle(llm, ref)
    got = llm.generate(prompts, params)
    for i, (a, b) in enumerate(zip(plain, got)):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, f"seed={seed} request {i} ({names[i]}, {params[i]})"
        assert b.outputs[0].finish_reason == a.outputs[0].finish_reason
    check_outputs(llm, got, names, params, f"seed={seed}")
    st = llm.speculator.stats
    assert 0 < st.accepted_tokens < st.draft_tokens, f"seed={seed}: {st}"
    if not eager:
        assert any(r["graph"].startswith("verify") and "-masked" in r["graph"] for r in llm.runner.steps.report())


def test_masks_are_filled_after_the_forward_and_the_previous_token(llm, monkeypatch) -> None:
    """The order of a constrained step's work, recorded: each matcher alternates fill, accept,
    fill, ... (a mask is never filled before the previous token was accepted); with overlap on,
    step N+1's model part is launched before step N's tokens are fed (and its sampler after
    its masks), with overlap off the tokens are read first."""
    from deepinfer_fx.engine import graph_runner, structured

    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    log: list[tuple] = []
    start, finish = graph_runner.StepGraphs._start, graph_runner.StepGraphs._finish
    accept, fill = structured.GrammarState.accept, structured.MaskFiller.fill

    def rec(name, fn, what):
        def wrapped(self, *a, **kw):
            log.append((name, what(self, *a)))
            return fn(self, *a, **kw)

        return wrapped

    monkeypatch.setattr(graph_runner.StepGraphs, "_start", rec("start", start, lambda s, e: e.key.masked))
    monkeypatch.setattr(graph_runner.StepGraphs, "_finish", rec("finish", finish, lambda s, e, f: e.key.masked))
    monkeypatch.setattr(structured.GrammarState, "accept", rec("accept", accept, lambda s, t: id(s)))
    monkeypatch.setattr(
        structured.MaskFiller, "fill", rec("fill", fill, lambda s, states, *a: [id(st) for st in states if st])
    )
    so = {"schema_type": "json", "schema": SCHEMAS[1]}
    params = [
        SamplingParams(temperature=1.0, max_tokens=24, seq_seed=rng.randrange(2**40), so_args=so) for _ in range(3)
    ]
    params.append(SamplingParams(temperature=0.8, max_tokens=20, seq_seed=rng.randrange(2**40), ignore_eos=True))
    prompts = [[rng.randrange(3, TOKENIZER_VOCAB) for _ in range(rng.randint(3, 9))] for _ in params]
    for overlap in (True, False):
        llm._loop().overlap = overlap
        log.clear()
        outs = llm.generate(prompts, params)
        check_outputs(llm, outs, ["json1"] * 3 + [None], params, f"seed={seed} overlap={overlap}")
        turns = {}  # per matcher: its fills (F) and accepts (A) in order
        for name, what in log:
            for sid in what if name == "fill" else [what] if name == "accept" else []:
                turns.setdefault(sid, []).append("F" if name == "fill" else "A")
        for sid, seq in turns.items():
            assert "".join(seq).replace("FA", "") in ("", "F"), f"seed={seed} overlap={overlap}: {''.join(seq)}"
        # between a masked step's launch and its masks: the previous step's tokens, with overlap only
        fed_meanwhile, launched = 0, False
        for name, what in log:
            if name == "start" and what:
                launched = True
            elif name == "accept" and launched:
                fed_meanwhile += 1
            elif name == "fill":
                launched = False
            elif name == "finish" and what:
                assert not launched, f"seed={seed}: a masked sampler ran before its masks were filled"
        assert (fed_meanwhile > 0) == overlap, (seed, overlap, fed_meanwhile)
