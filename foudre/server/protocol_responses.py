"""Request and response shapes of OpenAI's Responses API (``/v1/responses``).

The request is read into these models, then mapped onto a chat request
(``serving_responses.py``): only the fields the Responses API names are here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ConfigDict, Field

from foudre.server.protocol import _Request, _Response


class InputContent(_Request):
    """A content part of an input message: text (``input_text``; an earlier answer's
    ``output_text``); any other type is refused by name."""

    type: str = "input_text"
    text: str = ""


class InputItem(_Request):
    """One item of ``input``: a message (``type`` may be left out), a ``function_call`` the
    model made earlier, a ``function_call_output`` answering one, or an earlier ``reasoning``
    item (passed back as the SDK hands it; the model does not see it again)."""

    type: Literal["message", "function_call", "function_call_output", "reasoning"] = "message"
    role: Literal["user", "assistant", "system", "developer"] | None = None
    content: str | list[InputContent] | None = None
    call_id: str | None = Field(default=None, max_length=256)
    name: str | None = Field(default=None, max_length=256)
    arguments: str | None = None
    output: str | None = None
    id: str | None = None
    status: str | None = None
    summary: list[Any] | None = None  # a reasoning item's
    encrypted_content: str | None = None  # a reasoning item's


class FunctionTool(_Request):
    """A function the model may call (the Responses API's flat form)."""

    type: Literal["function"] = "function"
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Request):
    type: Literal["function"] = "function"
    name: str


class TextFormat(_Request):
    """``text.format``: plain text, any JSON object, or JSON valid under ``schema``."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesRequest(_Request):
    model: str | None = None
    input: str | list[InputItem] = ""
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None
    user: str | None = None
    # not OpenAI's: chat's seed and logit_bias, for reproducible outputs
    seed: int | None = None
    logit_bias: dict[str, float] | None = None


# -- response shapes (for the OpenAPI schema; responses are built as dicts) -------------------
class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    output_tokens_details: OutputTokensDetails | None = None


class ReasoningText(_Response):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItem(_Response):
    """An output item holding a thinking model's reasoning (before its answer's items)."""

    type: Literal["reasoning"] = "reasoning"
    id: str
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: str | None = None


class ResponseObject(_Response):
    id: str
    object: str = "response"
    created_at: int
    status: str
    model: str
    output: list[dict[str, Any]]
    usage: ResponseUsage | None = None


class DeletedResponse(_Response):
    id: str
    object: str = "response"
    deleted: bool
