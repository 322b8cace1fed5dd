"""Structured output: a regex, a JSON schema and an EBNF grammar, each enforced token by token.

    python examples/structured_output.py                       # the tiny demo model (random weights)
    python examples/structured_output.py --model /path/to/ckpt --max-tokens 256

``so_args`` takes DeepInfer's form ``{"schema_type": "regex" | "json" | "ebnf", "schema": ...}`` (or
vLLM's keys ``regex``, ``json_schema``, ``choice``, ``grammar``). With random weights the content is
nonsense, but every output that ends with finish reason "stop" matches its spec; "length" means
max_tokens cut it short (still a valid prefix).
"""

from __future__ import annotations

import argparse
import json

from deepinfer_fx import LLM, SamplingParams

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["Ada", "Grace", "Edsger"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "languages": {"type": "array", "items": {"type": "string", "enum": ["python", "c", "lisp"]}, "maxItems": 3},
    },
    "required": ["name", "age", "languages"],
    "additionalProperties": False,
}
ARITHMETIC = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= [0-9]{1,3} | "(" expr ")"
"""
REQUESTS = [
    (
        "A date (YYYY-MM-DD):",
        {"schema_type": "regex", "schema": r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"},
    ),
    ("A person as JSON:", {"schema_type": "json", "schema": PERSON}),
    ("An arithmetic expression:", {"schema_type": "ebnf", "schema": ARITHMETIC}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--model", default="demo", help="checkpoint directory, hub repo id, or 'demo' (default: %(default)s)"
    )
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: %(default)s)")
    ap.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default: %(default)s)")
    args = ap.parse_args()

    llm = LLM(model=args.model)
    prompts = [p for p, _ in REQUESTS]
    params = [
        SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seq_seed=i, so_args=so)
        for i, (_, so) in enumerate(REQUESTS)
    ]
    for (prompt, so), out in zip(REQUESTS, llm.generate(prompts, params)):
        c = out.outputs[0]
        print(f"--- {so['schema_type']}: {prompt} ({c.finish_reason})")
        print(c.text)
        if so["schema_type"] == "json" and c.finish_reason == "stop":
            print("parsed:", json.loads(c.text))


if __name__ == "__main__":
    main()
