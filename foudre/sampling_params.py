"""How to pick tokens and when to stop, per request."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from foudre.errors import InvalidParameterError

MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
SEED_RANGE = (-(2**63), 2**63 - 1)  # what a torch.Generator takes


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
    # added to the logits of these token ids before sampling ([-100, 100], as OpenAI's)
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None  # sample only among these

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        floats = ("temperature", "top_p", "min_p", "repetition_penalty")
        for name in (*floats, "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InvalidParameterError(name, f"{name} must be a number, got {value!r}")
            if not math.isfinite(value):
                raise InvalidParameterError(name, f"{name} must be finite, got {value!r}")
        self._check_lists()
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
        if self.seed is not None and not SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]:
            raise InvalidParameterError(
                "seed", f"seed must be a 64-bit signed integer, got {self.seed!r}"
            )

    def _check_lists(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidParameterError(
                "stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}"
            )
        if any(len(s) > MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidParameterError(
                "stop", f"each stop string must be at most {MAX_STOP_STRING_CHARS} characters"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidParameterError(
                "stop_token_ids", f"stop_token_ids takes at most {MAX_STOP_TOKEN_IDS} ids"
            )
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_LOGIT_BIAS:
                raise InvalidParameterError(
                    "logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} entries"
                )
            for token, bias in self.logit_bias.items():
                if not isinstance(token, int) or token < 0:
                    raise InvalidParameterError(
                        "logit_bias", f"logit_bias keys must be token ids, got {token!r}"
                    )
                if not (isinstance(bias, int | float) and -100.0 <= bias <= 100.0):
                    raise InvalidParameterError(
                        "logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r}"
                    )
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids:
                raise InvalidParameterError(
                    "allowed_token_ids", "allowed_token_ids must not be empty"
                )
            if any(t < 0 for t in self.allowed_token_ids):
                raise InvalidParameterError(
                    "allowed_token_ids", "allowed_token_ids must be non-negative token ids"
                )

    def token_ids_in_use(self) -> Sequence[tuple[str, int]]:
        """Every token id these parameters name, with the field that names it (for a check
        against the vocabulary, which only the engine knows)."""
        named = [("stop_token_ids", t) for t in self.stop_token_ids]
        named += [("logit_bias", t) for t in self.logit_bias or ()]
        named += [("allowed_token_ids", t) for t in self.allowed_token_ids or ()]
        return named

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
