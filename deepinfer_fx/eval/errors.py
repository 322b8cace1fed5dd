"""The one error type the eval CLI turns into a one-line message."""

from __future__ import annotations


class EvalError(ValueError):
    """Bad input to an eval command; the message names the file (and line) at fault."""
