"""Structured output (CPU, fp32, a tiny random checkpoint with its tokenizer): every request that
finishes with "stop" matches its regex / validates against its JSON schema / parses by its EBNF
grammar, and one cut by max_tokens is a prefix the grammar accepts, in every sampler mode, mixed
with unconstrained requests, overlap on and off; unconstrained requests keep their tokens; bad
specs fail the request naming it and the engine goes on; a grammar no token can follow ends its
request with an error; the compiled steps enforce it too."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
import torch
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx import LLM, SamplingParams
from deepinfer_fx.engine.sampler import apply_token_mask
from deepinfer_fx.engine.structured import Grammars
from deepinfer_fx.io.tokenizer import build_demo_tokenizer, save_tokenizer

xgr = pytest.importorskip("xgrammar")

TOKENIZER_VOCAB = 300  # the model's logits are 320 wide: ids 300..319 are padding
REGEXES = [r"[0-9]{1,3}-[a-z]{2,4}", r"(yes|no|maybe)( [A-Z][a-z]{0,3}){0,2}\."]
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["ann", "bob", "cy"]},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"type": "integer", "minimum": -50, "maximum": 50}, "minItems": 1, "maxItems": 4},
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["x", "yy"]}, "maxItems": 3},
            "pos": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
                "required": ["x", "ok"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "tags", "pos"],
        "additionalProperties": False,
    },
]
EBNF = 'root ::= expr\nexpr ::= term (("+" | "*") term){0,3}\nterm ::= [0-9]{1,2} | "(" expr ")"'
SETTINGS = [
    dict(temperature=0),
    dict(temperature=1.0),
    dict(temperature=0.9, top_p=0.9),
    dict(temperature=0.7, top_k=5),
]


def _expr_ok(text: str) -> bool:
    """An independent parser of ``EBNF``'s language (recursive descent)."""

    def term(i: int) -> int | None:
        m = re.match(r"[0-9]{1,2}", text[i:])
        if m:
            return i + m.end()
        if text[i : i + 1] == "(":
            j = expr(i + 1)
            return j + 1 if j is not None and text[j : j + 1] == ")" else None
        return None

    def expr(i: int) -> int | None:
        i = term(i)
        for _ in range(3):
            if i is None or text[i : i + 1] not in ("+", "*"):
                break
            i = term(i + 1)
        return i

    return expr(0) == len(text)


def _cases() -> list[tuple[str, dict]]:
    """(name, so_args) in both spellings."""
    out = [(f"regex{i}", {"schema_type": "regex", "schema": r}) for i, r in enumerate(REGEXES)]
    out += [
        (f"json{i}", {"schema_type": "json", "schema": s} if i % 2 else {"json_schema": json.dumps(s)})
        for i, s in enumerate(SCHEMAS)
    ]
    return out + [("ebnf", {"schema_type": "ebnf", "schema": EBNF})]


def _valid(name: str, text: str) -> bool:
    if name.startswith("regex"):
        return re.fullmatch(REGEXES[int(name[5:])], text) is not None
    if name.startswith("json"):
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[int(name[4:])])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return _expr_ok(text)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-so")
    deepinfer_fx.write_random_checkpoint(path, tiny_v4(vocab_size=320), seed=5)
    save_tokenizer(build_demo_tokenizer(TOKENIZER_VOCAB), path)  # narrower than the logits
    return path


def make_llm(ckpt, **kw) -> LLM:
    kw.setdefault("max_model_len", 160)
    return LLM(ckpt, dtype="float32", device="cpu", fake_quant=False, num_threads=1, **kw)


@pytest.fixture(scope="module")
def llm(ckpt):
    return make_llm(ckpt, max_num_seqs=32, max_num_batched_tokens=512)


def _check(llm: LLM, outs, names, params, tag: str) -> dict[str, int]:
    """Every constrained output is valid (stop) or a prefix its grammar accepts (length)."""
    counts = {"stop": 0, "length": 0}
    for o, name, p in zip(outs, names, params):
        c = o.outputs[0]
        if name is None:
            continue
        assert c.finish_reason in ("stop", "length"), (tag, name, c.finish_reason, c.error)
        assert all(t < TOKENIZER_VOCAB for t in c.token_ids), (tag, name, c.token_ids)  # never a padded id
        counts[c.finish_reason] += 1
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == 1 and _valid(name, c.text), (tag, name, p, c.text)
        else:
            m = xgr.GrammarMatcher(llm._grammars.compile(p.so_spec))
            assert all(m.accept_token(t) for t in c.token_ids), (tag, name, p, c.text)
    return counts


@pytest.mark.parametrize("round_", [0, 1])
@pytest.mark.parametrize("overlap", [True, False])
def test_outputs_match_their_grammars(llm, overlap: bool, round_: int) -> None:
    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    llm._loop().overlap = overlap
    names, params = [], []
    for name, so in _cases():
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
    counts = _check(llm, outs, [alln[i] for i in order], [allp[i] for i in order], f"seed={seed} overlap={overlap}")
    assert counts["stop"] >= len(params) // 2, (seed, counts)
    if overlap:
        assert llm.last_stats.synced > 0  # constrained turns read the previous step first
    # the unconstrained requests sample as they do without constrained neighbours
    at = [order.index(len(params) + k) for k in range(len(free))]  # where free request k sat in the batch
    alone = llm.generate([prompts[j] for j in at], free)
    assert [outs[j].outputs[0].token_ids for j in at] == [o.outputs[0].token_ids for o in alone], seed


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


def test_compiled_steps_enforce_the_grammar(ckpt) -> None:
    """One request (one decode bucket, one prefill bucket: the fewest compiles)."""
    llm = make_llm(ckpt, eager=False, warmup=False, max_num_seqs=1, max_num_batched_tokens=16, max_model_len=48)
    for seed in (3, 4):
        params = SamplingParams(temperature=0.9, max_tokens=16, seq_seed=seed, so_args={"regex": REGEXES[0]})
        c = llm.generate([[7, 8, 9]], params)[0].outputs[0]
        assert c.finish_reason == "stop" and re.fullmatch(REGEXES[0], c.text), c
    assert {r["graph"].rsplit("-", 2)[-2:] == ["plain", "masked"] for r in llm.runner.steps.report()} == {True}


@pytest.mark.parametrize("eager", [True, False])
def test_constrained_requests_speculate(ckpt, eager: bool) -> None:
    """Constrained requests with n-gram speculation (drafts from a plain run, every third one
    corrupted, so some are tokens the grammar refuses): each verify row is masked by the grammar
    after the drafts before it, and every request gets exactly its plain-run tokens; compiled too
    (the masked acceptor, one request: the fewest compiles)."""
    from test_spec_decode import oracle

    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    cases = _cases() if eager else _cases()[:1]
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
    _check(llm, got, names, params, f"seed={seed}")
    st = llm.speculator.stats
    assert 0 < st.accepted_tokens < st.draft_tokens, f"seed={seed}: {st}"
    if not eager:
        assert any(r["graph"].startswith("verify") and "-masked" in r["graph"] for r in llm.runner.steps.report())


def test_mask_on_the_device_equals_xgrammars() -> None:
    """``apply_token_mask`` (tensor ops, inside the sampler graph) against xgrammar's own CPU kernel."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 77, generator=g)
    mask = torch.randint(-(2**31), 2**31 - 1, (5, 3), generator=g, dtype=torch.int64).to(torch.int32)
    want = logits.clone()
    xgr.apply_token_bitmask_inplace(want, mask)
    assert torch.equal(apply_token_mask(logits, mask, torch.arange(77)), want)


def test_draft_masks_hook_rolls_back() -> None:
    """The speculative-decoding hook: masks for each draft position up to the first rejected
    token, the matcher left where it was."""
    grammars = Grammars(build_demo_tokenizer(TOKENIZER_VOCAB), 320, (1,), threads=1)
    tok = build_demo_tokenizer(TOKENIZER_VOCAB)
    st = grammars.state(SamplingParams(so_args={"regex": "[0-9]-x"}).so_spec)
    digit, dash, x, y = (tok.token_to_id(s) for s in ("7", "-", "x", "y"))
    mask = torch.zeros(4, 10, dtype=torch.int32)
    assert st.draft_masks([digit, dash, y], mask, 0) == 2  # "y" is refused
    bit = lambda row, t: bool((mask[row, t // 32] >> (t % 32)) & 1)  # noqa: E731
    assert bit(0, digit) and not bit(0, dash) and bit(1, dash) and bit(2, x) and not bit(2, y)
    assert st.accepted == 0 and st.accept(digit) and not st.accept(x)


def test_cli_flags_give_so_args(tmp_path) -> None:
    from deepinfer_fx.cli.arguments import so_args as _so_args
    from deepinfer_fx.cli.parser import build_parser

    schema = tmp_path / "s.json"
    schema.write_text(json.dumps(SCHEMAS[0]))
    grammar = tmp_path / "g.ebnf"
    grammar.write_text(EBNF)
    ap = build_parser()
    for argv, want in (
        (["--regex", "a+"], {"schema_type": "regex", "schema": "a+"}),
        (["--json-schema", str(schema)], {"schema_type": "json", "schema": json.dumps(SCHEMAS[0])}),
        (["--grammar", str(grammar)], {"schema_type": "ebnf", "schema": EBNF}),
        ([], None),
    ):
        assert _so_args(ap, ap.parse_args(argv)) == want
    for argv in (["--regex", "a", "--grammar", str(grammar)], ["--json-schema", str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit):
            _so_args(ap, ap.parse_args(argv))


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
        _check(llm, outs, ["json1"] * 3 + [None], params, f"seed={seed} overlap={overlap}")
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


class _CpuGraph:
    """A stand-in for a CUDA graph on the CPU: capture runs the function once to get its outputs
    and then puts back every tensor it wrote (a real capture runs nothing); replay runs it again
    and copies the results into the captured outputs, as a replay writes the static buffers."""

    def __init__(self, written: list[torch.Tensor]) -> None:
        self.written = written

    def capture(self, fn):
        saved = [t.clone() for t in self.written]
        self.fn, self.out = fn, fn()
        for t, s in zip(self.written, saved):
            t.copy_(s)
        return self.out

    def replay(self) -> None:
        _copy_into(self.out, self.fn())


def _copy_into(dst, src) -> None:
    if isinstance(dst, torch.Tensor):
        if dst is not src:
            dst.copy_(src)
    elif isinstance(dst, tuple):
        for d, s in zip(dst, src):
            _copy_into(d, s)


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    items = tree.values() if isinstance(tree, dict) else tree if isinstance(tree, (list, tuple)) else ()
    return [t for x in items for t in _tensors(x)]


def test_captured_pieces_replay_the_tokens_of_uncaptured_steps(ckpt, monkeypatch) -> None:
    """Compiled steps (aot_eager) with graphs stood in for by ``_CpuGraph``: a masked step's
    sampler graph reads its model part's captured logits (a sampler captured over the first
    call's logits would replay stale ones), so replays with overlap give the tokens of the same
    compiled steps run without graphs and without overlap, constrained and free requests alike."""
    from types import SimpleNamespace

    from deepinfer_fx.engine import graph_runner

    seed = random.SystemRandom().randrange(2**31)
    rng = random.Random(seed)
    llm = make_llm(ckpt, eager=False, warmup=False, max_num_seqs=2, max_num_batched_tokens=16, max_model_len=48)
    params = [
        SamplingParams(temperature=0.9, max_tokens=16, seq_seed=rng.randrange(2**40), so_args={"regex": REGEXES[1]}),
        SamplingParams(temperature=0.8, max_tokens=12, seq_seed=rng.randrange(2**40), ignore_eos=True),
    ]
    prompts = [[rng.randrange(3, TOKENIZER_VOCAB) for _ in range(rng.randint(3, 9))] for _ in params]
    llm._loop().overlap = False
    ref = llm.generate(prompts, params)
    steps = llm.runner.steps
    written = _tensors(steps.state) + [steps.next_token]
    monkeypatch.setattr(graph_runner, "DeviceGraph", lambda device_type, pool: _CpuGraph(written))
    monkeypatch.setattr(graph_runner, "graph_api", lambda device_type: SimpleNamespace(graph_pool_handle=object))
    steps.graphs = True
    steps._entries.clear()  # the compiled pieces stay; their entries capture on their next first call
    llm._loop().overlap = True
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in ref], f"seed={seed}"
    _check(llm, got, ["regex1", None], params, f"seed={seed}")
    report = steps.report()
    decode = [r for r in report if r["graph"].startswith("decode")]
    # every decode graph captured, and replayed (a bucket the seed's batch reached once is not)
    assert decode and all(r["captured"] for r in decode) and any(r["calls"] >= 2 for r in decode), report
    assert {r["pieces"] for r in report if r["graph"].endswith("-masked")} == {2}, report


@pytest.mark.parametrize("missing", ["xgrammar", "pydantic"])
def test_a_missing_xgrammar_or_dependency_is_named(missing: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """xgrammar absent, or present without one of its dependencies: the error names what to install."""
    import builtins

    from deepinfer_fx.engine import structured

    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "xgrammar":
            raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(RuntimeError, match=f"pip install {missing}"):
        structured._xgrammar()
