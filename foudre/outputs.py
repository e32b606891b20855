"""What the engine hands back per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum


class ErrorCode(StrEnum):
    """Why a request ended with ``finish_reason "error"`` (``RequestOutput.error_code``), so
    that a caller maps the failure to its answer without reading the message."""

    # its grammar admits none of the tokens its own parameters allow (``error_params`` names
    # them): the request's fault, a client error
    GRAMMAR_DEAD_END = "grammar_dead_end"
    STEP_FAILED = "step_failed"  # the engine failed computing it: a server error


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence. ``text`` and ``token_ids`` are cumulative; the ``delta_`` fields
    hold what this step added (what a stream sends)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    # "stop" | "length" | "abort" | "error" (a step that computed it failed) | None while running
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    score: float | None = None  # a beam search hypothesis: its length-normalised score

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    num_cached_tokens: int
    num_preemptions: int


@dataclass(slots=True)
class BeamSequence:
    """One hypothesis of a beam search: generated tokens (an end-of-sequence token included),
    their text, the sum of their log-probabilities and why it ended."""

    token_ids: list[int]
    text: str
    cum_logprob: float
    finish_reason: str
    score: float  # cum_logprob / generated length ** length_penalty: what ranks hypotheses


@dataclass(slots=True)
class BeamSearchOutput:
    """The ``beam_width`` hypotheses of one prompt, best first."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # with finish_reason "error": what failed
    error_code: ErrorCode | None = None  # with finish_reason "error": the kind of failure
    error_params: tuple[str, ...] = ()  # the request's parameters that caused it (if any)
