"""Structured output with xgrammar: grammars compiled once, one matcher per request, token masks.

``Grammars`` turns a request's ``SoSpec`` into a compiled grammar (cached by spec: each distinct
regex, schema or grammar compiles once per engine) and a ``GrammarState`` (one xgrammar
``GrammarMatcher``). Before a step the runner asks each constrained row's state for its token
bitmask (``fill_masks``: int32 ``[rows, ceil(V / 32)]``, bit ``i % 32`` of word ``i // 32`` set
where token i may come next; unconstrained rows all ones); the sampler applies it on the device
(``sampler.apply_token_mask``). After the step the loop feeds the sampled token back
(``GrammarState.accept``). ``V`` is the model's logits width, which may exceed the tokenizer's
vocabulary: the padded ids are special tokens to xgrammar and never allowed.

Speculative decoding hook: ``GrammarState.draft_masks`` fills one mask per draft position
(accepting the draft's tokens in turn, stopping at the first the grammar rejects) and rolls the
matcher back, so the verify step can be masked; ``rollback`` undoes tokens the verifier refused.
"""

from __future__ import annotations

import json
from typing import Any, Sequence

import numpy as np
import torch

from .so_args import SoSpec

# xgrammar accepts runs of whitespace between JSON tokens of any length unless told otherwise; a
# model (random weights in tests, a confused one in production) can then emit spaces until
# max_tokens. A bound keeps "any whitespace" for formatted output but makes the run finite.
JSON_MAX_WHITESPACE = 16


def _xgrammar():
    """Imported on first use: xgrammar imports transformers (seconds), which unconstrained runs never need."""
    try:
        import xgrammar
    except ImportError as e:  # a dependency in pyproject.toml; a hand-made environment may lack it
        if e.name in (None, "xgrammar"):
            raise RuntimeError("structured output (SamplingParams.so_args) needs xgrammar: pip install xgrammar") from e
        raise RuntimeError(  # xgrammar is there, one of its own dependencies is not
            f"structured output (SamplingParams.so_args) needs xgrammar, which cannot import {e.name!r}: "
            f"pip install {e.name} (or reinstall xgrammar with its dependencies)"
        ) from e
    return xgrammar


def mask_words(vocab_size: int) -> int:
    """int32 words of one row's token bitmask."""
    return (vocab_size + 31) // 32


def _vocab_type(tokenizer: Any):
    """xgrammar's decoding rule for the tokenizer's token strings, from its decoder."""
    xgr = _xgrammar()
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    types = {d.get("type") for d in parts}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL, False
    if "ByteFallback" in types:  # sentencepiece-style: "▁" for a space, <0xNN> for bytes
        return xgr.VocabType.BYTE_FALLBACK, "Metaspace" in types or "Strip" in types
    return xgr.VocabType.RAW, False


class GrammarState:
    """One request's matcher: which tokens may come next, and the tokens it has accepted."""

    def __init__(self, compiled: Any, stop_ids: Sequence[int]) -> None:
        self.matcher = _xgrammar().GrammarMatcher(compiled, override_stop_tokens=list(stop_ids))
        self.stop_ids = tuple(stop_ids)
        self.accepted = 0  # tokens accepted: the runner checks the loop fed back every sampled one

    def fill(self, mask: torch.Tensor, row: int) -> bool:
        """Write this request's next-token bitmask into ``mask[row]``; False when the grammar
        allows no token at all (the request cannot go on). A terminated matcher allows EOS alone
        (its request ends when the host reads the token that terminated it)."""
        if self.terminated:
            only(mask, row, self.stop_ids[0])
            return True
        self.matcher.fill_next_token_bitmask(mask, row)
        return bool(mask[row].any())

    def accept(self, token: int) -> bool:
        ok = self.matcher.accept_token(token)
        self.accepted += int(ok)
        return ok

    @property
    def terminated(self) -> bool:
        """The grammar is complete and its stop token (EOS) was accepted."""
        return self.matcher.is_terminated()

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (speculative drafts the verifier refused)."""
        if n:
            self.matcher.rollback(n)
            self.accepted -= n

    def draft_masks(self, draft: Sequence[int], mask: torch.Tensor, row: int) -> int:
        """Masks for a verify step over ``draft``: row ``row + j`` holds the mask after the first
        j draft tokens, for j up to the first token the grammar rejects; returns how many draft
        tokens it accepted (the rest of the draft is not worth verifying). The matcher is left
        as it was."""
        n = 0
        while True:
            self.fill(mask, row + n)
            if n == len(draft) or self.terminated or not self.accept(draft[n]):
                break
            n += 1
        self.rollback(n)
        return n


class Grammars:
    """The engine's grammar compiler over its tokenizer, with one compiled grammar per spec."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: Sequence[int], threads: int = 8) -> None:
        xgr = _xgrammar()
        n = tokenizer.get_vocab_size(with_added_tokens=True)
        if n > vocab_size:
            raise ValueError(
                f"the tokenizer has {n} tokens but the model's vocabulary is {vocab_size}: a mismatched checkpoint"
            )
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        # special tokens (BOS, pads, EOS) as empty strings: xgrammar then never lets a grammar spell
        # text with them; EOS comes back as the stop token, allowed where the grammar may end
        vocab = [""] * n
        for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
            vocab[i] = "" if i in special else text
        vocab_type, prefix = _vocab_type(tokenizer)
        info = xgr.TokenizerInfo(
            vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=list(stop_ids), add_prefix_space=prefix
        )
        # xgrammar keeps its own cache too; ours also counts compiles and remembers failures
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.stop_ids = tuple(stop_ids)
        self.vocab_size = vocab_size
        self._compiled: dict[SoSpec, Any] = {}
        self._errors: dict[SoSpec, str] = {}
        self.compiles = 0

    def compile(self, spec: SoSpec) -> Any:
        """The compiled grammar of ``spec``, or a one-line ``ValueError`` with xgrammar's message."""
        if spec in self._errors:
            raise ValueError(self._errors[spec])
        if spec not in self._compiled:
            self.compiles += 1
            try:
                self._compiled[spec] = self._compile(spec)
            except (RuntimeError, ValueError) as e:  # xgrammar's parse errors are RuntimeErrors
                msg = " ".join(str(e).split())
                what = {"regex": "regular expression", "json": "JSON schema", "ebnf": "EBNF grammar"}[spec.kind]
                self._errors[spec] = f"SamplingParams.so_args: invalid {what} ({msg})"
                raise ValueError(self._errors[spec]) from None
        return self._compiled[spec]

    def _compile(self, spec: SoSpec) -> Any:
        if spec.kind == "regex":
            return self.compiler.compile_regex(spec.text)
        if spec.kind == "json":
            return self.compiler.compile_json_schema(spec.text, max_whitespace_cnt=JSON_MAX_WHITESPACE)
        return self.compiler.compile_grammar(spec.text)

    def state(self, spec: SoSpec) -> GrammarState:
        return GrammarState(self.compile(spec), self.stop_ids)


def only(mask: torch.Tensor | np.ndarray, row: int, token: int) -> None:
    """``mask[row]`` allows ``token`` alone."""
    mask[row] = 0
    mask[row, token >> 5] = (1 << (token & 31)) - (1 << 32 if token & 31 == 31 else 0)  # int32 bits


class MaskFiller:
    """Fills a step's token bitmasks, the matchers in parallel (xgrammar's batch matcher: each
    fill is a few to tens of microseconds at a 129k vocabulary, and a step may hold a hundred
    rows), into host buffers kept from step to step: a fresh megabyte a step (pinned on a GPU)
    cost more than the fills themselves (docs/decisions.md)."""

    def __init__(self, threads: int) -> None:
        self.batch = _xgrammar().BatchGrammarMatcher(max_threads=max(threads, 1))
        self._free: dict[tuple[int, int, bool], list[torch.Tensor]] = {}
        self._lent: list[tuple[tuple[int, int, bool], torch.Tensor]] = []

    def _buffer(self, rows: int, words: int, pinned: bool) -> torch.Tensor:
        # lent to the step that copies it until that step is done (give_back): the copy reads it
        # asynchronously, and one step may fill two parts while the step before it still runs
        key = (1 << (rows - 1).bit_length(), words, pinned)  # a few buffers per power-of-two row count
        free = self._free.setdefault(key, [])
        buf = free.pop() if free else torch.empty(key[:2], dtype=torch.int32, pin_memory=pinned)
        self._lent.append((key, buf))
        return buf[:rows]

    def take_lent(self) -> list[tuple[tuple[int, int, bool], torch.Tensor]]:
        """The buffers handed out since the last call (one step's masks), for ``give_back``."""
        lent, self._lent = self._lent, []
        return lent

    def give_back(self, lent: Sequence[tuple[tuple[int, int, bool], torch.Tensor]]) -> None:
        """Return a done step's buffers (``take_lent``) for reuse."""
        for key, buf in lent:
            self._free[key].append(buf)

    def fill(
        self, states: Sequence[GrammarState | None], words: int, pinned: bool, skip: Sequence[int] = ()
    ) -> tuple[torch.Tensor, list[int]]:
        """The host bitmask ``[len(states), words]`` of one step's sampled rows in order
        (``states``: None for an unconstrained row: all ones). Rows in ``skip`` (requests that
        already failed) and rows whose grammar allows no token get token 0 alone, so the step
        stays well defined; returns the mask and the latter rows (the loop ends their requests
        with an error). The mask is the caller's until it gives it back (``take_lent``)."""
        mask = self._buffer(len(states), words, pinned)
        host = mask.numpy()  # per-row writes through numpy: a torch op per row costs microseconds each
        skip = set(skip)
        live, free = [], []
        for i, st in enumerate(states):
            if st is None:
                free.append(i)
            elif i in skip:
                only(host, i, 0)
            elif st.terminated:
                only(host, i, st.stop_ids[0])
            else:
                live.append(i)
        if free:
            host[free] = -1
        if live:
            self.batch.batch_fill_next_token_bitmask([states[i].matcher for i in live], mask, live)
        # every row but a dead grammar's has a bit set; numpy's test reads the mask in place (a
        # torch index-and-test copied it: 0.6 ms at 64 rows of 129k ids, 30 us now)
        dead = np.flatnonzero(~host.any(axis=1)).tolist()
        for i in dead:
            only(host, i, 0)
        return mask, dead
