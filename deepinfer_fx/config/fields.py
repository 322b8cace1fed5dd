"""Shared pieces of config parsing: the error type and field readers that name the field."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe a model we run; the message names the field."""


_REQUIRED = object()


def _need(d: dict, key: str, where: str) -> Any:
    if key not in d or d[key] is None:
        raise ConfigError(f"{where}: required field '{key}' is missing")
    return d[key]


def _num(d: dict, key: str, where: str, kind: type, default: Any = _REQUIRED) -> Any:
    """``kind(d[key])`` (int or float), with the field named when it is missing or not a number."""
    value = _need(d, key, where) if default is _REQUIRED else d.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"{where}: '{key}' must be a number, got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise ConfigError(f"{where}: '{key}' must be a number, got {value!r}") from None
    if kind is int:
        if number != int(number):
            raise ConfigError(f"{where}: '{key}' must be an integer, got {value!r}")
        return int(number)
    return number


def read_json_object(path: Path, missing: str, error: type[ValueError] = ValueError) -> dict:
    """A JSON object from ``path``; a missing file, bad JSON or a non-object raise ``error``
    naming the file (``missing`` says what the file was for)."""
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise error(f"{path}: {missing}") from None
    except json.JSONDecodeError as e:
        raise error(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(d, dict):
        raise error(f"{path}: expected a JSON object")
    return d
