"""Request and error shapes of the OpenAI-compatible API.

Requests are pydantic models that ignore unknown fields; responses are built as plain dicts in
``serving_*.py`` (they are only ever serialised).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from foudre.sampling_params import BeamSearchParams, SamplingParams


def _default(params: type[SamplingParams] | type[BeamSearchParams], name: str) -> Any:
    """The default of one of ``params``' fields: a field the API shares with the engine takes
    the engine's default (one source for both)."""
    return next(f.default for f in dataclasses.fields(params) if f.name == name)


class OpenAIError(Exception):
    """An error to send as ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: OpenAI's structured outputs."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = _default(SamplingParams, "n")
    # None: SamplingParams' default (serving.py passes only the values a request gives)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = _default(SamplingParams, "min_tokens")
    ignore_eos: bool = _default(SamplingParams, "ignore_eos")
    include_stop_str_in_output: bool = _default(SamplingParams, "include_stop_str_in_output")
    skip_special_tokens: bool = _default(SamplingParams, "skip_special_tokens")
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # OpenAI's: token id (as a string) -> bias added to its logit, in [-100, 100]
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only among these
    cache_salt: str | None = None  # vLLM's: a prefix-cache namespace, e.g. one per tenant
    # structured output: OpenAI's response_format, or one of vLLM's guided_* fields
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


PromptField = str | list[str] | list[int] | list[list[int]]


class _SearchFields(_SamplingFields):
    """``best_of`` and vLLM's beam search, shared by completions and chat completions."""

    best_of: int | None = None  # sample best_of, return the n most likely
    # vLLM's beam search fields: best_of (or n) beams, the n best returned as choices
    use_beam_search: bool = False
    length_penalty: float = _default(BeamSearchParams, "length_penalty")
    early_stopping: bool | Literal["never"] = _default(BeamSearchParams, "early_stopping")


class CompletionRequest(_SearchFields):
    prompt: PromptField
    max_tokens: int | None = _default(SamplingParams, "max_tokens")  # null: until max_model_len
    logprobs: int | None = None
    echo: bool = False


class ContentPart(_Request):
    type: str = "text"
    text: str = ""


class ToolCallFunction(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends the arguments as JSON text


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDefinition(_Request):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ToolDefinition(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(_Request):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # an assistant's earlier reasoning, as chat returned it (templates that show it read it)
    reasoning_content: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content if p.type == "text")


class ChatCompletionRequest(_SearchFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None  # with messages: rendered as chat renders them
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# -- response shapes (for the OpenAPI schema; responses are built as dicts in serving_*.py) ---
class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorDetail


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(_Response):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatResponseMessage(_Response):
    role: str
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatCompletionChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatCompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: str = "model"
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Response):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(_Response):
    prompt: str


class HealthResponse(_Response):
    status: str


def chat_request_of(
    fields: dict[str, Any], rename: Mapping[str, str], default_param: str
) -> ChatCompletionRequest:
    """The chat request that another protocol's request (Anthropic Messages, Responses) maps to;
    what the chat request refuses and that protocol's own models let through (a conversation
    left empty, say) is a 400 naming that protocol's parameter (``rename``: chat's field names
    to its; ``default_param`` where the error names no field)."""
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:
        errors = e.errors()
        loc = [str(x) for x in errors[0]["loc"]] if errors else []
        param = rename.get(loc[0], loc[0]) if loc else default_param
        message = errors[0]["msg"] if errors else "invalid value"
        raise OpenAIError(400, f"{param}: {message}", param=param) from None
