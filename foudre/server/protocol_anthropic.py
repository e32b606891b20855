"""Request, response and error shapes of Anthropic's Messages API (``/v1/messages``).

Requests are pydantic models that ignore unknown fields (``metadata``, ``cache_control``,
``service_tier``...); responses are built as plain dicts in ``serving_messages.py`` and declared
here for the OpenAPI schema only.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from foudre.server.protocol import OpenAIError

# Anthropic's error type for each status it answers with
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
MAX_TEXT_ID = 256  # ids and names: Anthropic's are far shorter


class AnthropicError(OpenAIError):
    """An error sent in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``
    (the parameter, which that shape has no field for, is named in the message)."""

    def body(self) -> dict[str, Any]:
        other = "invalid_request_error" if self.status < 500 else "api_error"
        kind = _ERROR_TYPES.get(self.status, other)
        if self.param and self.param not in self.message:
            message = f"{self.param}: {self.message}"
        else:
            message = self.message
        return {"type": "error", "error": {"type": kind, "message": message}}

    @classmethod
    def of(cls, e: OpenAIError, rename: dict[str, str] | None = None) -> AnthropicError:
        """``e`` in Anthropic's shape, its parameter renamed to the Messages API's field."""
        if isinstance(e, AnthropicError):
            return e
        param = e.param if e.param is None or rename is None else rename.get(e.param, e.param)
        return cls(e.status, e.message, e.type, param, e.code, e.headers)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextBlock(_Request):
    type: Literal["text"]
    text: str


class ToolUseBlock(_Request):
    """An assistant's earlier call of a tool."""

    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=MAX_TEXT_ID)
    name: str = Field(min_length=1, max_length=MAX_TEXT_ID)
    input: dict[str, Any]


class ToolResultBlock(_Request):
    """A user's answer to a ``tool_use`` block (``tool_use_id``)."""

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=MAX_TEXT_ID)
    content: str | list[TextBlock] = ""
    is_error: bool = False

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(b.text for b in self.content)


class ThinkingBlock(_Request):
    """An assistant's earlier reasoning, as a response returned it (a client appending the
    response's content to the conversation sends it back); not shown to the model again."""

    type: Literal["thinking"]
    thinking: str = ""
    signature: str = ""


class RedactedThinkingBlock(_Request):
    type: Literal["redacted_thinking"]
    data: str = ""


ContentBlock = Annotated[
    TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


class ThinkingConfig(_Request):
    """``thinking``: ``enabled`` (reasoning returned as ``thinking`` blocks; the budget is
    accepted, the model's own end of reasoning decides) or ``disabled``."""

    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = Field(default=None, ge=1)


class InputMessage(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Request):
    """A client tool: its name and the JSON schema of its ``input`` object."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=MAX_TEXT_ID)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Request):
    """``auto`` (the model decides), ``any`` (some tool), ``tool`` (the one ``name``d), or
    ``none``; ``disable_parallel_tool_use``: at most one call."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, min_length=1, max_length=MAX_TEXT_ID)
    disable_parallel_tool_use: bool = False


class CountTokensRequest(_Request):
    """``/v1/messages/count_tokens``: what the prompt of a Messages request is made of."""

    model: str | None = Field(default=None, max_length=MAX_TEXT_ID)  # None: the served one
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None


class MessagesRequest(CountTokensRequest):
    """``/v1/messages``. ``max_tokens`` is required, as Anthropic requires it."""

    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    thinking: ThinkingConfig | None = None

    @property
    def shows_thinking(self) -> bool:
        """Whether a thinking model's reasoning comes back as ``thinking`` blocks (asked with
        ``thinking: {"type": "enabled"}``, as Anthropic's API returns it only then)."""
        return self.thinking is not None and self.thinking.type == "enabled"


# -- response shapes (for the OpenAPI schema) ----------------------------------------------
class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class MessagesUsage(_Response):
    input_tokens: int
    output_tokens: int


class MessagesResponse(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(_Response):
    input_tokens: int
