"""SamplingParams: what a user asks of one request's decoding, validated once at construction.

The engine turns these into per-row device tensors (``engine.sampler.SamplingTensors``); keeping
all validation here means the device code never has to guard against a bad value, and a user
sees a clear error naming the field before anything is scheduled.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .so_args import SO_KEYS, SoSpec, parse_so_args  # noqa: F401  (SO_KEYS: re-exported)

MAX_LOGPROBS = 20  # top-logprob count per token; bounds the static [B, k] buffers of the runner
SEED_LIMIT = 2**63  # seeds live in an int64 device tensor


def _err(name: str, allowed: str, value: Any) -> ValueError:
    return ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}")


def _is_int(v: Any) -> bool:
    # bool is an int subclass, but top_k=True is always a mistake, never a count.
    return isinstance(v, int) and not isinstance(v, bool)


def _is_real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _float_in(name: str, v: Any, lo: float, hi: float, lo_open: bool, allowed: str) -> float:
    if not _is_real(v) or not math.isfinite(v):
        raise _err(name, allowed, v)
    v = float(v)
    if (v <= lo if lo_open else v < lo) or v > hi:
        raise _err(name, allowed, v)
    return v


def _optional_count(name: str, v: Any) -> int | None:
    if v is None:
        return None
    if not _is_int(v) or not 0 <= v <= MAX_LOGPROBS:
        raise _err(name, f"None or an int in [0, {MAX_LOGPROBS}]", v)
    return v


def _normalise_stop(v: Any) -> tuple[str, ...]:
    allowed = "None, a non-empty str or a list of non-empty str"
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, Sequence) or not all(isinstance(s, str) and s for s in items):
        raise _err("stop", allowed, v)
    # Duplicates would only cost the detokenizer extra scans; drop them, keep the user's order.
    return tuple(dict.fromkeys(items))


def _normalise_stop_ids(v: Any) -> tuple[int, ...]:
    allowed = "None or a list of ints >= 0"
    if v is None:
        return ()
    if isinstance(v, (str, bytes)) or not isinstance(v, Sequence):
        raise _err("stop_token_ids", allowed, v)
    if not all(_is_int(t) and t >= 0 for t in v):
        raise _err("stop_token_ids", allowed, v)
    return tuple(v)


@dataclass(frozen=True)
class SamplingParams:
    """Decoding controls of one request, spelled as in vLLM.

    ``temperature`` 0 means greedy. ``top_k`` -1 or 0 disables top-k. ``logprobs`` /
    ``prompt_logprobs`` give the number of top alternatives reported per token (0 = only the chosen
    token's). ``seq_seed`` fixes the request's random stream; None lets the engine derive one
    from its own seed and the request index, so runs are reproducible either way. After
    construction ``stop`` and ``stop_token_ids`` are tuples. ``so_args``: structured output
    (``engine/so_args.py``: a regex, a JSON schema or an EBNF grammar the output must match).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_tokens: int = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    seq_seed: int | None = None
    so_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # frozen: normalised values go in through object.__setattr__, exactly once, here.
        def put(name: str, value: Any) -> None:
            object.__setattr__(self, name, value)

        put(
            "temperature",
            _float_in("temperature", self.temperature, 0.0, math.inf, False, "a finite float >= 0 (0 = greedy)"),
        )
        put("top_p", _float_in("top_p", self.top_p, 0.0, 1.0, True, "in (0, 1]"))
        if not _is_int(self.top_k) or not (self.top_k >= 1 or self.top_k in (-1, 0)):
            raise _err("top_k", "-1 or 0 (off) or an int >= 1", self.top_k)
        put("min_p", _float_in("min_p", self.min_p, 0.0, 1.0, False, "in [0, 1]"))
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise _err("max_tokens", "an int >= 1", self.max_tokens)
        put("stop", _normalise_stop(self.stop))
        put("stop_token_ids", _normalise_stop_ids(self.stop_token_ids))
        if not isinstance(self.ignore_eos, bool):
            raise _err("ignore_eos", "a bool", self.ignore_eos)
        put("logprobs", _optional_count("logprobs", self.logprobs))
        put("prompt_logprobs", _optional_count("prompt_logprobs", self.prompt_logprobs))
        if self.seq_seed is not None and (not _is_int(self.seq_seed) or not 0 <= self.seq_seed < SEED_LIMIT):
            raise _err("seq_seed", "None or an int in [0, 2**63)", self.seq_seed)
        spec = parse_so_args(self.so_args)
        # a private copy: the caller mutating its dict later must not change a frozen request
        put("so_args", None if spec is None else dict(self.so_args))
        object.__setattr__(self, "_so_spec", spec)  # not a field: equality and hash stay on so_args

    @property
    def so_spec(self) -> SoSpec | None:
        """The structured-output request normalised (``so_args.SoSpec``), None when unconstrained."""
        return self._so_spec

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def top_k_or_off(self) -> int:
        """top_k as the device tensors spell it: 0 = off (users may also write -1)."""
        return max(self.top_k, 0)
