"""deepinfer_fx.engine.sampling: SamplingParams validation (each bad value names its field and the
allowed range), normalisation of stop strings / stop ids, structured-output arguments, frozen."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from deepinfer_fx.engine.sampling import MAX_LOGPROBS, SEED_LIMIT, SO_KEYS, SamplingParams

RNG = random.SystemRandom()

NAN, INF = float("nan"), float("inf")

# (field, bad values): every one must raise ValueError naming the field.
INVALID = [
    ("temperature", [-0.1, -1, NAN, INF, -INF, "1.0", None, True]),
    ("top_p", [0, 0.0, -0.5, 1.5, 1.0000001, NAN, INF, "0.5", None, False]),
    ("top_k", [-2, -100, 1.0, 2.5, "3", None, True]),
    ("min_p", [-0.01, 1.01, NAN, INF, "0.1", None]),
    ("max_tokens", [0, -1, 1.5, "16", None, True]),
    ("stop", ["", [""], ["ok", ""], [1], ["a", None], 5, b"x"]),
    ("stop_token_ids", [[-1], [1, -5], [1.0], ["2"], [True], 3, "12"]),
    ("ignore_eos", [1, 0, "yes", None]),
    ("logprobs", [-1, MAX_LOGPROBS + 1, 100, 1.0, "5", True]),
    ("prompt_logprobs", [-1, MAX_LOGPROBS + 1, 2.0, "0", False]),
    ("seq_seed", [-1, SEED_LIMIT, 2**64, 1.5, "7", True]),
    ("so_args", ["regex", ["regex"], 5]),
]


@pytest.mark.parametrize("field,values", INVALID, ids=[f for f, _ in INVALID])
def test_invalid_values_name_their_field(field: str, values: list) -> None:
    for v in values:
        with pytest.raises(ValueError) as e:
            SamplingParams(**{field: v})
        assert f"SamplingParams.{field}" in str(e.value), (field, v, str(e.value))


def test_error_message_states_allowed_range() -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.top_p must be in \(0, 1\], got 1\.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\]"):
        SamplingParams(min_p=2)
    with pytest.raises(ValueError, match=r"logprobs must be None or an int in \[0, 20\]"):
        SamplingParams(logprobs=21)


def test_defaults_and_valid_extremes() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.max_tokens) == (1.0, 1.0, -1, 0.0, 16)
    assert p.stop == () and p.stop_token_ids == () and p.so_args is None and not p.greedy
    seed = RNG.randrange(SEED_LIMIT)
    q = SamplingParams(
        temperature=0,
        top_p=1e-9,
        top_k=0,
        min_p=1,
        max_tokens=1,
        logprobs=0,
        prompt_logprobs=MAX_LOGPROBS,
        seq_seed=seed,
        ignore_eos=True,
    )
    assert q.greedy and q.seq_seed == seed, seed
    assert isinstance(q.temperature, float) and isinstance(q.min_p, float)
    assert SamplingParams(seq_seed=0).seq_seed == 0
    assert SamplingParams(seq_seed=SEED_LIMIT - 1).seq_seed == SEED_LIMIT - 1
    assert SamplingParams(top_k=1).top_k_or_off == 1 and SamplingParams(top_k=-1).top_k_or_off == 0
    assert SamplingParams(temperature=1e-5).greedy is False


def test_random_valid_params_roundtrip() -> None:
    seed = RNG.randrange(2**32)
    rng = random.Random(seed)
    for _ in range(200):
        kw = dict(
            temperature=rng.choice([0, rng.uniform(0, 5)]),
            top_p=rng.uniform(1e-6, 1.0),
            top_k=rng.choice([-1, 0, rng.randrange(1, 1000)]),
            min_p=rng.uniform(0, 1),
            max_tokens=rng.randrange(1, 10000),
            logprobs=rng.choice([None, rng.randrange(0, MAX_LOGPROBS + 1)]),
            seq_seed=rng.choice([None, rng.randrange(SEED_LIMIT)]),
        )
        p = SamplingParams(**kw)
        assert dataclasses.replace(p) == p, (seed, kw)
        assert p.greedy == (kw["temperature"] == 0), (seed, kw)


def test_stop_normalisation() -> None:
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=("x",)).stop == ("x",)
    assert SamplingParams(stop=["b", "a", "b"]).stop == ("b", "a")  # order kept, duplicates gone
    assert SamplingParams(stop=[]).stop == ()
    assert SamplingParams(stop_token_ids=[3, 0, 7]).stop_token_ids == (3, 0, 7)
    assert SamplingParams(stop_token_ids=None).stop_token_ids == ()
    p = SamplingParams(stop=["a"], stop_token_ids=[1])
    assert isinstance(p.stop, tuple) and isinstance(p.stop_token_ids, tuple)
    hash(p)  # tuples, not lists: hashable when so_args is None


def test_so_args_valid() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for so in [
        {"json_schema": schema},
        {"json_schema": json.dumps(schema)},
        {"regex": r"\d{3}-[a-z]+"},
        {"choice": ["yes", "no"]},
        {"grammar": 'root ::= "a" | "b"'},
        {"schema_type": "json", "schema": schema},
        {"schema_type": "json_schema", "schema": json.dumps(schema)},
        {"schema_type": "regex", "schema": "a+"},
        {"schema_type": "ebnf", "schema": 'root ::= "a"'},
    ]:
        p = SamplingParams(so_args=so)
        assert p.so_args == so


def test_so_args_forms_normalise_alike() -> None:
    """DeepInfer's form and vLLM's keys give one spec (the compiled-grammar cache's key)."""
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    json_forms = [
        {"json_schema": schema},
        {"json_schema": json.dumps(schema)},
        {"schema_type": "json", "schema": schema},
        {"schema_type": "json_schema", "schema": json.dumps(schema)},
    ]
    specs = {SamplingParams(so_args=so).so_spec for so in json_forms}
    assert len(specs) == 1 and next(iter(specs)).kind == "json"
    assert json.loads(next(iter(specs)).text) == schema and list(json.loads(next(iter(specs)).text)["properties"]) == [
        "b",
        "a",
    ]
    assert (
        SamplingParams(so_args={"regex": "x"}).so_spec
        == SamplingParams(so_args={"schema_type": "regex", "schema": "x"}).so_spec
    )
    assert SamplingParams(so_args={"choice": ["a", 'q"t']}).so_spec == ("ebnf", 'root ::= "a" | "q\\"t"')
    assert SamplingParams().so_spec is None


def test_so_args_copy_is_private() -> None:
    so = {"regex": "a+"}
    p = SamplingParams(so_args=so)
    so["regex"] = "("
    assert p.so_args == {"regex": "a+"}


@pytest.mark.parametrize(
    "so,needle",
    [
        ({}, "json_schema"),
        ({"regex": "a", "choice": ["a"]}, "exactly one"),
        ({"jsonschema": {}}, "'jsonschema'"),
        ({"regex": "a", "foo": 1}, "'foo'"),
        ({"json_schema": "{not json"}, "so_args['json_schema']"),
        ({"json_schema": "[1, 2]"}, "so_args['json_schema']"),
        ({"json_schema": 5}, "so_args['json_schema']"),
        ({"regex": ""}, "so_args['regex']"),
        ({"regex": 5}, "so_args['regex']"),
        ({"choice": []}, "so_args['choice']"),
        ({"choice": "yes"}, "so_args['choice']"),
        ({"choice": ["a", 1]}, "so_args['choice']"),
        ({"grammar": ""}, "so_args['grammar']"),
        ({"grammar": "   "}, "so_args['grammar']"),
        ({"grammar": None}, "so_args['grammar']"),
        ({"schema_type": "xml", "schema": "x"}, "so_args['schema_type']"),
        ({"schema_type": "json"}, "'schema'"),
        ({"schema_type": "json", "schema": "[1]"}, "so_args['schema']"),
        ({"schema_type": "regex", "schema": 5}, "so_args['schema']"),
        ({"schema_type": "ebnf", "schema": "x", "regex": "y"}, "'regex'"),
    ],
)
def test_so_args_invalid(so: dict, needle: str) -> None:
    with pytest.raises(ValueError) as e:
        SamplingParams(so_args=so)
    msg = str(e.value)
    assert "SamplingParams.so_args" in msg and needle in msg, (so, msg)
    if "schema_type" not in so and (not any(k in SO_KEYS for k in so) or any(k not in SO_KEYS for k in so)):
        assert all(k in msg for k in SO_KEYS), msg  # unknown/empty keys: list the allowed ones


def test_frozen() -> None:
    p = SamplingParams(temperature=0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 1.0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.stop = ("x",)  # type: ignore[misc]
    # replace() goes through __post_init__ again, so it validates too.
    with pytest.raises(ValueError, match="SamplingParams.top_k"):
        dataclasses.replace(p, top_k=-3)
    assert dataclasses.replace(p, top_k=5).top_k == 5
