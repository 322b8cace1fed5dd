"""A step's inputs: one int64 buffer per graph bucket (``buckets``: powers of two), laid out once,
copied to the device once.

Every input of a compiled step (token ids, each chunk's slot, start and length, the logit rows,
and the sampling controls of each sampled row) lives in one flat int64 buffer whose layout
depends only on the bucket (``Layout``). The host fills a pinned copy of it from the
``SchedulerOutputs`` in one pass and the whole step's inputs reach the device in one copy; the
step functions slice it with static offsets, so the same layout serves the eager twin, the
compiled function and a CUDA-graph replay. Floats (temperature, top-p, min-p) travel as their
float32 bit patterns, so one buffer carries every type.

Decode region (R rows):   meta [3, R] (slot, start, length) | sampling [8, R]
Prefill region (C chunks of up to L tokens):
                          tokens [C * L] | meta [3, C] | logit rows [C, or C * L] | keep from [C] | sampling [8, C]
                          (keep from: compact prefill only, ``kept`` > 0: each chunk's replay start)
Verify region (C chunks: a request's last token and its drafts): the prefill layout with every
                          row's logits; its sampling row c holds chunk c's controls, the slot
                          that receives the bonus token and the position of the chunk's row 0's token

Sampling rows (``SAMPLING``): the logit row each sampled token comes from, the slot whose
``next_token`` entry receives it (the scratch slot for a chunk that samples nothing), then the
controls of ``sampler.SamplingTensors``.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from ..sharding.cp import ContextRank
from .sampler import SamplingTensors

SAMPLING = ("row", "write", "temperature", "top_k", "top_p", "min_p", "seed", "position")
FLOAT_FIELDS = frozenset({"temperature", "top_p", "min_p"})


def float_bits(x: float) -> int:
    """The float32 bit pattern of ``x`` as a (signed) int32 value."""
    return struct.unpack("<i", struct.pack("<f", x))[0]


def buckets(limit: int, smallest: int = 1) -> tuple[int, ...]:
    """Powers of two from ``smallest`` up to the first one >= ``limit``."""
    out = [smallest]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return tuple(out)


def bucket_for(n: int, choices: Sequence[int]) -> int:
    for b in choices:
        if b >= n:
            return b
    raise ValueError(f"{n} does not fit the largest bucket {choices[-1]}")


@dataclass(frozen=True)
class Layout:
    """Offsets of one bucket's inputs. ``kind`` is "decode" (``requests`` rows of one token),
    "prefill" (``requests`` chunks of ``length`` tokens; ``all_rows``: logits for every row;
    ``kept`` > 0: V4.1 compact prefill, the decoder replays that many rows per chunk) or
    "verify" (chunks like prefill's, always with every row's logits)."""

    kind: str
    requests: int
    length: int = 1
    all_rows: bool = False
    kept: int = 0

    @property
    def tokens(self) -> int:
        return self.requests * self.length if self.kind != "decode" else 0

    @property
    def logit_rows(self) -> int:
        return self.requests * self.length if self.all_rows or self.kind == "verify" else self.requests

    @property
    def model_size(self) -> int:
        """Entries the model part reads (everything before the sampling rows)."""
        rows = self.logit_rows + (self.requests if self.kept else 0) if self.kind != "decode" else 0
        return self.tokens + 3 * self.requests + rows

    @property
    def size(self) -> int:
        return self.model_size + len(SAMPLING) * self.requests

    def model_part(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[: self.model_size]

    def sampling_part(self, buf: torch.Tensor) -> torch.Tensor:
        return buf[self.model_size : self.size].view(len(SAMPLING), self.requests)

    def split_model(self, part: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The model part -> (tokens, slots, starts, lens, rows, keep from or None) for prefill
        and verify, (slots, starts, lens) for decode."""
        t, r = self.tokens, self.requests
        slots, starts, lens = part[t : t + 3 * r].view(3, r).unbind(0)
        if self.kind == "decode":
            return slots, starts, lens
        rows = part[t + 3 * r : t + 3 * r + self.logit_rows]
        return part[:t], slots, starts, lens, rows, (part[t + 3 * r + self.logit_rows :] if self.kept else None)


class StepSizes:
    """The buckets of a step table (powers of two) and the layout a step of some size runs at:
    its buckets where steps compile, its exact sizes where they run eagerly. ``keep``: V4.1
    compact prefill's KEEP (None: exact prefill); ``context``: a CP rank, whose static split
    (``sharding.cp.split_bucket``) cuts every chunk into ``2 * cp`` pieces of one length."""

    def __init__(
        self,
        compile: bool,
        max_requests: int,
        max_tokens: int,
        max_drafts: int = 0,
        varlen: bool = False,
        keep: int | None = None,
        context: ContextRank | None = None,
    ) -> None:
        self.compile, self.keep, self.context = compile, keep, context
        self.decode_buckets = buckets(max_requests)
        self.request_buckets = buckets(max_requests)
        self.length_buckets = tuple(dict.fromkeys(map(self._length, buckets(max_tokens, min(16, max_tokens)))))
        # a verify chunk is a token and 1..max_drafts drafts, padded to one length: a verify of
        # 2 rows costs 0.96 of one of 4 at batch 1 on an H200, and one bucket a request count
        # warms up k times fewer graphs (docs/decisions.md)
        self.verify_buckets = (tuple(range(2, max_drafts + 2)) if varlen else (max_drafts + 1,)) if max_drafts else ()

    def largest(self) -> tuple[Layout, Layout, Layout | None]:
        """The largest layout of each kind (decode, prefill, verify or None: no verify steps)."""
        kept = int(self.keep is not None)
        return (
            Layout("decode", self.decode_buckets[-1]),
            Layout("prefill", self.request_buckets[-1], self.length_buckets[-1], all_rows=True, kept=kept),
            Layout("verify", self.request_buckets[-1], self.verify_buckets[-1]) if self.verify_buckets else None,
        )

    def _bucket(self, n: int, choices: Sequence[int]) -> int:
        return bucket_for(n, choices) if self.compile else max(n, 1)

    def _length(self, n: int) -> int:
        """A prefill chunk length as the steps run it (a CP rank's: a multiple of ``2 * cp``)."""
        return n if self.context is None else self.context.length(n)

    def decode_layout(self, n: int) -> Layout:
        return Layout("decode", self._bucket(n, self.decode_buckets))

    def prefill_layout(self, n_chunks: int, length: int, all_rows: bool = False) -> Layout:
        """Compact prefill replays at most KEEP rows of a chunk, every row of a step with prompt
        logprobs (its other chunks still replay only theirs: ``PrefillChunk.keep_from``)."""
        n, L = self._bucket(n_chunks, self.request_buckets), self._length(self._bucket(length, self.length_buckets))
        kept = 0 if self.keep is None else L if all_rows else min(L, self.keep)
        return Layout("prefill", n, L, all_rows, kept)

    def verify_layout(self, n_chunks: int, length: int) -> Layout:
        if not self.verify_buckets:
            raise ValueError("these step graphs were built without verify steps (max_drafts=0)")
        return Layout("verify", self._bucket(n_chunks, self.request_buckets), self._bucket(length, self.verify_buckets))


def sampling_tensors(part: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, SamplingTensors]:
    """A sampling part ``[8, R]`` -> (logit row, write slot, ``SamplingTensors``)."""
    row, write, temp, top_k, top_p, min_p, seed, position = part.unbind(0)

    def f32(bits: torch.Tensor) -> torch.Tensor:
        return bits.to(torch.int32).view(torch.float32)

    return row, write, SamplingTensors(f32(temp), top_k, f32(top_p), f32(min_p), seed, position)


@dataclass(frozen=True)
class SampledRow:
    """The host's view of one sampled row: where it came from and how to sample it."""

    row: int  # logit row within the step's logits
    write: int  # slot that receives the token (scratch: none)
    controls: tuple[int, int, int, int, int]  # temperature bits, top_k, top_p bits, min_p bits, seed
    position: int


def fill(layout: Layout, model: list[int], rows: list[SampledRow], scratch: int) -> list[int]:
    """One bucket's buffer as a host list: ``model`` (already laid out, padded) then the
    sampling rows, padded to the bucket with rows that sample into the scratch slot."""
    pad = layout.requests - len(rows)
    filler = SampledRow(0, scratch, (0, 0, float_bits(1.0), 0, 0), 0)
    full = rows + [filler] * pad
    out = list(model)
    out += [r.row for r in full]
    out += [r.write for r in full]
    for j in range(5):
        out += [r.controls[j] for r in full]
    out += [r.position for r in full]
    return out
