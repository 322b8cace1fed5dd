"""Requests as the engine tracks them, and the outputs users get back."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from .detok import TextState
from .sampler import mode_for
from .sampling import SamplingParams
from .step_inputs import float_bits


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request inside the engine. ``num_scheduled`` counts positions handed to the device
    (the host may run ahead of the results by one step); ``output_ids`` holds only tokens the
    host has read back."""

    id: int
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: float = field(default_factory=time.perf_counter)
    status: Status = Status.WAITING
    slot: int | None = None
    num_scheduled: int = 0  # positions whose kv the device has been asked to compute
    num_sampled_scheduled: int = 0  # sampling steps handed to the device
    inflight: int = 0  # steps launched whose results the host has not processed yet
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    finished_at: float | None = None
    imported: bool = False  # COMPLETION engine: state came from an export
    import_path: object = None  # the export directory it came from
    error: str | None = None  # why it ended with finish_reason "error"
    text_state: TextState = field(default_factory=TextState)  # incremental detokenization offsets
    emitted_chars: int = 0  # text handed out so far (streaming deltas start here)
    emitted_tokens: int = 0
    num_draft_tokens: int = 0  # speculative decoding: drafts proposed for this request
    model_drafts: tuple[
        int, ...
    ] = ()  # the model drafter's (MTP-1, DSpark) proposals for the next step (spec_decode.py)
    model_conf: tuple[float, ...] = ()  # DSpark's confidence in each of them (spec_schedule.py)
    num_accepted_tokens: int = 0  # and accepted
    grammar: Any = None  # structured output: the request's structured.GrammarState (None: unconstrained)
    images: Any = None  # vision.requests.ImageInputs of a prompt with images (None: text only)

    @cached_property
    def controls(self) -> tuple[int, int, int, int, int]:
        """The sampling controls of every row this request samples (``step_inputs``), laid out
        once: temperature bits, top-k, top-p bits, min-p bits, seed (final once scheduled)."""
        p = self.params
        return (float_bits(p.temperature), max(p.top_k, 0), float_bits(p.top_p), float_bits(p.min_p), self.seed)

    @cached_property
    def sampler_mode(self) -> str:
        p = self.params
        return mode_for(p.temperature, p.top_k, p.top_p)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefill_done(self) -> bool:
        return self.num_scheduled >= self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None
    finish_reason: str | None  # "stop" (EOS, stop token or stop string), "length", "abort" or "error"
    stop_reason: int | str | None  # the stop string or stop token id that ended it
    delta_text: str = ""  # text new since this request's previous output (streaming)
    delta_token_ids: list[int] = field(default_factory=list)
    error: str | None = None  # finish_reason "error": what went wrong


@dataclass(frozen=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_draft_tokens: int = 0  # speculative decoding: drafts proposed (0 without speculation)
    num_accepted_tokens: int = 0  # drafts accepted

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(frozen=True)
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[dict[int, float] | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics


def visible_text(seq: Sequence) -> str:
    """The text a user may see so far: while a request runs, the tail that could still turn
    out to be the start of a stop string is held back."""
    stops = seq.params.stop
    if seq.finished or not stops:
        return seq.text
    return seq.text[: max(0, len(seq.text) - max(len(x) for x in stops) + 1)]


def to_output(seq: Sequence) -> RequestOutput:
    """The request as it stands, with the text and tokens new since its previous output."""
    p = seq.params
    text = visible_text(seq)
    delta_text, delta_ids = text[seq.emitted_chars :], seq.output_ids[seq.emitted_tokens :]
    seq.emitted_chars, seq.emitted_tokens = len(text), len(seq.output_ids)
    return RequestOutput(
        request_id=seq.id,
        prompt=seq.prompt,
        prompt_token_ids=list(seq.prompt_ids),
        prompt_logprobs=list(seq.prompt_logprobs) if p.prompt_logprobs is not None else None,
        outputs=[
            CompletionOutput(
                0,
                text,
                list(seq.output_ids),
                list(seq.logprobs) if p.logprobs is not None else None,
                seq.finish_reason,
                seq.stop_reason,
                delta_text,
                list(delta_ids),
                seq.error,
            )
        ],
        finished=seq.finished,
        metrics=RequestMetrics(
            seq.arrival,
            seq.first_scheduled,
            seq.first_token,
            seq.finished_at,
            seq.num_draft_tokens,
            seq.num_accepted_tokens,
        ),
    )
