"""``/v1/responses``: OpenAI's Responses API as a view over the chat path.

A request's ``instructions``, earlier conversation (``previous_response_id``) and ``input``
items become chat messages, its tools, ``tool_choice`` and ``text.format`` the chat request's;
``OpenAIServingChat.start`` checks and submits it. The chat path's output (text, tool calls,
or, streamed, the ``ToolStreamer``'s deltas) becomes Responses output items and events. An
error names the Responses field (``input``, ``max_output_tokens``, ``text``).

Stored responses (``store``, the default) live in a bounded in-memory LRU store, with the
conversation that led to them, so that ``previous_response_id`` can continue it.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from starlette.types import Receive

from foudre.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    ContentPart,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    OpenAIError,
    ResponseFormat,
    ToolCall,
    ToolCallFunction,
    ToolDefinition,
    chat_request_of,
)
from foudre.server.protocol_responses import InputItem, ResponsesRequest
from foudre.server.serving import Json, OpenAIServing, TokenUsage
from foudre.server.serving_chat import ChatRun, OpenAIServingChat
from foudre.server.tools import ToolCallOut

DEFAULT_STORE_SIZE = 1024
DEFAULT_STORE_BYTES = 64 << 20
# the chat fields an error may name -> the Responses field that set them
_RENAME = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text",
}
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(slots=True)
class StoredResponse:
    """A response as ``GET`` returns it, and the conversation it ends (without instructions,
    which a follow-up does not inherit)."""

    body: Json
    messages: list[ChatMessage]


class ResponseStore:
    """At most ``size`` responses and ``max_bytes`` bytes of them (their JSON: the response and
    its conversation), the least recently used evicted first (0: none kept). A response
    larger than ``max_bytes`` alone is not kept, and evicts nothing."""

    def __init__(
        self, size: int = DEFAULT_STORE_SIZE, max_bytes: int = DEFAULT_STORE_BYTES
    ) -> None:
        if size < 0:
            raise ValueError(f"the responses store size must be at least 0, got {size}")
        if max_bytes < 0:
            raise ValueError(f"the responses store bytes must be at least 0, got {max_bytes}")
        self.size = size
        self.max_bytes = max_bytes
        self.nbytes = 0  # what the kept responses weigh
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._weights: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def put(self, rid: str, stored: StoredResponse) -> None:
        weight = _weight(stored)
        if self.size == 0 or weight > self.max_bytes:
            return
        self.delete(rid)
        self._items[rid] = stored
        self._weights[rid] = weight
        self.nbytes += weight
        while len(self._items) > self.size or self.nbytes > self.max_bytes:
            oldest, _ = self._items.popitem(last=False)
            self.nbytes -= self._weights.pop(oldest)

    def get(self, rid: str) -> StoredResponse | None:
        stored = self._items.get(rid)
        if stored is not None:
            self._items.move_to_end(rid)
        return stored

    def delete(self, rid: str) -> bool:
        if self._items.pop(rid, None) is None:
            return False
        self.nbytes -= self._weights.pop(rid)
        return True


def _weight(stored: StoredResponse) -> int:
    """The bytes of a stored response's JSON: the response and its conversation."""
    body = json.dumps(stored.body, ensure_ascii=False).encode()
    return len(body) + sum(len(m.model_dump_json().encode()) for m in stored.messages)


def _not_found(rid: str, param: str | None = None) -> OpenAIError:
    status = 404 if param is None else 400
    return OpenAIError(
        status, f"no stored response with id {rid!r}", param=param, code="response_not_found"
    )


def _message(i: int, item: InputItem) -> ChatMessage:
    where = f"input[{i}]"
    if item.role is None or item.content is None:
        raise OpenAIError(400, f"{where}: a message needs a role and content", param="input")
    role = "system" if item.role == "developer" else item.role
    if isinstance(item.content, str):
        return ChatMessage(role=role, content=item.content)
    parts = []
    for j, part in enumerate(item.content):
        if part.type not in _TEXT_PARTS:
            raise OpenAIError(
                400,
                f"{where}.content[{j}] is a {part.type!r} part; this model reads text only "
                "(send input_text parts)",
                param="input",
            )
        parts.append(ContentPart(type="text", text=part.text))
    return ChatMessage(role=role, content=parts)


def conversation(items: str | list[InputItem]) -> list[ChatMessage]:
    """``input`` as chat messages: a function call joins the assistant message before it (a
    new one if there is none), a call's output is a tool message; 400 naming ``input`` for an
    item that lacks what its type needs, or a part that is not text."""
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        if item.type == "reasoning":
            continue  # an earlier turn's reasoning: templates do not show it again
        if item.type == "message":
            out.append(_message(i, item))
        elif item.type == "function_call":
            if not item.call_id or not item.name:
                message = f"input[{i}]: a function_call needs a call_id and a name"
                raise OpenAIError(400, message, param="input")
            function = ToolCallFunction(name=item.name, arguments=item.arguments or "{}")
            call = ToolCall(id=item.call_id, function=function)
            if not out or out[-1].role != "assistant":
                out.append(ChatMessage(role="assistant", content=""))
            out[-1].tool_calls = [*(out[-1].tool_calls or []), call]
        else:
            if not item.call_id or item.output is None:
                message = f"input[{i}]: a function_call_output needs a call_id and an output"
                raise OpenAIError(400, message, param="input")
            out.append(ChatMessage(role="tool", content=item.output, tool_call_id=item.call_id))
    return out


def chat_request(req: ResponsesRequest, messages: list[ChatMessage]) -> ChatCompletionRequest:
    """The chat request that ``req`` asks for, over ``messages`` (instructions first)."""
    if req.instructions is not None:
        messages = [ChatMessage(role="system", content=req.instructions), *messages]
    if not messages:
        raise OpenAIError(400, "input is empty and continues no response", param="input")
    fields: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "parallel_tool_calls": req.parallel_tool_calls,
        "stream": req.stream,
        "seed": req.seed,
        "logit_bias": req.logit_bias,
    }
    if req.tools is not None:
        fields["tools"] = [
            ToolDefinition(function=FunctionDefinition(**t.model_dump(exclude={"type"})))
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        fields["tool_choice"] = (
            choice
            if isinstance(choice, str)
            else NamedToolChoice(function=NamedFunction(name=choice.name))
        )
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        fields["response_format"] = ResponseFormat(type="json_object")
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            message = "text.format of type json_schema needs a schema"
            raise OpenAIError(400, message, param="text")
        schema = JsonSchemaFormat.model_validate({"name": fmt.name, "schema": fmt.schema_})
        fields["response_format"] = ResponseFormat(type="json_schema", json_schema=schema)
    return chat_request_of(fields, _RENAME, "input")


def usage_json(usage: TokenUsage, reasoning_tokens: int = 0) -> Json:
    counts = usage.as_dict()
    return {
        "input_tokens": counts["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": counts["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": counts["total_tokens"],
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, status: str = "completed") -> Json:
    return {
        "type": "message",
        "id": _new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def reasoning_item(text: str, status: str = "completed") -> Json:
    """A reasoning output item, its text in one ``reasoning_text`` part."""
    return {
        "type": "reasoning",
        "id": _new_id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def call_item(call: ToolCallOut, status: str = "completed") -> Json:
    return {
        "type": "function_call",
        "id": _new_id("fc"),
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments,
        "status": status,
    }


def assistant_message(output: list[Json]) -> ChatMessage:
    """The chat message of a response's output items (what a follow-up continues)."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        ToolCall(
            id=item["call_id"],
            function=ToolCallFunction(name=item["name"], arguments=item["arguments"]),
        )
        for item in output
        if item["type"] == "function_call"
    ]
    return ChatMessage(role="assistant", content=text, tool_calls=calls or None)


def _dumped(model: BaseModel | None, default: Any) -> Any:
    return default if model is None else model.model_dump()


def _status(finish_reason: str | None) -> tuple[str, Json | None]:
    """A response's status and ``incomplete_details`` from its output's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "incomplete", {"reason": "abort"}
    return "completed", None


class OpenAIServingResponses:
    """The Responses endpoints over the chat path of ``chat``, with ``store``."""

    def __init__(self, chat: OpenAIServingChat, store: ResponseStore) -> None:
        self.chat = chat
        self.serving: OpenAIServing = chat.serving
        self.store = store

    def retrieve(self, rid: str) -> Json:
        stored = self.store.get(rid)
        if stored is None:
            raise _not_found(rid)
        return stored.body

    def delete(self, rid: str) -> Json:
        if not self.store.delete(rid):
            raise _not_found(rid)
        return {"id": rid, "object": "response", "deleted": True}

    async def create(self, req: ResponsesRequest, receive: Receive) -> Json | AsyncIterator[str]:
        """The response to ``req``: a ``response`` dict, or its SSE stream of events."""
        history: list[ChatMessage] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id)
            if previous is None:
                raise _not_found(req.previous_response_id, "previous_response_id")
            history = previous.messages
        messages = [*history, *conversation(req.input)]
        try:
            run = await self.chat.start(chat_request(req, messages), "resp_")
        except OpenAIError as e:
            e.param = _RENAME.get(e.param or "", e.param)
            raise
        created = int(time.time())
        if req.stream:
            return self._stream(req, run, created, messages, receive)
        finals, usage = await self.serving.collect(run.stream, receive, 1, run.deadline)
        comp = finals.get(0)
        if comp is None:  # no output came (the request was aborted before its first token)
            raise OpenAIError(500, f"request {run.request_id} ended without an output")
        reasoning, content, calls = run.answer(comp.text)
        output = [reasoning_item(reasoning)] if reasoning else []
        output += [message_item(content or "")] if content or not calls else []
        output += [call_item(c) for c in calls]
        status, incomplete = _status(comp.finish_reason)
        thought = self.serving.reasoning_tokens(comp.token_ids, reasoning)
        body = self.body(req, run.request_id, created, status, output, usage_json(usage, thought))
        body["incomplete_details"] = incomplete
        self._keep(req, body, messages)
        return body

    def _keep(self, req: ResponsesRequest, body: Json, messages: list[ChatMessage]) -> None:
        if req.store:
            conversation = [*messages, assistant_message(body["output"])]
            self.store.put(body["id"], StoredResponse(body, conversation))

    def body(
        self,
        req: ResponsesRequest,
        rid: str,
        created: int,
        status: str,
        output: list[Json],
        usage: Json | None,
    ) -> Json:
        """The ``response`` object (the request's settings echoed as OpenAI does)."""
        fmt = req.text.format if req.text is not None else None
        text_format: Json = {"type": "text"}
        if fmt is not None and fmt.type != "text":
            text_format = fmt.model_dump(by_alias=True, exclude_none=True)
        choice = req.tool_choice
        return {
            "id": rid,
            "object": "response",
            "created_at": created,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "model": self.serving.model_name,
            "output": output,
            "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "store": req.store,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {"format": text_format},
            "tool_choice": choice if isinstance(choice, str) else _dumped(choice, "auto"),
            "tools": [t.model_dump() for t in req.tools or []],
            "metadata": req.metadata or {},
            "user": req.user,
            "usage": usage,
        }

    async def _stream(
        self,
        req: ResponsesRequest,
        run: ChatRun,
        created: int,
        messages: list[ChatMessage],
        receive: Receive,
    ) -> AsyncIterator[str]:
        """The event stream: created, in_progress, the items' events, then completed (or
        incomplete); a failure ends it with an ``error`` event and ``response.failed``."""
        events = _Events()
        usage = TokenUsage()
        streamer = run.streamer()
        outputs = self.serving.outputs(run.stream, receive, 1, usage, run.deadline)
        start = self.body(req, run.request_id, created, "in_progress", [], None)
        try:
            async with aclosing(outputs):
                yield events.event("response.created", response=start)
                yield events.event("response.in_progress", response=start)
                finish = None
                token_ids: list[int] = []
                try:
                    async for comp in outputs:
                        text = comp.delta_text
                        delta: Json = {"content": text}
                        if streamer is not None:  # reasoning apart, what may be a call held back
                            delta = streamer.step(text, comp.finished)
                        for event in events.delta(delta):
                            yield event
                        finish, token_ids = comp.finish_reason, comp.token_ids
                except OpenAIError as e:
                    yield events.event(
                        "error", code=e.code or e.type, message=e.message, param=e.param
                    )
                    failed = {
                        **start,
                        "status": "failed",
                        "error": {"code": e.code or e.type, "message": e.message},
                    }
                    yield events.event("response.failed", response=failed)
                    return
                for event in events.finish():
                    yield event
                status, incomplete = _status(finish)
                thought = self.serving.reasoning_tokens(token_ids, events.reasoning)
                body = self.body(
                    req, run.request_id, created, status, events.items, usage_json(usage, thought)
                )
                body["incomplete_details"] = incomplete
                self._keep(req, body, messages)
                kind = "response.completed" if status == "completed" else "response.incomplete"
                yield events.event(kind, response=body)
        finally:
            run.stream.abort()  # also when closed before the outputs began


class _Events:
    """Chat deltas (reasoning, content, tool-call deltas) in, Responses SSE events out,
    numbered: each output item is added, written and done in turn, a message's text in one
    output_text part, a reasoning item's in one reasoning_text part."""

    def __init__(self) -> None:
        self.seq = 0
        self.items: list[Json] = []
        self.open: Json | None = None  # the item being written
        self.text = ""  # the open message's or reasoning item's text
        self.reasoning = ""  # all the reasoning text

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _where(self) -> Json:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items) - 1}

    def _add(self, item: Json) -> list[str]:
        out = self._close()
        self.items.append(item)
        self.open = item
        added = self.event(
            "response.output_item.added", output_index=len(self.items) - 1, item=item
        )
        return [*out, added]

    def _text(self, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != "message":
            item = message_item("", "in_progress")
            part = item["content"].pop()
            out += self._add(item)
            self.text = ""
            out.append(
                self.event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
        if text:
            self.text += text
            where = self._where()
            out.append(
                self.event(
                    "response.output_text.delta", **where, content_index=0, delta=text, logprobs=[]
                )
            )
        return out

    def _reasoning(self, text: str) -> list[str]:
        out: list[str] = []
        if self.open is None or self.open["type"] != "reasoning":
            item = reasoning_item("", "in_progress")
            part = item["content"].pop()
            out += self._add(item)
            self.text = ""
            out.append(
                self.event(
                    "response.content_part.added", **self._where(), content_index=0, part=part
                )
            )
        self.text += text
        self.reasoning += text
        out.append(
            self.event(
                "response.reasoning_text.delta", **self._where(), content_index=0, delta=text
            )
        )
        return out

    def _call(self, call: Json) -> list[str]:
        out: list[str] = []
        function = call.get("function", {})
        if "id" in call:
            out += self._add(
                call_item(ToolCallOut(function["name"], "", call["id"]), "in_progress")
            )
        arguments = function.get("arguments", "")
        if arguments and self.open is not None:
            self.open["arguments"] += arguments
            out.append(
                self.event(
                    "response.function_call_arguments.delta", **self._where(), delta=arguments
                )
            )
        return out

    def delta(self, delta: Json) -> list[str]:
        out: list[str] = []
        if delta.get("reasoning_content"):
            out += self._reasoning(delta["reasoning_content"])
        if delta.get("content"):
            out += self._text(delta["content"])
        for call in delta.get("tool_calls", []):
            out += self._call(call)
        return out

    def _close(self) -> list[str]:
        """The events that end the open item (none when no item is open)."""
        item, self.open = self.open, None
        if item is None:
            return []
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        out = []
        if item["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            item["content"] = [part]
            out.append(
                self.event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=self.text,
                    logprobs=[],
                )
            )
            out.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        elif item["type"] == "reasoning":
            part = {"type": "reasoning_text", "text": self.text}
            item["content"] = [part]
            out.append(
                self.event("response.reasoning_text.done", **where, content_index=0, text=self.text)
            )
            out.append(
                self.event("response.content_part.done", **where, content_index=0, part=part)
            )
        else:
            out.append(
                self.event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        item["status"] = "completed"
        out.append(
            self.event("response.output_item.done", output_index=where["output_index"], item=item)
        )
        return out

    def finish(self) -> list[str]:
        """The events that end the output: the open item closed (an empty message when the
        model wrote nothing but, perhaps, reasoning)."""
        out = self._text("") if all(i["type"] == "reasoning" for i in self.items) else []
        return out + self._close()
