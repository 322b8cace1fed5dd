"""``SamplingParams.so_args``: the structured-output request, in DeepInfer's form or vLLM's.

DeepInfer's form is ``{"schema_type": "regex" | "json" | "json_schema" | "ebnf", "schema": ...}``
(a JSON schema as a dict or a JSON string); vLLM's keys are aliases: ``{"json_schema": ...}``,
``{"regex": str}``, ``{"choice": [str, ...]}`` (an EBNF alternation of the literals) and
``{"grammar": str}`` (EBNF). Both normalise to one ``SoSpec`` (kind, text), which is also the
key of the compiled-grammar cache (``structured.Grammars``). Only the shape is checked here;
whether a regex, schema or grammar compiles is xgrammar's call, made when the request is added.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, NamedTuple

SO_KEYS = ("json_schema", "regex", "choice", "grammar")  # vLLM's spelling
SCHEMA_TYPES = {"regex": "regex", "json": "json", "json_schema": "json", "ebnf": "ebnf"}  # DeepInfer's


class SoSpec(NamedTuple):
    """A structured-output request: ``kind`` is "regex", "json" or "ebnf"; ``text`` the pattern,
    the schema as a JSON string, or the grammar."""

    kind: str
    text: str


def _err(name: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


def _json_text(name: str, val: Any) -> str:
    schema = val
    if isinstance(val, str):
        try:
            schema = json.loads(val)
        except json.JSONDecodeError as e:
            raise _err(name, f"a dict or a JSON string of an object (not valid JSON: {e})", val) from None
    if not isinstance(schema, dict):
        raise _err(name, "a dict or a JSON string of an object", val)
    # the given key order is kept: it is the order xgrammar makes the model write the properties
    return json.dumps(schema, ensure_ascii=False)


def _text(name: str, val: Any, what: str) -> str:
    if not isinstance(val, str) or not val.strip():
        raise _err(name, f"a non-empty str ({what})", val)
    return val


def _choice_grammar(name: str, val: Any) -> str:
    if (
        isinstance(val, str)
        or not isinstance(val, Sequence)
        or not val
        or not all(isinstance(c, str) and c for c in val)
    ):
        raise _err(name, "a non-empty list of non-empty str", val)
    # json.dumps escapes quotes, backslashes and control characters as EBNF string literals do
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in dict.fromkeys(val))


def _deepinfer_form(v: dict) -> SoSpec:
    extra = sorted(k for k in v if k not in ("schema_type", "schema"))
    if extra or "schema" not in v:
        raise ValueError(
            f"SamplingParams.so_args in DeepInfer's form holds exactly 'schema_type' and 'schema', got keys {sorted(v)}"
        )
    kind = v["schema_type"]
    if kind not in SCHEMA_TYPES:
        raise _err("so_args['schema_type']", f"one of {', '.join(map(repr, SCHEMA_TYPES))}", kind)
    kind = SCHEMA_TYPES[kind]
    if kind == "json":
        return SoSpec("json", _json_text("so_args['schema']", v["schema"]))
    return SoSpec(
        kind, _text("so_args['schema']", v["schema"], "a regular expression" if kind == "regex" else "an EBNF grammar")
    )


def parse_so_args(v: Any) -> SoSpec | None:
    """``so_args`` -> ``SoSpec`` (None: unconstrained), or a ``ValueError`` naming the field."""
    if v is None:
        return None
    keys = "'schema_type' + 'schema', or exactly one of " + ", ".join(SO_KEYS)
    if not isinstance(v, dict):
        raise _err("so_args", f"None or a dict with {keys}", v)
    if "schema_type" in v:
        return _deepinfer_form(v)
    bad = [k for k in v if k not in SO_KEYS]
    if bad:
        raise ValueError(
            f"SamplingParams.so_args has unknown key {bad[0]!r}; allowed keys: schema_type + schema, {', '.join(SO_KEYS)}"
        )
    if len(v) != 1:
        raise ValueError(f"SamplingParams.so_args must hold {keys}, got keys {sorted(v)}")
    ((key, val),) = v.items()
    name = f"so_args[{key!r}]"
    if key == "json_schema":
        return SoSpec("json", _json_text(name, val))
    if key == "regex":
        return SoSpec("regex", _text(name, val, "a regular expression"))
    if key == "choice":
        return SoSpec("ebnf", _choice_grammar(name, val))
    return SoSpec("ebnf", _text(name, val, "an EBNF grammar"))
