"""The reasoning parsers on their own: each format, whole and streamed in pieces cut at every
position (markers cut across pieces), the tool calls they read, how the server's chat run
reads calls from the answer only, and the choice of a parser by name or chat template.

The harmony tests build their outputs with openai-harmony's own renderer (the reference) and
skip, saying why, when its o200k vocabulary cannot be loaded (offline without
``TIKTOKEN_ENCODINGS_BASE``; ``scripts/o200k_vocab.py`` writes the file, and ``setup.sh``
puts it in ``.venv/o200k``, which is used when the variable is unset).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foudre.server.reasoning import (
    OFF,
    REASONING_PARSERS,
    HarmonyUnavailableError,
    Parsed,
    ReasoningParser,
    choose_reasoning_parser,
    detect_reasoning_parser,
    reasoning_parser,
)
from foudre.server.tools import ToolPlan

_VOCAB = Path(sys.prefix) / "o200k"
if "TIKTOKEN_ENCODINGS_BASE" not in os.environ and (_VOCAB / "o200k_base.tiktoken").exists():
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(_VOCAB)


def _streamed(parser: ReasoningParser, pieces: list[str], prompt: str = "") -> Parsed:
    streamer = parser.streamer(prompt)
    out = Parsed()
    for i, piece in enumerate(pieces):
        out.add(streamer.step(piece, i == len(pieces) - 1))
    return out


def _splits(text: str) -> list[list[str]]:
    """``text`` whole, one character a piece, and cut in two and in three at every pair of
    positions (sparser for long texts)."""
    out = [[text], list(text) or [""]]
    step = 1 if len(text) <= 60 else 3
    for i in range(0, len(text) + 1, step):
        out.append([text[:i], text[i:]])
        for j in range(i, len(text) + 1, step * 4):
            out.append([text[:i], text[i:j], text[j:]])
    return out


THINK_CASES: list[tuple[str, str, str, str, str]] = [
    # parser, prompt, output, reasoning, content
    (
        "qwen3",
        "",
        "<think>\nLet me see: 2+2.\n</think>\n\nIt is 4.",
        "Let me see: 2+2.",
        "It is 4.",
    ),
    ("qwen3", "", "It is 4, no thinking.", "", "It is 4, no thinking."),
    ("qwen3", "", "<think>\n\n</think>\n\nIt is 4.", "", "It is 4."),  # an empty block
    ("qwen3", "", "<think>cut short </thi", "cut short </thi", ""),  # stopped while reasoning
    ("qwen3", "", "<thin", "", "<thin"),  # neither <think> nor reasoning
    # Qwen3's enable_thinking=False: the template writes the empty block, the output answers
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", "It is 4.", "", "It is 4."),
    # a template that opens <think> (Qwen3 thinking-2507, R1): only </think> in the output
    ("qwen3", "<|im_start|>assistant\n<think>\n", "a < b</think>\nyes", "a < b", "yes"),
    ("deepseek_r1", "", "Hmm, 2+2 </ is 4.\n</think>\n\nFour.", "Hmm, 2+2 </ is 4.", "Four."),
    ("deepseek_r1", "", "<think>\nHmm.</think>Four.", "Hmm.", "Four."),
    ("deepseek_r1", "", "all reasoning, cut", "all reasoning, cut", ""),
    ("deepseek_r1", "", "x</think></think>y", "x", "</think>y"),
]


@pytest.mark.parametrize(("name", "prompt", "text", "reasoning", "content"), THINK_CASES)
def test_think_parsers_whole_and_streamed(
    name: str, prompt: str, text: str, reasoning: str, content: str
) -> None:
    parser = reasoning_parser(name)
    assert parser.extract(text, prompt) == (reasoning or None, content or None)
    for pieces in _splits(text):
        got = _streamed(parser, pieces, prompt)
        assert (got.reasoning, got.content) == (reasoning, content), pieces


def test_think_streamer_never_shows_a_marker_or_holds_back_for_long() -> None:
    parser = reasoning_parser("qwen3")
    streamer = parser.streamer()
    deltas = [streamer.feed(c) for c in "<think>abc </think> def"]
    shown = "".join(d.reasoning + d.content for d in deltas)
    assert "<" not in shown and ">" not in shown
    # what is released comes as soon as it cannot be a marker: "abc" before "</think>" ends
    assert "".join(d.reasoning for d in deltas[:11]) == "abc"
    assert "".join(d.content for d in deltas) == "def"


def _harmony() -> Any:
    try:
        parser = reasoning_parser("gpt_oss")
    except HarmonyUnavailableError as e:
        pytest.skip(str(e))
    return parser


def _render(messages: list[Any]) -> str:
    """An assistant output as gpt-oss writes it after its prompt's ``<|start|>assistant``:
    openai-harmony's rendering of ``messages``, without that opening and the last end
    marker (the stop token, which is not text)."""
    import openai_harmony as oh

    enc = oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    tokens: list[int] = []
    for m in messages:
        tokens += enc.render(m)
    text = str(enc.decode(tokens))
    start = "<|start|>assistant"
    assert text.startswith(start)
    text = text[len(start) :]
    for end in ("<|end|>", "<|call|>", "<|return|>"):
        text = text.removesuffix(end)
    return text


def _msg(channel: str, text: str, recipient: str | None = None) -> Any:
    import openai_harmony as oh

    m = oh.Message.from_role_and_content(oh.Role.ASSISTANT, text).with_channel(channel)
    if recipient is not None:
        m = m.with_recipient(recipient).with_content_type("<|constrain|>json")
    return m


def test_harmony_reasoning_and_answer_whole_and_streamed() -> None:
    parser = _harmony()
    text = _render(
        [
            _msg("analysis", "The user asks 2+2; é is fine."),
            _msg("final", "It is 4 <not a tag>."),
        ]
    )
    assert "<|channel|>analysis<|message|>" in text and "<|channel|>final<|message|>" in text
    expected = ("The user asks 2+2; é is fine.", "It is 4 <not a tag>.")
    assert parser.extract(text) == expected
    for pieces in _splits(text):
        got = _streamed(parser, pieces)
        assert (got.reasoning, got.content, got.calls) == (*expected, []), pieces


def test_harmony_tool_calls_from_the_commentary_channel() -> None:
    parser = _harmony()
    args = {"city": "Paris", "days": 3}
    text = _render(
        [
            _msg("analysis", "Need the weather."),
            _msg("commentary", json.dumps(args), "functions.get_weather"),
        ]
    )
    whole = parser.parse(text)
    assert whole.reasoning == "Need the weather." and whole.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in whole.calls] == [("get_weather", args)]
    for pieces in _splits(text)[::7]:
        got = _streamed(parser, pieces)
        assert [(c.name, json.loads(c.arguments)) for c in got.calls] == [("get_weather", args)]
        assert got.reasoning == "Need the weather."


def test_harmony_text_outside_the_format_is_answer_text() -> None:
    parser = _harmony()
    assert parser.extract("plain words, no channels") == (None, "plain words, no channels")


class _Run:
    """What ``ChatRun.answer`` reads, without a request behind it."""

    @staticmethod
    def of(parser: ReasoningParser | None, plan: ToolPlan, prompt: str = "") -> Any:
        from foudre.server.serving_chat import ChatRun

        return ChatRun("id", None, plan, None, None, None, None, parser, prompt)  # type: ignore[arg-type]


def test_tool_calls_are_read_from_the_answer_only() -> None:
    call = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    decoy = '<tool_call>{"name": "g", "arguments": {}}</tool_call>'
    text = f"<think>maybe {decoy}?</think>Calling. {call}"
    run = _Run.of(reasoning_parser("qwen3"), ToolPlan(mode="auto", tools=[], parser="hermes"))
    reasoning, content, calls = run.answer(text)
    assert reasoning == f"maybe {decoy}?"
    assert content == "Calling."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1})]
    message, called = run.message(text)
    assert called and message["reasoning_content"] == reasoning
    for pieces in _splits(text)[::5]:
        streamer = run.streamer()
        deltas = [streamer.step(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
        assert "".join(d.get("content", "") for d in deltas).strip() == "Calling."
        names = [c["function"].get("name") for d in deltas for c in d.get("tool_calls", [])]
        assert [n for n in names if n] == ["f"]
    # no reasoning parser: the same text's decoy is a call (what the parser protects against)
    _, _, plain = _Run.of(None, ToolPlan(mode="auto", tools=[], parser="hermes")).answer(text)
    assert [c.name for c in plain][:1] == ["g"]


def test_harmony_calls_become_chat_tool_calls() -> None:
    parser = _harmony()
    text = _render([_msg("analysis", "Two calls."), _msg("commentary", '{"a": 1}', "functions.f")])
    run = _Run.of(parser, ToolPlan(mode="auto", tools=[], parser="hermes"))
    message, called = run.message(text)
    assert called and message["content"] is None and message["reasoning_content"] == "Two calls."
    assert message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}
    streamer = run.streamer()
    deltas = [streamer.step(c, i == len(text) - 1) for i, c in enumerate(text)]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "f")]
    # tool_choice "none": harmony's calls are not returned as calls
    _, none_called = _Run.of(parser, ToolPlan()).message(text)
    assert not none_called


QWEN3_TEMPLATE_PART = "{%- if enable_thinking is defined and enable_thinking is false %}"
R1_TEMPLATE_PART = "{{'<｜Assistant｜>'}}<think>\\n"


def test_choice_by_name_and_by_chat_template() -> None:
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "gpt_oss"}
    assert detect_reasoning_parser(QWEN3_TEMPLATE_PART + "<think>\\n\\n</think>") == "qwen3"
    assert detect_reasoning_parser(R1_TEMPLATE_PART) == "deepseek_r1"
    assert detect_reasoning_parser("<|start|>assistant<|channel|>final<|message|>") == "gpt_oss"
    assert detect_reasoning_parser("{{ messages }}") is None
    assert detect_reasoning_parser(None) is None
    parser, why = choose_reasoning_parser(None, R1_TEMPLATE_PART)
    assert parser is not None and parser.name == "deepseek_r1" and "detected" in why
    assert choose_reasoning_parser(OFF, R1_TEMPLATE_PART)[0] is None
    assert choose_reasoning_parser("qwen3", None)[0].name == "qwen3"  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="deepseek_r1, gpt_oss, qwen3"):
        reasoning_parser("qwen")


def test_a_detected_parser_that_cannot_load_is_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gpt_oss template on a host without harmony's vocabulary still serves (reasoning not
    split, the reason given); asked by name, the same parser is an error."""
    from foudre.server import reasoning

    def unavailable(name: str) -> reasoning.ReasoningParser:
        raise reasoning.HarmonyUnavailableError("no o200k vocabulary")

    monkeypatch.setattr(reasoning, "reasoning_parser", unavailable)
    template = "<|start|>assistant<|channel|>final<|message|>"
    parser, why = choose_reasoning_parser(None, template)
    assert parser is None and why.startswith("off:") and "no o200k vocabulary" in why
    with pytest.raises(reasoning.HarmonyUnavailableError):
        choose_reasoning_parser("gpt_oss", template)


def test_serve_refuses_an_unknown_reasoning_parser_listing_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from foudre.cli import main

    assert main(["serve", "--model", "no-such-model", "--reasoning-parser", "qwen"]) == 2
    err = capsys.readouterr().err
    assert "unknown --reasoning-parser 'qwen'" in err
    assert "deepseek_r1, gpt_oss, qwen3, none" in err


def test_harmony_renders_a_conversation_with_tools_calls_and_results() -> None:
    parser = _harmony()
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "The weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Need the weather.",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "18 C", "tool_call_id": "call_1"},
    ]
    text = parser.render(messages, True, tools)
    assert text.startswith("<|start|>system<|message|>")
    assert "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools" in text
    assert "// The weather in a city\ntype get_weather = (_: {\ncity?: string,\n}) => any;" in text
    assert "<|start|>user<|message|>Weather in Paris?<|end|>" in text
    call = "<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json"
    assert call + '<|message|>{"city": "Paris"}<|call|>' in text
    result = "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>18 C"
    assert result + "<|end|>" in text
    assert text.endswith("<|end|><|start|>assistant")
    assert not parser.render(messages[:2], False, None).endswith("<|start|>assistant")


@pytest.mark.parametrize(
    ("name", "prompt", "gated"),
    [
        ("qwen3", "<|im_start|>assistant\n<think>\n", True),
        ("qwen3", "<|im_start|>assistant\n", True),  # the model may open <think> itself
        ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", False),  # not thinking
        ("deepseek_r1", "<｜Assistant｜><think>\n", True),
    ],
)
def test_a_grammar_waits_for_the_reasoning_unless_the_prompt_ended_it(
    name: str, prompt: str, gated: bool
) -> None:
    from types import SimpleNamespace

    from foudre.sampling_params import SamplingParams, StructuredOutput
    from foudre.server.serving_chat import OpenAIServingChat

    tok = SimpleNamespace(encode=lambda text, add_special_tokens: [9] if text == "<think>" else [])
    serving = SimpleNamespace(
        reasoning_parser=reasoning_parser(name), reasoning_end_ids=[7, 8], tokenizer=tok
    )
    chat = OpenAIServingChat(serving)  # type: ignore[arg-type]
    spec = StructuredOutput(json_object=True)
    params = chat._for_reasoning(SamplingParams(structured_output=spec), prompt)
    assert params.structured_output is not None
    assert params.structured_output.starts_after == ([7, 8] if gated else None)
    # qwen3 with a prompt that does not open <think>: the first token decides (<think>: id 9)
    may_answer = gated and name == "qwen3" and not prompt.rstrip().endswith("<think>")
    assert params.structured_output.opened_by == (9 if may_answer else None)
    assert params.skip_special_tokens  # <think> markers are ordinary tokens
    plain = chat._for_reasoning(SamplingParams(), prompt)
    assert plain.structured_output is None
    serving.reasoning_parser = None
    assert chat._for_reasoning(
        SamplingParams(structured_output=spec), prompt
    ).structured_output == (spec)


def test_gpt_oss_keeps_special_tokens_and_waits_for_the_final_channel() -> None:
    from types import SimpleNamespace

    from foudre.sampling_params import SamplingParams, StructuredOutput
    from foudre.server.serving_chat import OpenAIServingChat

    tok = SimpleNamespace(encode=lambda text, add_special_tokens: [])
    serving = SimpleNamespace(
        reasoning_parser=_harmony(), reasoning_end_ids=[5, 6, 7], tokenizer=tok
    )
    chat = OpenAIServingChat(serving)  # type: ignore[arg-type]
    spec = StructuredOutput(json_object=True)
    params = chat._for_reasoning(SamplingParams(structured_output=spec), "<|start|>assistant")
    assert params.structured_output is not None
    assert params.structured_output.starts_after == [5, 6, 7]
    assert not params.skip_special_tokens


def _reference_think(name: str, text: str) -> tuple[str, str]:
    """The ``<think>`` split as the module docstring states it, written plainly: after an
    optional ``<think>`` (else: qwen3 answers, deepseek_r1 reasons), reasoning up to the first
    ``</think>``, then the answer; both without the whitespace around the markers."""
    head = text.lstrip()
    if head.startswith("<think>"):
        rest = head[len("<think>") :]
    elif name == "deepseek_r1":
        rest = text
    else:
        return "", text.lstrip()
    reasoning, marker, answer = rest.partition("</think>")
    return reasoning.strip(), answer.lstrip() if marker else ""


_PIECES = ["<think>", "</think>", "<", "</", "<th", "think", ">", "/", " ", "\n", "a", "é", "x y"]


@given(
    name=st.sampled_from(["qwen3", "deepseek_r1"]),
    parts=st.lists(st.sampled_from(_PIECES), max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=80), max_size=6),
)
@settings(max_examples=300, deadline=None)
def test_think_split_matches_the_reference_in_any_pieces(
    name: str, parts: list[str], cuts: list[int]
) -> None:
    text = "".join(parts)
    bounds = sorted({min(c, len(text)) for c in cuts})
    pieces = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    parser = reasoning_parser(name)
    expected = _reference_think(name, text)
    whole = parser.parse(text)
    assert (whole.reasoning, whole.content) == expected
    got = _streamed(parser, pieces)
    assert (got.reasoning, got.content) == expected


def test_an_earlier_answers_reasoning_reaches_the_template() -> None:
    from foudre.server.protocol import ChatMessage
    from foudre.server.tools import template_messages

    messages = [
        ChatMessage(role="user", content="2+2?"),
        ChatMessage(role="assistant", content="4", reasoning_content="Two and two."),
    ]
    rendered = template_messages(messages)
    assert rendered[1] == {"role": "assistant", "content": "4", "reasoning_content": "Two and two."}
    assert "reasoning_content" not in rendered[0]
