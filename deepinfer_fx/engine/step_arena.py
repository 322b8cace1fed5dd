"""The rows a step carries (decode rows, prompt chunks, verify chunks) and the device arena their
inputs are copied into: the host lays a step out once, pads it to its buckets and copies it in one
host->device copy; structured output's token bitmasks sit in static buffers beside it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .step_inputs import Layout, SampledRow, fill, float_bits


@dataclass(frozen=True)
class DecodeRow:
    """One decode request: its slot and position, the sampling controls of its row."""

    slot: int
    start: int
    controls: tuple[int, int, int, int, int]  # step_inputs.SampledRow.controls


@dataclass(frozen=True)
class PrefillChunk:
    """One prompt chunk; ``controls`` None when the chunk samples nothing (not the prompt's end)."""

    slot: int
    start: int
    ids: Sequence[int]
    controls: tuple[int, int, int, int, int] | None = None
    keep_from: int = 0  # compact prefill: the first prompt position the decoder replays (0: every row)


@dataclass(frozen=True)
class VerifyChunk:
    """One speculating request: its last token then its drafts, from position ``start``."""

    slot: int
    start: int
    ids: Sequence[int]
    controls: tuple[int, int, int, int, int]


GREEDY = (0, 0, float_bits(1.0), 0, 0)  # controls of a greedy row: temperature 0


class StepArena:
    """Every step's inputs in one device arena: decode at offset 0, prefill after the largest
    decode region, so a mixed step's inputs reach the device in one copy; verify chunks
    (speculative decoding) after the largest prefill region. ``masks``: structured output's token
    bitmasks per kind, one row per sampled row (static: graphs capture them). Padding rows read
    and write the ``scratch`` slot."""

    def __init__(
        self, device: torch.device, scratch: int, decode: Layout, prefill: Layout, verify: Layout | None, words: int
    ) -> None:
        """``decode`` / ``prefill`` / ``verify``: the largest layout of each kind (``verify``
        None: no verify steps); ``words``: int32 words of a token bitmask row."""
        self.device = device
        self.scratch = scratch
        self._decode_span = decode.size
        self._verify_at = self._decode_span + prefill.size
        self.buffer = torch.zeros(self._verify_at + (verify.size if verify else 0), dtype=torch.long, device=device)
        self.masks = {
            "decode": torch.full((decode.requests, words), -1, dtype=torch.int32, device=device),
            "prefill": torch.full((prefill.requests, words), -1, dtype=torch.int32, device=device),
        }
        if verify is not None:  # a verify chunk's every row samples (row j: after its first j drafts)
            rows = verify.requests * verify.length
            self.masks["verify"] = torch.full((rows, words), -1, dtype=torch.int32, device=device)

    def offset(self, kind: str) -> int:
        return {"decode": 0, "prefill": self._decode_span, "verify": self._verify_at}[kind]

    def region(self, layout: Layout) -> torch.Tensor:
        """``layout``'s region of the arena: every input of its steps."""
        base = self.offset(layout.kind)
        return self.buffer[base : base + layout.size]

    def mask_rows(self, layout: Layout) -> torch.Tensor:
        """The token bitmask rows of ``layout``'s sampled rows."""
        return self.masks[layout.kind][: layout.requests * (layout.length if layout.kind == "verify" else 1)]

    def inputs(self, layout: Layout, rows: Sequence) -> list[int]:
        """``layout``'s region as a host list, from the step's rows of its kind (padding alone: none)."""
        return {"decode": self.decode_inputs, "prefill": self.prefill_inputs, "verify": self.verify_inputs}[
            layout.kind
        ](layout, rows)

    def decode_inputs(self, layout: Layout, rows: Sequence[DecodeRow]) -> list[int]:
        n, pad = len(rows), layout.requests - len(rows)
        model = (
            [r.slot for r in rows] + [self.scratch] * pad + [r.start for r in rows] + [0] * pad + [1] * n + [0] * pad
        )
        sampled = [SampledRow(i, r.slot, r.controls, r.start + 1) for i, r in enumerate(rows)]
        return fill(layout, model, sampled, self.scratch)

    def prefill_inputs(self, layout: Layout, chunks: Sequence[PrefillChunk]) -> list[int]:
        C, L, pad = layout.requests, layout.length, layout.requests - len(chunks)
        tokens: list[int] = []
        for ch in chunks:
            tokens += list(ch.ids)
            tokens += [0] * (L - len(ch.ids))
        tokens += [0] * (L * pad)
        lens = [len(ch.ids) for ch in chunks] + [0] * pad
        if layout.all_rows:
            rows = list(range(C * L))
            at = [c * L + max(n - 1, 0) for c, n in enumerate(lens)]
        else:
            rows = [c * L + max(n - 1, 0) for c, n in enumerate(lens)]
            at = list(range(C))
        model = (
            tokens
            + [ch.slot for ch in chunks]
            + [self.scratch] * pad
            + [ch.start for ch in chunks]
            + [0] * pad
            + lens
            + rows
        )
        if layout.kept:
            model += [ch.keep_from for ch in chunks] + [0] * pad
        sampled = [
            SampledRow(at[c], ch.slot, ch.controls, ch.start + len(ch.ids))
            if ch.controls is not None
            else SampledRow(at[c], self.scratch, GREEDY, 0)
            for c, ch in enumerate(chunks)
        ]
        return fill(layout, model, sampled, self.scratch)

    def verify_inputs(self, layout: Layout, chunks: Sequence[VerifyChunk]) -> list[int]:
        C, L, pad = layout.requests, layout.length, layout.requests - len(chunks)
        tokens: list[int] = []
        for ch in chunks:
            tokens += list(ch.ids) + [0] * (L - len(ch.ids))
        tokens += [0] * (L * pad)
        lens = [len(ch.ids) for ch in chunks] + [0] * pad
        model = (
            tokens + [ch.slot for ch in chunks] + [self.scratch] * pad + [ch.start for ch in chunks] + [0] * pad + lens
        )
        model += list(range(C * L))
        sampled = [SampledRow(0, ch.slot, ch.controls, ch.start) for ch in chunks]
        return fill(layout, model, sampled, self.scratch)

    def copy(self, parts: Sequence[tuple[Layout, list[int]]]) -> None:
        """Every part's inputs in one copy: decode at the arena's start, prefill after the decode
        span, verify after the prefill span."""
        if not parts:
            return
        start = self.offset(parts[0][0].kind)
        host: list[int] = []
        for layout, values in parts:
            host += [0] * (self.offset(layout.kind) - start - len(host))
            host += values
        t = torch.tensor(host, dtype=torch.long)
        if self.device.type != "cpu":
            # a fresh pinned buffer per step: the caching host allocator keeps it alive until the
            # asynchronous copy has run, so the host can fill the next step while this one waits
            t = t.pin_memory()
        self.buffer[start : start + t.numel()].copy_(t, non_blocking=True)
