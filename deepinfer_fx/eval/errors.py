"""The one error type the eval CLI turns into a one-line message, and the JSONL reader whose
errors name the file and line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class EvalError(ValueError):
    """Bad input to an eval command; the message names the file (and line) at fault."""


def json_objects(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line of JSONL file ``path``."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise EvalError(f"{path}: cannot read ({e.strerror})") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise EvalError(f"{path}:{n}: not a JSON line ({e.msg})") from None
        if not isinstance(obj, dict):
            raise EvalError(f"{path}:{n}: expected a JSON object, got {type(obj).__name__}")
        yield n, obj
