"""Reasoning output: a thinking model's reasoning separated from its answer.

One file per format, each a ``ReasoningParser`` (``base.py``) registered here by name:
``qwen3`` and ``deepseek_r1`` (``<think>...</think>``, ``think.py``), ``gpt_oss`` (harmony
channels, ``harmony.py``). ``reasoning_parser`` makes one by name; ``detect_reasoning_parser``
names the one a chat template calls for.
"""

from __future__ import annotations

from foudre.server.reasoning.base import (
    Parsed,
    ReasoningParser,
    ReasoningStreamer,
)
from foudre.server.reasoning.harmony import GptOssReasoningParser, HarmonyUnavailableError
from foudre.server.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    cls.name: cls
    for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser, GptOssReasoningParser)
}
# what --reasoning-parser takes besides the names: no reasoning parsing at all
OFF = "none"

__all__ = [
    "OFF",
    "REASONING_PARSERS",
    "HarmonyUnavailableError",
    "Parsed",
    "ReasoningParser",
    "ReasoningStreamer",
    "choose_reasoning_parser",
    "detect_reasoning_parser",
    "reasoning_parser",
]


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser named ``name``; ``ValueError`` listing the names for an unknown one,
    ``HarmonyUnavailableError`` when gpt_oss's package or vocabulary is missing."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        choices = ", ".join(sorted(REASONING_PARSERS))
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {choices} or {OFF!r}")
    return cls()


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """The reasoning format a chat template writes: harmony's ``<|channel|>`` is gpt_oss; a
    ``<think>`` is deepseek_r1 when the template is DeepSeek's (its ``<｜Assistant｜>`` turn),
    else qwen3; None when it shows no reasoning."""
    template = chat_template or ""
    if "<|channel|>" in template:
        return "gpt_oss"
    if "<think>" in template:
        return "deepseek_r1" if "<｜Assistant｜>" in template else "qwen3"
    return None


def choose_reasoning_parser(
    name: str | None, chat_template: str | None
) -> tuple[ReasoningParser | None, str]:
    """The parser a server uses and why: ``name`` when given (``"none"``: off), else the one
    the chat template calls for (none when it shows no reasoning). ``ValueError`` for an
    unknown name; ``HarmonyUnavailableError`` when gpt_oss, asked by name, cannot load harmony
    (detected, it is turned off with the reason instead: a server that ran without reasoning
    parsing still starts)."""
    if name == OFF:
        return None, "off (--reasoning-parser none)"
    if name is not None:
        return reasoning_parser(name), f"{name} (asked)"
    detected = detect_reasoning_parser(chat_template)
    if detected is None:
        return None, "off (the chat template shows no reasoning)"
    try:
        return reasoning_parser(detected), f"{detected} (detected from the chat template)"
    except HarmonyUnavailableError as e:
        return None, f"off: the chat template asks for {detected}, which cannot load ({e})"
