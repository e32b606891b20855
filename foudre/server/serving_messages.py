"""``/v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API as a view of the
chat path.

A Messages request is mapped onto a chat request (``system`` -> a system message, ``tool_use``
blocks -> an assistant's ``tool_calls``, ``tool_result`` blocks -> tool messages, ``tools`` ->
functions, ``tool_choice`` ``any`` -> ``required``, ``tool`` -> a named function), submitted by
the chat path (the same template, sampling, grammars and tool parsing), and its outputs are
mapped back to content blocks: text, then ``tool_use`` blocks. Streamed, the chat path's
``ToolStreamer`` deltas become Anthropic's events::

    message_start
    content_block_start (text | tool_use) · content_block_delta (text_delta | input_json_delta)*
        · content_block_stop                                    (one group per block, in order)
    message_delta (stop_reason, usage) · message_stop
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.types import Receive

from foudre.outputs import CompletionOutput
from foudre.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    OpenAIError,
    ToolCall,
    ToolCallFunction,
    ToolDefinition,
    chat_request_of,
)
from foudre.server.protocol_anthropic import (
    AnthropicError,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from foudre.server.serving import Json, TokenUsage
from foudre.server.serving_chat import ChatRun, OpenAIServingChat
from foudre.server.tools import ToolPlan

# chat's parameter names -> the Messages API's fields, for the errors the chat path raises
RENAME = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def _system(system: str | list[TextBlock] | None) -> list[ChatMessage]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "".join(b.text for b in system)
    return [ChatMessage(role="system", content=text)]


def chat_messages(req: CountTokensRequest) -> list[ChatMessage]:
    """The conversation as the chat path takes it: the system prompt first; an assistant's
    text and ``tool_use`` blocks as one message with ``tool_calls`` (its ``thinking`` blocks
    left out, as Anthropic's models do not see earlier turns' thinking); a user's ``tool_result``
    blocks as tool messages and its text between them as user messages, in their order.
    400 naming ``messages`` for a block in the wrong role."""
    out = _system(req.system)
    for i, m in enumerate(req.messages):
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
            continue
        if m.role == "assistant":
            if any(isinstance(b, ToolResultBlock) for b in m.content):
                message = f"messages[{i}]: tool_result blocks belong to user messages"
                raise OpenAIError(400, message, param="messages")
            text = "".join(b.text for b in m.content if isinstance(b, TextBlock))
            calls = [
                ToolCall(id=b.id, function=ToolCallFunction(name=b.name, arguments=b.input))
                for b in m.content
                if isinstance(b, ToolUseBlock)
            ]
            out.append(ChatMessage(role="assistant", content=text, tool_calls=calls or None))
            continue
        texts: list[str] = []
        for block in m.content:
            if isinstance(block, ToolUseBlock):
                message = f"messages[{i}]: tool_use blocks belong to assistant messages"
                raise OpenAIError(400, message, param="messages")
            if isinstance(block, TextBlock):
                texts.append(block.text)
                continue
            if not isinstance(block, ToolResultBlock):
                continue  # (reasoning passed back: not shown to the model again)
            if texts:
                out.append(ChatMessage(role="user", content="".join(texts)))
                texts = []
            out.append(
                ChatMessage(role="tool", content=block.text(), tool_call_id=block.tool_use_id)
            )
        if texts or not m.content:
            out.append(ChatMessage(role="user", content="".join(texts)))
    return out


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat request that ``req`` is a view of; 400 naming ``tool_choice`` for a ``tool``
    choice without a ``name``."""
    fields: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    if req.tools:
        fields["tools"] = [
            ToolDefinition.model_validate(
                {
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema,
                    }
                }
            )
            for t in req.tools
        ]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if choice.name is None:
                raise OpenAIError(400, "a tool_choice of type 'tool' needs a name", "tool_choice")
            fields["tool_choice"] = NamedToolChoice.model_validate(
                {"function": {"name": choice.name}}
            )
        else:
            fields["tool_choice"] = {"any": "required"}.get(choice.type, choice.type)
        fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if isinstance(req, MessagesRequest):
        given = {"temperature": req.temperature, "top_p": req.top_p, "top_k": req.top_k}
        fields.update({k: v for k, v in given.items() if v is not None})
        fields.update(max_tokens=req.max_tokens, stop=req.stop_sequences, stream=req.stream)
    return chat_request_of(fields, RENAME, "messages")


def tool_use_id(call_id: str) -> str:
    """Anthropic's id of a call (``toolu_...``) from the chat path's (``call_...``)."""
    return "toolu_" + call_id.removeprefix("call_")


def stop_reason(comp: CompletionOutput, called: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a finished output (a shutdown's
    ``abort`` is passed on as it is: no Anthropic reason says "cut")."""
    reason = comp.finish_reason
    if reason == "length":
        return "max_tokens", None
    if reason == "stop":
        if called:
            return "tool_use", None
        if isinstance(comp.stop_reason, str):
            return "stop_sequence", comp.stop_reason
        return "end_turn", None
    return reason or "end_turn", None


def content_blocks(run: ChatRun, text: str, show_thinking: bool) -> tuple[list[Json], bool]:
    """The content blocks of a complete output (a thinking model's reasoning as a ``thinking``
    block where ``show_thinking``, text, then one ``tool_use`` per call; one empty text block
    for an empty output), and whether it called a tool. A call whose arguments are not a JSON
    object (a forced call cut by ``max_tokens``) is left as text."""
    reasoning, content, calls = run.answer(text)
    thinking: list[Json] = []
    if reasoning and show_thinking:
        thinking = [{"type": "thinking", "thinking": reasoning, "signature": ""}]
    uses: list[Json] = []
    for call in calls:
        try:
            args = json.loads(call.arguments)
        except json.JSONDecodeError:
            args = None
        if not isinstance(args, dict):
            return [*thinking, {"type": "text", "text": content or text}], False
        uses.append(
            {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": args}
        )
    blocks: list[Json] = [{"type": "text", "text": content}] if content else []
    blocks += uses
    return thinking + (blocks or [{"type": "text", "text": ""}]), bool(uses)


def _event(obj: Json) -> str:
    return f"event: {obj['type']}\ndata: {json.dumps(obj, ensure_ascii=False)}\n\n"


class AnthropicServingMessages:
    """The Messages endpoints over the chat path."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat
        self.serving = chat.serving

    async def create(self, req: MessagesRequest, receive: Receive) -> Json | AsyncIterator[str]:
        """The response to ``req``: a ``message`` dict, or its stream of events. Errors are
        ``AnthropicError``s."""
        try:
            run = await self.chat.start(chat_request(req), "msg_")
        except OpenAIError as e:
            raise AnthropicError.of(e, RENAME) from None
        message: Json = {
            "id": run.request_id,
            "type": "message",
            "role": "assistant",
            "model": self.serving.model_name,
        }
        if req.stream:
            return self._stream(run, receive, _MessageEvents(message, run, req.shows_thinking))
        try:
            finals, usage = await self.serving.collect(run.stream, receive, 1, run.deadline)
        except OpenAIError as e:
            raise AnthropicError.of(e, RENAME) from None
        comp = finals[0]
        blocks, called = content_blocks(run, comp.text, req.shows_thinking)
        reason, sequence = stop_reason(comp, called)
        return {
            **message,
            "content": blocks,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": usage.prompt[0], "output_tokens": usage.completion[0]},
        }

    async def _stream(
        self, run: ChatRun, receive: Receive, events: _MessageEvents
    ) -> AsyncIterator[str]:
        """The event stream of ``run``; a failure mid-way ends it with an ``error`` event."""
        usage = TokenUsage()
        outputs = self.serving.outputs(run.stream, receive, 1, usage, run.deadline)
        try:
            async with aclosing(outputs) as it:
                async for comp in it:
                    for event in events.feed(comp, usage):
                        yield _event(event)
        except OpenAIError as e:
            yield _event(AnthropicError.of(e, RENAME).body())
        finally:
            run.stream.abort()

    async def count_tokens(self, req: CountTokensRequest) -> Json:
        """``input_tokens``: the prompt's length, as the usage of the same ``/v1/messages``
        request counts it (the same template, messages and tools)."""
        serving = self.serving
        try:
            serving.check_model(req.model)
            chat = chat_request(req)
            tok = serving.tokenizer
            if tok is None:
                raise OpenAIError(400, "messages need a tokenizer; this server has none")
            plan = ToolPlan.of(chat, tok, serving.tool_call_parser)
            ids = await serving.chat_prompt(chat.messages, True, plan.tools)
        except OpenAIError as e:
            raise AnthropicError.of(e, RENAME) from None
        return {"input_tokens": len(ids)}


class _MessageEvents:
    """The events of one streamed message: ``message_start`` with the first output, a block's
    start, deltas and stop as the chat path's tool streamer releases text and calls, then
    ``message_delta`` and ``message_stop`` with the last output."""

    def __init__(self, message: Json, run: ChatRun, show_thinking: bool) -> None:
        self.message = message
        self.show_thinking = show_thinking
        self.plan = run.plan
        self.streamer = run.streamer()
        self.started = False  # message_start sent
        self.index = -1  # the last block's index (-1: none yet)
        self.open: str | None = None  # the open block's type (None: none open)
        self.called = False

    def feed(self, comp: CompletionOutput, usage: TokenUsage) -> list[Json]:
        events: list[Json] = []
        if not self.started:
            self.started = True
            start = {**self.message, "content": [], "stop_reason": None, "stop_sequence": None}
            start["usage"] = {"input_tokens": usage.prompt.get(0, 0), "output_tokens": 0}
            events.append({"type": "message_start", "message": start})
        text = comp.delta_text
        delta: Json = {"content": text} if text else {}
        if self.streamer is not None:  # reasoning apart, what may be a call held back
            delta = self.streamer.step(text, comp.finished)
        if delta.get("reasoning_content") and self.show_thinking:
            events += self._thinking(delta["reasoning_content"])
        if delta.get("content"):
            events += self._text(delta["content"])
        for call in delta.get("tool_calls", []):
            events += self._call(call)
        if comp.finished:
            events += self._finish(comp, usage)
        return events

    def _block(self, block: Json) -> list[Json]:
        """Close the open block (if any) and open ``block``."""
        events = self._close()
        self.index += 1
        self.open = block["type"]
        return [
            *events,
            {"type": "content_block_start", "index": self.index, "content_block": block},
        ]

    def _close(self) -> list[Json]:
        if self.open is None:
            return []
        self.open = None
        return [{"type": "content_block_stop", "index": self.index}]

    def _text(self, text: str) -> list[Json]:
        events = [] if self.open == "text" else self._block({"type": "text", "text": ""})
        delta = {"type": "text_delta", "text": text}
        return [*events, {"type": "content_block_delta", "index": self.index, "delta": delta}]

    def _thinking(self, text: str) -> list[Json]:
        block = {"type": "thinking", "thinking": "", "signature": ""}
        events = [] if self.open == "thinking" else self._block(block)
        delta = {"type": "thinking_delta", "thinking": text}
        return [*events, {"type": "content_block_delta", "index": self.index, "delta": delta}]

    def _call(self, call: Json) -> list[Json]:
        events: list[Json] = []
        function = call.get("function", {})
        if "id" in call:  # a new call: its header
            self.called = True
            block = {"type": "tool_use", "id": tool_use_id(call["id"]), "name": function["name"]}
            events += self._block({**block, "input": {}})
        arguments = function.get("arguments")
        if arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            events.append({"type": "content_block_delta", "index": self.index, "delta": delta})
        return events

    def _finish(self, comp: CompletionOutput, usage: TokenUsage) -> list[Json]:
        # an empty output has one empty text block, as the complete message has
        # (a thinking block alone is followed by one too)
        answered = self.index >= 0 and self.open != "thinking"
        events = [] if answered else self._block({"type": "text", "text": ""})
        events += self._close()
        reason, sequence = stop_reason(comp, self.called)
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        output_usage = {"output_tokens": usage.completion.get(comp.index, 0)}
        events.append({"type": "message_delta", "delta": delta, "usage": output_usage})
        events.append({"type": "message_stop"})
        return events
