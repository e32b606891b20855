"""``<think>...</think>`` reasoning: Qwen3 and DeepSeek-R1.

The output is ``<think>reasoning</think>answer``. Both parsers read it the same way and differ
in where an output starts when the prompt does not say:

- ``qwen3``: the model opens ``<think>`` itself; an output that does not begin with it is all
  answer (a model not thinking);
- ``deepseek_r1``: R1's template opens ``<think>`` in the prompt, so the output may start inside
  the reasoning with only ``</think>`` appearing: it is reasoning until ``</think>``.

A prompt ending with ``<think>`` starts the output inside the reasoning; one ending with
``</think>`` (Qwen3's ``enable_thinking=False`` writes an empty block) starts it in the answer.
Reasoning and answer are stripped of the whitespace around the markers.
"""

from __future__ import annotations

from typing import ClassVar

from foudre.server.reasoning.base import Parsed, ReasoningParser, ReasoningStreamer, held_back

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class ThinkStreamer(ReasoningStreamer):
    """States: ``start`` (not yet known whether ``<think>`` opens the output), ``reasoning``,
    ``content``. Held back: a possible ``<think>`` at the start, a possible ``</think>`` and
    trailing whitespace in the reasoning, leading whitespace of either part."""

    def __init__(self, state: str, open_by_default: bool) -> None:
        self.state = state
        self.open_by_default = open_by_default  # start state: no <think> still means reasoning
        self.buffer = ""
        self.begun = False  # the current part has shown a non-whitespace character

    def _enter(self, state: str) -> None:
        self.state, self.begun = state, False

    def _lead(self, text: str) -> str:
        """``text`` without the whitespace that would begin the current part."""
        if not self.begun:
            text = text.lstrip()
            self.begun = bool(text)
        return text

    def feed(self, text: str) -> Parsed:
        self.buffer += text
        out = Parsed()
        if self.state == "start":
            head = self.buffer.lstrip()
            if len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                return out  # may still become <think>
            if head.startswith(THINK_OPEN):
                self.buffer = head[len(THINK_OPEN) :]
                self._enter("reasoning")
            else:
                self._enter("reasoning" if self.open_by_default else "content")
        if self.state == "reasoning":
            end = self.buffer.find(THINK_CLOSE)
            if end < 0:
                keep = held_back(self.buffer, THINK_CLOSE)
                ready = self.buffer[: len(self.buffer) - keep]
                ready = ready[: len(ready.rstrip())]  # trailing whitespace: maybe before </think>
                self.buffer = self.buffer[len(ready) :]
                out.reasoning = self._lead(ready)
                return out
            out.reasoning = self._lead(self.buffer[:end].rstrip())
            self.buffer = self.buffer[end + len(THINK_CLOSE) :]
            self._enter("content")
        out.content, self.buffer = self._lead(self.buffer), ""
        return out

    def close(self) -> Parsed:
        rest, self.buffer = self.buffer, ""
        if self.state == "start":
            self._enter("reasoning" if self.open_by_default else "content")
        if self.state == "reasoning":
            return Parsed(reasoning=self._lead(rest.rstrip()))
        return Parsed(content=self._lead(rest))


class _ThinkParser(ReasoningParser):
    answer_marker: ClassVar[str] = THINK_CLOSE
    open_by_default: ClassVar[bool]

    def streamer(self, prompt: str = "") -> ReasoningStreamer:
        tail = prompt.rstrip()
        if tail.endswith(THINK_CLOSE):
            return ThinkStreamer("content", False)
        if tail.endswith(THINK_OPEN):
            return ThinkStreamer("reasoning", True)
        return ThinkStreamer("start", self.open_by_default)

    def opening_marker(self, prompt: str) -> str | None:
        tail = prompt.rstrip()
        if self.open_by_default or tail.endswith((THINK_OPEN, THINK_CLOSE)):
            return None
        return THINK_OPEN


class Qwen3ReasoningParser(_ThinkParser):
    name = "qwen3"
    open_by_default = False


class DeepSeekR1ReasoningParser(_ThinkParser):
    name = "deepseek_r1"
    open_by_default = True
