"""A request's state as the engine sees it: token ids and one ``num_computed_tokens`` counter."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from foudre.outputs import ErrorCode
from foudre.sampling_params import SamplingParams
from foudre.structured.grammar import GrammarMatcher


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # a step that computed it failed; the engine serves the rest

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated.

    Layout of its tokens (``num_computed_tokens`` have K/V in the cache)::

        |<------- prompt ------->|<---- output ---->|<- drafts ->|
        |<---- num_computed_tokens ---->|<------ to compute ------->|

    The scheduler only ever asks "compute the next n tokens"; prefill, decode, prefix hits,
    recomputation after preemption and verification of speculative drafts are all that one
    operation. Drafts are never part of ``num_tokens`` (nor hashed into the prefix cache): after
    verification, rejected positions are rolled back out of ``num_computed_tokens``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    status: RequestStatus = RequestStatus.WAITING
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    stop_reason: str | int | None = None
    user_data: Any = None
    cache_salt: str | None = None  # prefix-cache namespace (a tenant): no sharing across salts
    error: str | None = None  # why a request finished with FINISHED_ERROR
    error_code: ErrorCode | None = None  # and its kind
    error_params: tuple[str, ...] = ()  # the parameters that caused it (a client error)
    # structured output: the grammar's state after output_token_ids (None: unconstrained)
    grammar: GrammarMatcher | None = None
    # speculative decoding: draft tokens to verify this step, and the proposer's distributions
    # they were drawn from ([k, vocab]; None = one-hot at each draft, as for n-gram drafts)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    # the other samples of this prompt, forked from it when it samples its first token
    fork_children: list[Request] = field(default_factory=list)
    cohort: Cohort | None = None  # requests admitted and preempted together (a beam search)
    # what its K/V's RoPE positions were shifted by (KVCacheManager.position_offset, fixed at
    # admission: LongRoPE past its original context), which every row of it passes on
    position_offset: int = 0

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(self.sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        """Token ids in positions ``[start, end)`` of prompt + output, without copying both."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def input_token_ids(self, start: int, end: int) -> list[int]:
        """Token ids in ``[start, end)`` of prompt + output + draft tokens."""
        n = self.num_tokens
        if end <= n:
            return self.token_ids_range(start, end)
        return self.token_ids_range(start, n) + self.spec_token_ids[max(start - n, 0) : end - n]

    def clear_spec(self) -> None:
        if self.spec_token_ids:  # (an empty list stays: nothing appends to it in place)
            self.spec_token_ids = []
        self.spec_probs = None

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def num_seats(self) -> int:
        """Running slots this request takes once admitted: itself and its pending forks."""
        return 1 + len(self.fork_children)


@dataclass(slots=True, eq=False)
class Cohort:
    """Requests that run as one: the scheduler admits them together (all or none) and
    preempts them together, so that none waits for a sibling that cannot run (the beams of a
    beam search advance in lockstep). ``members`` are the live ones; ``seats`` is reserved
    for the whole cohort at admission."""

    members: list[Request] = field(default_factory=list)
    seats: int = 1
