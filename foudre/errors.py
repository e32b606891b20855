"""Typed errors that callers (the server, the CLI) map to answers without reading message text.

The parameter errors are ``ValueError``s, so code that catches bad input as ``ValueError``
keeps working.
"""

from __future__ import annotations


class InvalidParameterError(ValueError):
    """A request parameter is out of range or of the wrong kind; ``param`` names it (the
    ``SamplingParams`` field or the API's parameter, e.g. ``"temperature"``, ``"prompt"``)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class GrammarDeadEndError(RuntimeError):
    """A request's grammar admits none of the tokens that its own parameters let it sample
    (``allowed_token_ids`` that began the output but cannot go on with it): the request cannot
    continue, by its own fault, not the engine's. ``params`` names the parameters in conflict
    (``SamplingParams`` fields)."""

    def __init__(self, token: int, params: tuple[str, ...]) -> None:
        super().__init__(
            f"token {token} does not continue the request's grammar: it admits none of the "
            f"tokens that {' and '.join(params)} allow at this point"
        )
        self.params = params


class PromptTooLongError(InvalidParameterError):
    """The prompt (or prompt plus what it asks to generate) does not fit the context."""

    def __init__(self, num_tokens: int, max_model_len: int, param: str = "prompt") -> None:
        super().__init__(
            param,
            f"prompt has {num_tokens} tokens, more than the maximum context length "
            f"(max_model_len) of {max_model_len} tokens",
        )
        self.num_tokens = num_tokens
        self.max_model_len = max_model_len
