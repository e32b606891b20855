"""How to pick tokens and when to stop, per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from foudre.errors import InvalidParameterError


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping parameters of one request.

    ``temperature == 0`` means greedy. Invalid values raise ``InvalidParameterError`` (a
    ``ValueError``) naming the field, at construction, so a bad request never reaches the
    engine.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: until max_model_len
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top logprobs to return beside the sampled one
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.top_k == -1:
            self.top_k = 0
        checks: list[tuple[str, bool, str]] = [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", self.temperature >= 0.0, "must be non-negative"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1 (disabled), 0 (disabled) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be positive"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= 20, "must be in [0, 20]"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise InvalidParameterError(name, f"{name} {why}, got {getattr(self, name)!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParameterError(
                "min_tokens",
                f"min_tokens must not exceed max_tokens, got {self.min_tokens} > {self.max_tokens}",
            )
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParameterError(
                "stop_token_ids",
                f"stop_token_ids must be non-negative, got {self.stop_token_ids!r}",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
