"""How to pick tokens and when to stop, per request."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from foudre.errors import InvalidParameterError

MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
SEED_RANGE = (-(2**63), 2**63 - 1)  # what a torch.Generator takes
MAX_CHOICES = 1024  # StructuredOutput.choice


@dataclass(slots=True)
class StructuredOutput:
    """A language the output must belong to, enforced while decoding: exactly one of

    - ``json_schema``: a JSON Schema (a dict, or its JSON text); the output is one JSON value
      that validates against it (properties in the schema's order, ``", "`` and ``": "`` as
      separators, no additional properties unless the schema allows them);
    - ``json_object=True``: any JSON object;
    - ``regex``: the whole output matches this regular expression;
    - ``choice``: the output is exactly one of these strings;
    - ``grammar``: a context-free grammar in EBNF (GBNF, as llama.cpp and xgrammar write it),
      whose start rule is ``root``.

    Only the form is checked here; the engine compiles the grammar when the request arrives and
    refuses one it cannot enforce (an invalid schema or regex, an unsupported schema keyword)
    with ``InvalidParameterError`` naming ``structured_output``. The output ends (``"stop"``)
    as soon as the grammar admits nothing more.

    ``starts_after``: token ids after which the grammar starts (a thinking model's end of
    reasoning, ``</think>``): until the output has written them, in a row, it is free, then the
    rest of it belongs to the language. None: the grammar starts at the first token.
    ``opened_by``: with ``starts_after``, a token id (``<think>``) that must begin the output
    for the gate to stay closed until ``starts_after``; an output beginning otherwise is the
    grammar's from its first token (a model that may answer without thinking).
    """

    json_schema: dict[str, Any] | bool | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    starts_after: list[int] | None = None
    opened_by: int | None = None

    def __post_init__(self) -> None:
        given = [
            name
            for name in ("json_schema", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidParameterError(
                "structured_output",
                "structured_output takes exactly one of json_schema, regex, choice, grammar, "
                f"json_object; got {', '.join(given) or 'none'}",
            )
        if isinstance(self.json_schema, str):
            try:
                self.json_schema = json.loads(self.json_schema)
            except json.JSONDecodeError as e:
                raise InvalidParameterError(
                    "structured_output", f"json_schema is not valid JSON: {e}"
                ) from None
        if self.json_schema is not None and not isinstance(self.json_schema, dict | bool):
            raise InvalidParameterError(
                "structured_output",
                f"json_schema must be a JSON object, got {type(self.json_schema).__name__}",
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidParameterError(
                    "structured_output", f"{name} must be a non-empty string"
                )
        if self.choice is not None:
            if (
                not isinstance(self.choice, list | tuple)
                or not self.choice
                or not all(isinstance(c, str) for c in self.choice)
            ):
                raise InvalidParameterError(
                    "structured_output", "choice must be a non-empty list of strings"
                )
            if len(self.choice) > MAX_CHOICES:
                raise InvalidParameterError(
                    "structured_output", f"choice takes at most {MAX_CHOICES} strings"
                )
            self.choice = list(self.choice)
        if self.starts_after is not None:
            after = self.starts_after
            if not isinstance(after, list | tuple) or not after:
                raise InvalidParameterError(
                    "structured_output", "starts_after must be a non-empty list of token ids"
                )
            if not all(isinstance(t, int) and t >= 0 for t in after):
                raise InvalidParameterError(
                    "structured_output", "starts_after must hold token ids (integers >= 0)"
                )
            self.starts_after = list(after)
        if self.opened_by is not None and (
            self.starts_after is None
            or not isinstance(self.opened_by, int)
            or isinstance(self.opened_by, bool)
            or self.opened_by < 0
        ):
            raise InvalidParameterError(
                "structured_output", "opened_by must be a token id (>= 0), with starts_after"
            )

    @property
    def kind(self) -> str:
        """Which form it takes: ``json_schema``, ``json_object``, ``regex``, ``choice`` or
        ``grammar``."""
        for name in ("json_schema", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def key(self) -> tuple[str, str]:
        """A hashable identity: two specs with equal keys compile to the same grammar (a JSON
        schema's key keeps its property order, which the output follows)."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        value = getattr(self, kind)
        return kind, value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


DEFAULT_TEMPERATURE = 1.0  # the OpenAI APIs' default; `foudre generate` is greedy (0)
DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default, for sampling and beams alike
MAX_LOGPROBS = 20  # top log-probabilities a request may ask for beside the sampled token


@dataclass(slots=True)
class SamplingParams:
    """Sampling and stopping parameters of one request.

    ``temperature == 0`` means greedy. Invalid values raise ``InvalidParameterError`` (a
    ``ValueError``) naming the field, at construction, so a bad request never reaches the
    engine.
    """

    n: int = 1
    # sample best_of sequences (forked from one prompt computation), return the n of highest
    # cumulative log-probability; None: n
    best_of: int | None = None
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: until max_model_len
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
    # constrained decoding: the output follows this JSON schema, regex, choice or grammar
    structured_output: StructuredOutput | None = None

    MAX_LOGPROBS: ClassVar[int] = MAX_LOGPROBS

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
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise InvalidParameterError(
                "structured_output", "structured_output must be a StructuredOutput"
            )
        if self.top_k == -1:
            self.top_k = 0
        checks: list[tuple[str, bool, str]] = [
            ("n", self.n >= 1, "must be at least 1"),
            ("best_of", self.best_of is None or self.best_of >= self.n, "must be at least n"),
            ("temperature", self.temperature >= 0.0, "must be non-negative"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k >= 0, "must be -1 (disabled), 0 (disabled) or positive"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("repetition_penalty", self.repetition_penalty > 0.0, "must be positive"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be in [-2, 2]"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be in [-2, 2]"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 1, "must be at least 1"),
            ("min_tokens", self.min_tokens >= 0, "must be non-negative"),
            (
                "logprobs",
                self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS,
                f"must be in [0, {self.MAX_LOGPROBS}]",
            ),
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
        after = self.structured_output.starts_after if self.structured_output else None
        named += [("structured_output", t) for t in after or ()]
        return named

    @property
    def num_samples(self) -> int:
        """Sequences generated per prompt: ``best_of``, or ``n``."""
        return self.best_of if self.best_of is not None else self.n

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


class BeamStepParams(SamplingParams):
    """What each beam of a beam search samples with: greedy, reporting its ``num_candidates``
    best next tokens (which may exceed ``MAX_LOGPROBS``: beam search needs them all). Made by
    the engine, never by a client."""

    MAX_LOGPROBS: ClassVar[int] = 1 << 30


@dataclass(slots=True)
class BeamSearchParams:
    """Beam search, scored as Hugging Face ``transformers`` scores it: each step every live beam
    expands, the ``beam_width`` best continuations (by cumulative log-probability) survive, and
    a finished hypothesis (end-of-sequence, or ``max_tokens``) scores ``cum_logprob /
    generated_length ** length_penalty``. ``early_stopping``: True stops once ``beam_width``
    hypotheses are finished; False (the default) stops when no running beam can beat the
    worst finished one at its current length; ``"never"`` assumes the best possible length.
    Greedy only (``temperature`` 0)."""

    beam_width: int
    max_tokens: int | None = DEFAULT_MAX_TOKENS  # None: until max_model_len, as SamplingParams
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    ignore_eos: bool = False
    temperature: float = 0.0

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or self.beam_width < 1:
            raise InvalidParameterError(
                "beam_width", f"beam_width must be at least 1, got {self.beam_width!r}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParameterError(
                "max_tokens", f"max_tokens must be at least 1, got {self.max_tokens!r}"
            )
        if not math.isfinite(self.length_penalty):
            raise InvalidParameterError(
                "length_penalty", f"length_penalty must be finite, got {self.length_penalty!r}"
            )
        if self.early_stopping not in (True, False, "never"):
            raise InvalidParameterError(
                "early_stopping",
                f"early_stopping must be true, false or 'never', got {self.early_stopping!r}",
            )
        if self.temperature != 0.0:
            raise InvalidParameterError(
                "temperature", "beam search is deterministic here: temperature must be 0"
            )
