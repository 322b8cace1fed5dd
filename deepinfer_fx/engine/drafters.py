"""Drafters: who proposes the tokens a verify step scores.

``NgramDrafter`` is prompt lookup (vLLM's ``ngram``): find the latest earlier occurrence of the
context's last n tokens (n from ``prompt_lookup_max`` down to ``prompt_lookup_min``) and
propose the tokens that followed it, continued periodically where they reach the context's end. It needs no weights and runs on the host over the tokens
the host has read back, which is why a speculating request waits for its previous step's
results before its next step is scheduled (``scheduler.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramDrafter:
    def __init__(self, num_tokens: int, lookup_min: int, lookup_max: int) -> None:
        if not 1 <= lookup_min <= lookup_max or num_tokens < 1:
            raise ValueError(
                f"ngram drafter: need 1 <= lookup_min <= lookup_max and num_tokens >= 1, "
                f"got {lookup_min}, {lookup_max}, {num_tokens}"
            )
        self.k, self.lo, self.hi = num_tokens, lookup_min, lookup_max

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` draft tokens to follow ``tokens`` (none when no suffix recurs)."""
        k = min(self.k, limit)
        if k < 1 or len(tokens) < self.lo + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.hi, len(arr) - 1), self.lo - 1, -1):
            suffix = arr[-n:]
            # windows of n tokens that end before the suffix itself: the latest match wins
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                at = int(hits[-1]) + n
                # past the end the match overlaps the suffix: the continuation repeats with period
                # len(arr) - at, so a loop of three tokens drafts k, not three
                out = arr[at : at + k].tolist()
                while len(out) < k:
                    out.append(out[at + len(out) - len(arr)])
                return out
        return []
