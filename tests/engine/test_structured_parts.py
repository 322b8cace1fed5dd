"""The pieces of structured output that need no model: the token mask applied on the device
against xgrammar's own kernel, the speculative-decoding draft-mask hook, the CLI flags that give
``so_args``, and the error that names a missing xgrammar or dependency."""

from __future__ import annotations

import json

import pytest
import torch
from structured_helpers import EBNF, SCHEMAS, TOKENIZER_VOCAB, xgr

from deepinfer_fx import SamplingParams
from deepinfer_fx.engine.sampler import apply_token_mask
from deepinfer_fx.engine.structured import Grammars, MaskFiller, mask_words
from deepinfer_fx.io.tokenizer import build_demo_tokenizer


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


def test_a_steps_mask_buffers_wait_until_it_is_done() -> None:
    """A step may fill two parts (decode, prefill) while the step before it still copies its own
    masks: a buffer lent to a step is handed out again only once that step gives it back."""
    grammars = Grammars(build_demo_tokenizer(TOKENIZER_VOCAB), 320, (1,), threads=1)
    states = [grammars.state(SamplingParams(so_args={"regex": "[0-9]-x"}).so_spec), None]
    filler, words = MaskFiller(1), mask_words(320)
    step = [filler.fill(states, words, pinned=False)[0] for _ in range(2)]  # step N's two parts
    kept = [m.clone() for m in step]
    lent = filler.take_lent()
    later = filler.fill(states[::-1], words, pinned=False)[0]  # step N+1's first part; N still runs
    assert all(torch.equal(m, k) for m, k in zip(step, kept))
    assert later.data_ptr() not in {m.data_ptr() for m in step}
    filler.give_back(lent)
    assert {filler.fill(states, words, pinned=False)[0].data_ptr() for _ in range(2)} == {m.data_ptr() for m in step}


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
