"""Incremental detokenization: each new token costs a decode of a few tokens, not of the whole
output (decoding every output from its start each step made the host's work per step grow with
the output's length).

Per request two offsets into its output ids: ``prefix`` (where the last decode window started)
and ``read`` (tokens already turned into text). The new text is ``decode(ids[prefix:])`` past
``decode(ids[prefix:read])``: decoding both from the same token keeps whatever a decoder does at
the start of a window (a dropped leading space) out of the difference. A window that ends in
U+FFFD is an incomplete UTF-8 character split over tokens: nothing is emitted until the rest
arrives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

Decode = Callable[[Sequence[int]], str]


@dataclass
class TextState:
    prefix: int = 0
    read: int = 0


def next_text(decode: Decode, ids: Sequence[int], st: TextState) -> str:
    """The text that ``ids`` (a request's output ids so far) adds since the last call."""
    before = decode(ids[st.prefix : st.read]) if st.read > st.prefix else ""
    after = decode(ids[st.prefix :])
    if after.endswith("\ufffd") or len(after) <= len(before):
        return ""
    st.prefix, st.read = st.read, len(ids)
    return after[len(before) :]


def rest_text(decode: Decode, ids: Sequence[int], st: TextState) -> str:
    """What ``ids`` add at the end of a request: everything still held back, an incomplete
    character included (as a whole decode would show it)."""
    before = decode(ids[st.prefix : st.read]) if st.read > st.prefix else ""
    after = decode(ids[st.prefix :])
    st.prefix = st.read = len(ids)
    return after[len(before) :] if after.startswith(before) else ""


def find_stop(text: str, stops: Sequence[str], searched: int) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` that ends past ``searched`` (the text's length at
    the last check): only the tail where a new match can end is scanned."""
    if not stops:
        return None
    longest = max(len(s) for s in stops)
    lo = max(0, searched - longest + 1)
    hits = [(i, s) for s in stops if (i := text.find(s, lo)) >= 0]
    return min(hits) if hits else None
