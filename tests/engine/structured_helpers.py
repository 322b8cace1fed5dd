"""Shared pieces of the structured-output tests (test_structured*.py): the regexes, JSON schemas and
EBNF grammar with independent validators, the sampler settings, the tiny checkpoint (a tokenizer
narrower than its logits), the CPU ``LLM`` and the check of constrained outputs. Not a test module."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
from tiny import tiny_v4

import deepinfer_fx
from deepinfer_fx import LLM
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


def expr_ok(text: str) -> bool:
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


def so_cases() -> list[tuple[str, dict]]:
    """(name, so_args) in both spellings."""
    out = [(f"regex{i}", {"schema_type": "regex", "schema": r}) for i, r in enumerate(REGEXES)]
    out += [
        (f"json{i}", {"schema_type": "json", "schema": s} if i % 2 else {"json_schema": json.dumps(s)})
        for i, s in enumerate(SCHEMAS)
    ]
    return out + [("ebnf", {"schema_type": "ebnf", "schema": EBNF})]


def valid(name: str, text: str) -> bool:
    if name.startswith("regex"):
        return re.fullmatch(REGEXES[int(name[5:])], text) is not None
    if name.startswith("json"):
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[int(name[4:])])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return expr_ok(text)


def write_checkpoint(path: Path) -> Path:
    """A tiny random checkpoint in ``path`` with a demo tokenizer narrower than its logits."""
    deepinfer_fx.write_random_checkpoint(path, tiny_v4(vocab_size=320), seed=5)
    save_tokenizer(build_demo_tokenizer(TOKENIZER_VOCAB), path)  # narrower than the logits
    return path


def make_llm(ckpt, **kw) -> LLM:
    kw.setdefault("max_model_len", 160)
    return LLM(ckpt, dtype="float32", device="cpu", fake_quant=False, num_threads=1, **kw)


def check_outputs(llm: LLM, outs, names, params, tag: str) -> dict[str, int]:
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
            assert c.token_ids[-1] == 1 and valid(name, c.text), (tag, name, p, c.text)
        else:
            m = xgr.GrammarMatcher(llm._grammars.compile(p.so_spec))
            assert all(m.accept_token(t) for t in c.token_ids), (tag, name, p, c.text)
    return counts
