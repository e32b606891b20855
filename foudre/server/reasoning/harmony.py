"""gpt-oss's harmony format, read with OpenAI's ``openai-harmony`` package.

An assistant output is a sequence of messages, each ``<|channel|>NAME<|message|>text`` ended by
``<|end|>`` (then ``<|start|>assistant`` opens the next), ``<|call|>`` or ``<|return|>``:

- ``analysis``: the reasoning;
- ``final``: the answer;
- ``commentary``: a tool call when its header names a recipient (``to=functions.NAME``, the
  text its JSON arguments), else a preamble shown to the user (answer text).

A model without a chat template gets its prompt rendered by openai-harmony (``render``: the
system message, the developer's instructions and function tools, the turns, tool calls and
their results). The markers are special tokens, so the output is decoded with them
(``skip_special_tokens`` False) and the text is encoded back with harmony's own vocabulary
(o200k, which openai-harmony loads from ``TIKTOKEN_ENCODINGS_BASE``, a folder holding
``o200k_base.tiktoken``, or downloads) and fed to its ``StreamableParser``. The vocabulary is
loaded once, when the parser is made.
"""

from __future__ import annotations

import functools
import json
from typing import Any, ClassVar

from foudre.server.reasoning.base import Parsed, ReasoningParser, ReasoningStreamer
from foudre.server.tools import ToolCallOut

FINAL_HEADER = "<|channel|>final<|message|>"
_SPECIAL_START = "<|"
_FUNCTIONS = "functions."


class HarmonyUnavailableError(RuntimeError):
    """openai-harmony is not installed, or its vocabulary cannot be loaded."""


@functools.cache
def harmony_encoding() -> Any:
    """openai-harmony's gpt-oss encoding; ``HarmonyUnavailableError`` saying what is missing."""
    try:
        import openai_harmony as oh
    except ImportError:
        raise HarmonyUnavailableError(
            "the gpt_oss reasoning parser needs the openai-harmony package (pip install "
            "openai-harmony)"
        ) from None
    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    except oh.HarmonyError as e:
        raise HarmonyUnavailableError(
            f"openai-harmony cannot load its o200k vocabulary ({e}); offline, set "
            "TIKTOKEN_ENCODINGS_BASE to a folder holding o200k_base.tiktoken"
        ) from None


def _ready(text: str) -> int:
    """How much of ``text`` can be encoded now: all but a last ``<|...`` that may be a special
    token still being written."""
    at = text.rfind(_SPECIAL_START)
    if at >= 0 and text.find("|>", at + 2) < 0:
        return at
    return len(text) - 1 if text.endswith("<") else len(text)


class HarmonyStreamer(ReasoningStreamer):
    """Text in, encoded with harmony's vocabulary and fed to its ``StreamableParser``; each
    content delta goes to the reasoning or the answer by its message's channel, a call's
    arguments are kept until its message ends. Text that does not follow the format (the
    parser refuses it) is answer text from there on."""

    def __init__(self, encoding: Any) -> None:
        import openai_harmony as oh

        self.encoding = encoding
        self.parser = oh.StreamableParser(encoding, oh.Role.ASSISTANT)
        self.pending = ""
        self.broken = False
        self.begun = False  # the output has shown that it opens with a special token
        self.num_messages = 0
        # the tokens that end a message (<|end|>, <|call|>, <|return|>): only then can a
        # call be complete, so the parser's messages are only read then
        self.message_ends = frozenset(encoding.stop_tokens())

    def feed(self, text: str) -> Parsed:
        self.pending += text
        if not self.begun and not self.broken:
            head = self.pending[: len(_SPECIAL_START)]
            if not _SPECIAL_START.startswith(head):
                self.broken = True  # not the format: answer text (a model not following it)
            self.begun = len(head) == len(_SPECIAL_START)
        if self.broken:
            out, self.pending = Parsed(content=self.pending), ""
            return out
        n = _ready(self.pending)
        ready, self.pending = self.pending[:n], self.pending[n:]
        return self._process(ready)

    def _process(self, text: str) -> Parsed:
        import openai_harmony as oh

        out = Parsed()
        tokens = self.encoding.encode(text, allowed_special="all") if text else []
        for i, token in enumerate(tokens):
            try:
                self.parser.process(token)
            except oh.HarmonyError:
                self.broken = True
                out.content += self.encoding.decode(tokens[i:])
                return out
            delta = self.parser.last_content_delta
            if delta:
                self._route(delta, out)
            if token in self.message_ends:
                self._ended(out)
        return out

    def _route(self, delta: str, out: Parsed) -> None:
        channel = self.parser.current_channel
        recipient = self.parser.current_recipient
        if channel == "analysis":
            out.reasoning += delta
        elif not (recipient or "").startswith(_FUNCTIONS):
            out.content += delta  # final, or a commentary preamble

    def _ended(self, out: Parsed) -> None:
        """Calls of the messages that ended since last time."""
        messages = self.parser.messages
        for message in messages[self.num_messages :]:
            recipient = message.recipient or ""
            if recipient.startswith(_FUNCTIONS):
                arguments = "".join(getattr(c, "text", "") for c in message.content)
                out.calls.append(ToolCallOut(recipient[len(_FUNCTIONS) :], arguments))
        self.num_messages = len(messages)

    def close(self) -> Parsed:
        import openai_harmony as oh

        rest, self.pending = self.pending, ""
        if self.broken:
            return Parsed(content=rest)
        out = self._process(rest)
        if not self.broken:
            try:
                self.parser.process_eos()  # the stop token (<|return|>, <|call|>) is not text
            except oh.HarmonyError:
                return out
            self._ended(out)
        return out


class GptOssReasoningParser(ReasoningParser):
    name = "gpt_oss"
    answer_marker: ClassVar[str] = FINAL_HEADER
    reads_tool_calls = True
    skip_special_tokens = False

    def __init__(self) -> None:
        self.encoding = harmony_encoding()

    def streamer(self, prompt: str = "") -> ReasoningStreamer:
        return HarmonyStreamer(self.encoding)

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[Any] | None
    ) -> str:
        return render_harmony(self.encoding, messages, add_generation_prompt, tools)

    def reasoning_ended(self, prompt: str) -> bool:
        return prompt.endswith(FINAL_HEADER)


def _developer(oh: Any, instructions: list[str], tools: list[Any] | None) -> Any:
    """The developer message: the request's system text as instructions, its function tools."""
    content = oh.DeveloperContent.new()
    if instructions:
        content = content.with_instructions("\n\n".join(instructions))
    functions = [t.get("function", t) for t in tools or []]
    if functions:
        content = content.with_function_tools(
            [
                oh.ToolDescription.new(f["name"], f.get("description") or "", f.get("parameters"))
                for f in functions
            ]
        )
    return oh.Message.from_role_and_content(oh.Role.DEVELOPER, content)


def _turns(oh: Any, messages: list[dict[str, Any]]) -> list[Any]:
    """The conversation's turns as harmony messages: an assistant's reasoning on the analysis
    channel, its answer on the final channel, its calls on the commentary channel to
    ``functions.NAME``, a tool result from that function back to the assistant."""
    out: list[Any] = []
    names: dict[str, str] = {}  # tool call id -> function name
    for m in messages:
        role, text = m["role"], m.get("content") or ""
        if role == "user":
            out.append(oh.Message.from_role_and_content(oh.Role.USER, text))
        elif role == "assistant":
            if m.get("reasoning_content"):  # harmony drops it where the model no longer needs it
                message = oh.Message.from_role_and_content(
                    oh.Role.ASSISTANT, m["reasoning_content"]
                )
                out.append(message.with_channel("analysis"))
            if text:
                message = oh.Message.from_role_and_content(oh.Role.ASSISTANT, text)
                out.append(message.with_channel("final"))
            for call in m.get("tool_calls") or []:
                name = call["function"]["name"]
                names[call.get("id", "")] = name
                arguments = call["function"]["arguments"]
                if not isinstance(arguments, str):
                    arguments = json.dumps(arguments, ensure_ascii=False)
                message = oh.Message.from_role_and_content(oh.Role.ASSISTANT, arguments)
                out.append(
                    message.with_channel("commentary")
                    .with_recipient(f"{_FUNCTIONS}{name}")
                    .with_content_type("<|constrain|>json")
                )
        elif role == "tool":
            name = names.get(m.get("tool_call_id") or "", m.get("name") or "tool")
            author = oh.Author.new(oh.Role.TOOL, f"{_FUNCTIONS}{name}")
            message = oh.Message.from_author_and_content(author, text)
            out.append(message.with_channel("commentary").with_recipient("assistant"))
    return out


def render_harmony(
    encoding: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    tools: list[Any] | None,
) -> str:
    """A chat conversation (the messages as chat templates read them) rendered by
    openai-harmony: harmony's system message, a developer message with the system/developer
    text and the function tools, then the turns; ``<|start|>assistant`` last when a
    generation prompt is asked."""
    import openai_harmony as oh

    instructions = [
        m.get("content") or "" for m in messages if m["role"] in ("system", "developer")
    ]
    rendered = [oh.Message.from_role_and_content(oh.Role.SYSTEM, oh.SystemContent.new())]
    if instructions or tools:
        rendered.append(_developer(oh, instructions, tools))
    rendered += _turns(oh, [m for m in messages if m["role"] not in ("system", "developer")])
    conversation = oh.Conversation.from_messages(rendered)
    if add_generation_prompt:
        tokens = encoding.render_conversation_for_completion(conversation, oh.Role.ASSISTANT)
    else:
        tokens = encoding.render_conversation(conversation)
    return str(encoding.decode(tokens))
