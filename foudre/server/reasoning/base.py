"""The interface every reasoning format implements.

A model that thinks before it answers writes its reasoning, then its answer, in one output.
A ``ReasoningParser`` splits the two: ``parse`` / ``extract`` on a whole output, ``streamer``
on an output that arrives in pieces (text deltas, a marker possibly cut across two of them).
Both give the same split: ``parse(text)`` is a streamer fed ``text`` at once, so a stream's
concatenated deltas always equal the whole output's parts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from foudre.server.tools import ToolCallOut


@dataclass(slots=True)
class Parsed:
    """What an output (or a piece of one) holds: reasoning text, answer text, and the tool
    calls that a format carrying its own calls (harmony) completed."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCallOut] = field(default_factory=list)

    def add(self, other: Parsed) -> Parsed:
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls
        return self


class ReasoningStreamer(ABC):
    """One output's split, piece by piece: each ``feed`` returns what became certain (text
    that may still turn out to be a marker is held back), ``close`` the rest."""

    @abstractmethod
    def feed(self, text: str) -> Parsed: ...

    @abstractmethod
    def close(self) -> Parsed: ...

    def step(self, text: str, finished: bool) -> Parsed:
        """``feed(text)``, with ``close()`` added when the output is ``finished``."""
        out = self.feed(text)
        return out.add(self.close()) if finished else out


def held_back(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that could be the start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser(ABC):
    """One reasoning format. ``answer_marker``: the text after which the answer begins (a
    grammar for the answer starts after it); ``reads_tool_calls``: the format carries its own
    tool calls (else the tool-call parser reads the answer); ``skip_special_tokens``: whether
    the output text may drop special tokens (False when the markers are special tokens)."""

    name: ClassVar[str]
    answer_marker: ClassVar[str]
    reads_tool_calls: ClassVar[bool] = False
    skip_special_tokens: ClassVar[bool] = True

    @abstractmethod
    def streamer(self, prompt: str = "") -> ReasoningStreamer:
        """A streamer for an output that continues ``prompt`` (the rendered chat prompt, which
        tells whether the output starts inside the reasoning or after it)."""

    def parse(self, text: str, prompt: str = "") -> Parsed:
        """The split of a whole output (the same as streaming it in any pieces)."""
        s = self.streamer(prompt)
        return s.feed(text).add(s.close())

    def extract(self, text: str, prompt: str = "") -> tuple[str | None, str | None]:
        """``(reasoning, content)`` of a whole output, None for a part that is empty."""
        parsed = self.parse(text, prompt)
        return parsed.reasoning or None, parsed.content or None

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, tools: list[Any] | None
    ) -> str | None:
        """The prompt of a conversation in the format's own rendering, for a model without a
        chat template (None: the format has none; the tokenizer's fallback is used)."""
        return None

    def reasoning_ended(self, prompt: str) -> bool:
        """Whether an output continuing ``prompt`` starts with its answer (the template closed
        the reasoning itself, as Qwen3's does with ``enable_thinking=False``)."""
        return prompt.rstrip().endswith(self.answer_marker)

    def opening_marker(self, prompt: str) -> str | None:
        """The marker whose appearance first would start an output continuing ``prompt`` in
        its reasoning, where the output may as well be all answer (Qwen3 not thinking: no
        ``<think>``); None where the prompt decides (the output starts inside the reasoning,
        or after it)."""
        return None
