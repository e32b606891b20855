"""Tool calling on ``/v1/chat/completions``.

The tools go to the model through its chat template (its ``tools`` variable, as in Hugging
Face's tool-calling templates); what the model writes back is read according to
``tool_choice``:

- ``"none"``: plain text, never parsed;
- ``"auto"``: text that may hold calls in the model's own format, found by a parser: ``hermes``
  (Hermes, Qwen 2.5 / 3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) or
  ``llama3_json`` (Llama 3.1+: ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several separated by ``;``). Needs a template that renders tools;
- ``"required"``: a grammar forces a JSON array of ``{"name", "parameters"}`` objects, one
  variant per tool with that tool's parameter schema, so every call is valid;
- a named function: a grammar forces its arguments object (its parameter schema).

Calls come back as ``message.tool_calls`` (``finish_reason "tool_calls"``; ``"stop"`` for a
named function, as OpenAI does) and, streamed, as ``delta.tool_calls``: content is streamed as
it comes (holding back what could begin a call), each call's id and name as soon as they are
known, then its arguments as they are written (``llama3_json`` calls once complete).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from foudre.loading.tokenizer import Tokenizer
from foudre.sampling_params import StructuredOutput
from foudre.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    OpenAIError,
    ToolDefinition,
)

Json = dict[str, Any]

PARSERS = ("hermes", "llama3_json")
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


@dataclass(slots=True)
class ToolCallOut:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_json(self, index: int | None = None) -> Json:
        out: Json = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return out if index is None else {"index": index, **out}


def detect_parser(chat_template: str | None) -> str:
    """The parser that fits a chat template's own call format (``hermes`` by default)."""
    template = chat_template or ""
    if _HERMES_OPEN in template:
        return "hermes"
    if _PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return "hermes"


def _call(obj: Any, keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCallOut | None:
    """A call from a decoded ``{"name": ..., "arguments" | "parameters": {...}}``, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args: Any = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # arguments already as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCallOut(obj["name"], json.dumps(args, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[ToolCallOut]]:
    """Content before the first ``<tool_call>`` and the calls; the whole text as content, no
    calls, when a block is not a call (a model that writes the tag in prose)."""
    start = text.find(_HERMES_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in _HERMES_BLOCK.findall(text[start:]):
        try:
            call = _call(json.loads(block))
        except json.JSONDecodeError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start].strip()
    return content or None, calls


def parse_llama3_json(text: str) -> tuple[str | None, list[ToolCallOut]]:
    """Calls when the whole output is ``{"name", "parameters"}`` objects (after an optional
    ``<|python_tag|>``, separated by ``;``); otherwise the text as content."""
    body = text.strip()
    body = body.removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while at < len(body):
        try:
            obj, end = decoder.raw_decode(body, at)
        except json.JSONDecodeError:
            return text, []
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return text, []
        calls.append(call)
        at = end
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
    return None, calls


def _arguments_object(arguments: str | dict[str, Any]) -> Any:
    """Arguments as chat templates expect them: a dict (OpenAI sends JSON text)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def template_messages(messages: list[ChatMessage]) -> list[Json]:
    """The messages as chat templates read them: ``role`` and ``content`` (text), plus an
    assistant's ``tool_calls`` (arguments as objects) and ``reasoning_content``, and a tool
    result's ``tool_call_id``.
    400 naming ``messages`` for a content part that is not text (an image, audio): the models
    served read text only, and answering without the part would mislead."""
    out = []
    for i, m in enumerate(messages):
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise OpenAIError(
                        400,
                        f"messages[{i}].content[{j}] is a {part.type!r} part; this model reads "
                        "text only (send the content as text parts)",
                        param="messages",
                    )
        msg: Json = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": _arguments_object(c.function.arguments),
                    },
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.reasoning_content is not None:
            msg["reasoning_content"] = m.reasoning_content
        out.append(msg)
    return out


def _parameters(name: str, schema: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of a function's arguments, always an object's (never ``true``, ``null``
    or a list): none, ``{}`` or a bare ``{"type": "object"}`` declare no parameters, as
    OpenAI reads them (the arguments are ``{}``); a schema without a ``type`` is an object's;
    400 naming ``tools`` for a schema of another type."""
    if not schema or schema == {"type": "object"}:
        return {"type": "object", "properties": {}, "additionalProperties": False}
    kind = schema.get("type", "object")
    if kind != "object":
        raise OpenAIError(
            400,
            f"the parameters of function {name!r} must be a JSON schema of type 'object', "
            f"got type {kind!r}",
            param="tools",
        )
    return {**schema, "type": "object"}


# keywords whose values are data, not schemas: their "$ref" keys are not references
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _relocated(schema: Any, pointer: str) -> Any:
    """``schema`` with its local references (``#``, ``#/$defs/...``) rewritten for a schema
    moved to ``pointer`` inside another one (``#/items/properties/parameters``), so that its
    ``$defs`` still resolve once it is wrapped."""
    if isinstance(schema, list):
        return [_relocated(item, pointer) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = pointer + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = _relocated(value, pointer)
    return out


def required_calls_schema(tools: list[ToolDefinition], parallel: bool) -> Json:
    """The JSON schema of ``tool_choice "required"``: an array of ``{"name", "parameters"}``
    objects (at most one without ``parallel``), one variant per tool, each tool's parameter
    schema moved in with its references kept resolving."""
    at = "#/items" if len(tools) == 1 else "#/items/anyOf/{}"
    variants = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t.function.name},
                "parameters": _relocated(
                    _parameters(t.function.name, t.function.parameters),
                    at.format(i) + "/properties/parameters",
                ),
            },
            "required": ["name", "parameters"],
        }
        for i, t in enumerate(tools)
    ]
    schema: Json = {
        "type": "array",
        "items": variants[0] if len(variants) == 1 else {"anyOf": variants},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


@dataclass(slots=True)
class ToolPlan:
    """How one chat request handles tools: what the template gets, what grammar (if any)
    forces the output, and how the output is read."""

    mode: str = "none"  # none | auto | required | named
    tools: list[Json] | None = None  # for the chat template
    parser: str = "hermes"
    function: str | None = None  # the named function
    parallel: bool = True
    structured_output: StructuredOutput | None = None  # required / named

    @classmethod
    def of(cls, req: ChatCompletionRequest, tokenizer: Tokenizer, parser: str | None) -> ToolPlan:
        """The plan of ``req``; 400 for a ``tool_choice`` without tools, an unknown named
        function, duplicate names, or ``"auto"`` with a template that cannot show tools."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none"):
                raise OpenAIError(
                    400, "tool_choice needs tools: the request defines none", param="tool_choice"
                )
            return cls()
        names = [t.function.name for t in req.tools]
        if len(set(names)) != len(names):
            raise OpenAIError(400, "tools must have distinct function names", param="tools")
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        plan = cls(
            tools=tools,
            parser=parser or detect_parser(tokenizer.chat_template),
            parallel=req.parallel_tool_calls,
        )
        if choice is None or choice == "auto":
            if not tokenizer.chat_template_takes_tools:
                raise OpenAIError(
                    400,
                    "tool_choice 'auto' needs a chat template that renders tools, and this "
                    "model's does not; use tool_choice 'required' or a named function (a "
                    "grammar then writes the calls), or serve a tool-capable chat template",
                    param="tool_choice",
                )
            plan.mode = "auto"
        elif choice == "none":
            plan.mode = "none"
        elif choice == "required":
            plan.mode = "required"
            schema = required_calls_schema(req.tools, req.parallel_tool_calls)
            plan.structured_output = StructuredOutput(json_schema=schema)
        else:
            assert not isinstance(choice, str)
            match = [t for t in req.tools if t.function.name == choice.function.name]
            if not match:
                raise OpenAIError(
                    400,
                    f"tool_choice names the function {choice.function.name!r}, which is not "
                    "among the tools",
                    param="tool_choice",
                )
            plan.mode = "named"
            plan.function = choice.function.name
            parameters = _parameters(plan.function, match[0].function.parameters)
            plan.structured_output = StructuredOutput(json_schema=parameters)
        return plan

    @property
    def parses(self) -> bool:
        return self.mode != "none"

    def parse(self, text: str) -> tuple[str | None, list[ToolCallOut]]:
        """The content and the calls of a complete output."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            assert self.function is not None
            return None, [ToolCallOut(self.function, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:  # cut by max_tokens
                return text, []
            if not isinstance(items, list):
                return text, []
            found = [_call(item, ("parameters", "arguments")) for item in items]
            calls = [c for c in found if c is not None]
            if not calls or len(calls) != len(found):
                return text, []
            return None, calls
        content, calls = (parse_hermes if self.parser == "hermes" else parse_llama3_json)(text)
        if calls and not self.parallel:
            calls = calls[:1]
        return content, calls

    def finish_reason(self, reason: str | None, called: bool) -> str | None:
        """OpenAI's finish reason: ``tool_calls`` when the model stopped after calling (but
        ``stop`` for a forced named function)."""
        if reason == "stop" and called and self.mode != "named":
            return "tool_calls"
        return reason

    def message(self, text: str) -> tuple[Json, bool]:
        """The assistant message of a complete output, and whether it holds calls."""
        content, calls = self.parse(text)
        message: Json = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [c.as_json() for c in calls]
        return message, bool(calls)

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self)


def _held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


# the head of a call object, up to where its arguments object begins: from then on the
# arguments can be streamed as they are written
_CALL_HEAD = re.compile(
    r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\{)'
)
_ITEM_GAP = re.compile(r"\s*[\[,]?\s*")  # what comes before an array's next call object
_OBJECT_END = re.compile(r"\s*\}")


def _merged(deltas: list[Json]) -> list[Json]:
    """Call deltas with one entry per call index (a header and its first arguments in one)."""
    out: list[Json] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            function = out[-1]["function"]
            function["arguments"] = function.get("arguments", "") + d["function"]["arguments"]
        else:
            out.append(d)
    return out


def _name(quoted: str) -> str | None:
    """A call's name from its JSON string body (None when it is not valid JSON)."""
    try:
        name = json.loads(f'"{quoted}"')
    except json.JSONDecodeError:
        return None
    return name if isinstance(name, str) else None


@dataclass(slots=True)
class _OpenCall:
    """A call whose header (id, name) has been streamed: where its arguments object starts in
    the text it is read from, and how many of its characters were streamed."""

    start: int
    sent: int = 0

    def delta(self, text: str, index: int, complete: bool) -> Json | None:
        """The arguments delta of ``text`` (its arguments from ``start``): all of the object
        when ``complete``, else what cannot be its closing braces; None when nothing is new."""
        body = text[self.start :]
        if complete:
            try:
                _, end = json.JSONDecoder().raw_decode(body)
            except json.JSONDecodeError:
                end = len(body)
            body = body[:end]
        else:
            body = body.rstrip(" \t\r\n}")
        if len(body) <= self.sent:
            return None
        piece, self.sent = body[self.sent :], len(body)
        return {"index": index, "function": {"arguments": piece}}


@dataclass(slots=True)
class ToolStreamer:
    """One choice's stream: text deltas in, chat deltas out: content as soon as it cannot be
    part of a call; a call's header (id, name) as soon as its name is known, then its
    arguments as they are written (``hermes``, ``required``, a named function; ``llama3_json``
    calls once complete). The streamed arguments are the model's JSON text of the arguments
    object (the complete answer carries the same object, its JSON normalised)."""

    plan: ToolPlan
    buffer: str = ""  # text received but not emitted
    in_calls: bool = False  # a call has begun: the rest is held for the parser
    num_calls: int = 0  # calls emitted (-1: a llama3_json output found to be plain text)
    open: _OpenCall | None = None  # the call being streamed
    pos: int = 0  # required: where the next call object may begin in the buffer

    def feed(self, text: str) -> Json:
        """The delta (``content`` and/or ``tool_calls``, possibly empty) for new text."""
        self.buffer += text
        plan = self.plan
        if plan.mode == "named":
            return self._named(False)
        if plan.mode == "required":
            return self._required(False)
        if plan.parser == "llama3_json":
            # the output is calls when it opens with "{" or the python tag: then hold it all
            if self.num_calls >= 0:
                head = self.buffer.lstrip()
                if self.in_calls or not head or _PYTHON_TAG.startswith(head):
                    return {}
                if head.startswith(("{", _PYTHON_TAG)):
                    self.in_calls = True
                    return {}
                self.num_calls = -1  # decided: plain text (no call will be parsed)
            text, self.buffer = self.buffer, ""
            return {"content": text}
        return self._hermes()

    def step(self, text: str, finished: bool) -> Json:
        """``feed(text)``, with ``close()``'s last delta merged in when the output is
        ``finished``."""
        delta = self.feed(text)
        if finished:
            last = self.close()
            if "content" in last:
                delta["content"] = delta.get("content", "") + last["content"]
            if "tool_calls" in last:
                delta["tool_calls"] = delta.get("tool_calls", []) + last["tool_calls"]
        return delta

    def _header(self, name: str) -> Json:
        """A new call's first delta: its index, id and name, no arguments yet."""
        return ToolCallOut(name, "").as_json(self.num_calls)

    @staticmethod
    def _calls(*deltas: Json | None) -> Json:
        calls = _merged([d for d in deltas if d is not None])
        return {"tool_calls": calls} if calls else {}

    def _named(self, complete: bool) -> Json:
        """A named function: the whole output is its arguments object."""
        header = None
        if self.open is None and (self.buffer or complete):
            assert self.plan.function is not None
            header, self.open = self._header(self.plan.function), _OpenCall(0)
            self.num_calls = 1
        if self.open is None:
            return {}
        return self._calls(header, self.open.delta(self.buffer, 0, complete))

    def _required(self, complete: bool) -> Json:
        """``tool_choice "required"``: a JSON array of ``{"name", "parameters"}`` objects, each
        streamed as a call as soon as its name is known."""
        deltas: list[Json | None] = []
        while True:
            if self.open is None:
                gap = _ITEM_GAP.match(self.buffer, self.pos)
                head = _CALL_HEAD.match(self.buffer, gap.end() if gap else self.pos)
                name = None if head is None else _name(head.group(1))
                if head is None or name is None:
                    break
                deltas.append(self._header(name))
                self.open = _OpenCall(head.end())
            try:
                _, end = json.JSONDecoder().raw_decode(self.buffer, self.open.start)
            except json.JSONDecodeError:
                deltas.append(self.open.delta(self.buffer, self.num_calls, complete))
                break
            deltas.append(self.open.delta(self.buffer[:end], self.num_calls, True))
            close = _OBJECT_END.match(self.buffer, end)
            if close is None and not complete:
                break  # the call object's own "}" is still to come
            self.pos = close.end() if close else end
            self.open = None
            self.num_calls += 1
        return self._calls(*deltas)

    def _hermes(self) -> Json:
        delta: Json = {}
        calls: list[Json] = []
        while True:
            if not self.in_calls:
                start = self.buffer.find(_HERMES_OPEN)
                if start < 0:
                    keep = _held_back(self.buffer, _HERMES_OPEN)
                    emit = self.buffer[: len(self.buffer) - keep]
                    self.buffer = self.buffer[len(emit) :]
                    if emit and not self.num_calls:
                        delta["content"] = delta.get("content", "") + emit
                    break
                if start and not self.num_calls:
                    delta["content"] = delta.get("content", "") + self.buffer[:start]
                self.buffer = self.buffer[start:]
                self.in_calls = True
            end = self.buffer.find(_HERMES_CLOSE)
            if end < 0:
                calls += self._hermes_partial()
                break
            block = self.buffer[len(_HERMES_OPEN) : end]
            self.buffer = self.buffer[end + len(_HERMES_CLOSE) :]
            self.in_calls = False
            calls += self._hermes_block(block, delta)
        if calls:
            delta["tool_calls"] = _merged(calls)
        return delta

    def _streams(self) -> bool:
        """Whether a new call may be streamed (one call at most without parallel calls)."""
        return self.plan.parallel or not self.num_calls

    def _hermes_partial(self) -> list[Json]:
        """The deltas of a ``<tool_call>`` block still being written: its header once its
        name is known, then its arguments (what may begin ``</tool_call>`` held back)."""
        block = self.buffer[len(_HERMES_OPEN) :]
        block = block[: len(block) - _held_back(block, _HERMES_CLOSE)]
        out: list[Json] = []
        if self.open is None:
            head = _CALL_HEAD.match(block)
            name = None if head is None else _name(head.group(1))
            if head is None or name is None or not self._streams():
                return out
            out.append(self._header(name))
            self.open = _OpenCall(head.end())
        piece = self.open.delta(block, self.num_calls, False)
        return out + ([piece] if piece is not None else [])

    def _hermes_block(self, block: str, delta: Json) -> list[Json]:
        """The deltas that complete a ``<tool_call>`` block: the rest of a streamed call's
        arguments, or the whole call (text, when the block is not a call)."""
        if self.open is not None:
            piece = self.open.delta(block, self.num_calls, True)
            self.open = None
            self.num_calls += 1
            return [piece] if piece is not None else []
        call = self._parse_block(block)
        if call is None:  # not a call: show it as text
            delta["content"] = delta.get("content", "") + _HERMES_OPEN + block + _HERMES_CLOSE
            return []
        if not self._streams():
            return []
        self.num_calls += 1
        return [call.as_json(self.num_calls - 1)]

    @staticmethod
    def _parse_block(block: str) -> ToolCallOut | None:
        try:
            return _call(json.loads(block))
        except json.JSONDecodeError:
            return None

    def close(self) -> Json:
        """The last delta, once the output is complete."""
        plan = self.plan
        if plan.mode == "named":
            return self._named(True)
        if plan.mode == "required":
            return self._required(True)
        rest, self.buffer = self.buffer, ""
        if plan.parser == "llama3_json":
            if not rest:
                return {}
            if self.num_calls < 0:  # llama3_json output already streamed as text
                return {"content": rest}
            content, calls = plan.parse(rest)
            delta: Json = {}
            if content:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = [c.as_json(i) for i, c in enumerate(calls)]
                self.num_calls = len(calls)
            return delta
        if self.in_calls:  # a call left open at the end of the output
            block = rest[len(_HERMES_OPEN) :]
            if self.open is not None:
                piece = self.open.delta(block, self.num_calls, True)
                self.num_calls += 1
                return self._calls(piece)
            call = self._parse_block(block)
            if call is not None and self._streams():
                self.num_calls += 1
                return {"tool_calls": [call.as_json(self.num_calls - 1)]}
        return {"content": rest} if rest and not self.num_calls else {}
