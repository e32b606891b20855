"""Structured output and tool calling over HTTP, with the official ``openai`` client:
``response_format`` (``chat.completions.parse`` with a pydantic model, streamed and not), vLLM's
``guided_*`` fields, ``tools`` with every ``tool_choice``, and 400s for what cannot work."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
import uvicorn
from pydantic import BaseModel, Field

from foudre.server.protocol import ChatMessage
from foudre.server.tools import (
    ToolPlan,
    parse_hermes,
    parse_llama3_json,
    template_messages,
)
from tests.conftest import REPO, make_hf_model
from tests.server.conftest import InProcessServer, start_in_process

EMBEDDED_TOKENIZER = REPO / "foudre" / "assets" / "models" / "target" / "tokenizer.json"

# a Hermes / Qwen 2.5 style template: tools in the system turn, calls in <tool_call> tags
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
You may call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == "assistant" and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 7},
            },
            "required": ["city", "days"],
        },
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
        },
    },
}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "owl"]
    age: int = Field(ge=0, le=20)
    name: str = Field(max_length=10)


def _serve(config: Any, **app_kwargs: Any) -> InProcessServer:
    from foudre.engine.async_llm import AsyncLLM
    from foudre.server.app import build_app

    llm = AsyncLLM.from_config(config)
    app = build_app(llm, "tools", **app_kwargs)
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            llm.shutdown()
            raise RuntimeError("in-process server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return InProcessServer(f"http://127.0.0.1:{port}", llm, server, thread)


def _stop(srv: InProcessServer) -> None:
    srv.server.should_exit = True
    srv.thread.join(30)


@pytest.fixture(scope="module")
def stories() -> Iterator[InProcessServer]:
    srv = start_in_process()
    yield srv
    _stop(srv)


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight Qwen2 with the embedded byte-level tokenizer and a Hermes template."""
    path = make_hf_model(
        tmp_path_factory.mktemp("qwen2-tools"),
        "qwen2",
        vocab_size=2048,
        bos_token_id=0,
        eos_token_id=0,
        max_position_embeddings=1024,
    )
    (path / "tokenizer.json").write_bytes(EMBEDDED_TOKENIZER.read_bytes())
    config = {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": HERMES_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def tools_server(tools_model: Path) -> Iterator[InProcessServer]:
    from foudre.config import EngineConfig

    srv = _serve(EngineConfig(model=str(tools_model), max_model_len=1024))
    yield srv
    _stop(srv)


def _client(srv: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_parse_with_a_pydantic_model_streamed_and_not(stories: InProcessServer) -> None:
    client = _client(stories)
    messages = [{"role": "user", "content": "Describe a pet."}]
    for seed in range(3):
        done = client.chat.completions.parse(
            model="stories", messages=messages, response_format=Pet, seed=seed, max_tokens=80
        )
        choice = done.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Pet)
    with client.chat.completions.stream(
        model="stories", messages=messages, response_format=Pet, seed=0, max_tokens=80
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_completion()
    streamed = final.choices[0].message.parsed
    first = client.chat.completions.parse(
        model="stories", messages=messages, response_format=Pet, seed=0, max_tokens=80
    )
    assert streamed == first.choices[0].message.parsed


def test_response_format_and_guided_fields(stories: InProcessServer) -> None:
    client = _client(stories)
    schema = Pet.model_json_schema()
    completion = client.completions.create(
        model="stories",
        prompt="Once upon a time",
        max_tokens=80,
        seed=1,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},
    )
    Pet.model_validate_json(completion.choices[0].text)
    chat = client.chat.completions.create(
        model="stories",
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=40,
        seed=4,
    )
    text = chat.choices[0].message.content or ""
    assert text.startswith("{")
    if chat.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"guided_json": schema}, lambda t: Pet.model_validate_json(t)),
        ({"guided_regex": r"[0-9]{3}-[a-z]{3}"}, lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{3}", t)),
        ({"guided_choice": ["sunny", "rainy"]}, lambda t: t in ("sunny", "rainy")),
        ({"guided_grammar": 'root ::= "A" [0-9] "."'}, lambda t: re.fullmatch(r"A[0-9]\.", t)),
    ]
    for extra, check in cases:
        for stream in (False, True):
            kw: dict[str, Any] = dict(
                model="stories", prompt="Once", max_tokens=60, seed=2, extra_body=extra
            )
            if stream:
                text = "".join(
                    c.choices[0].text
                    for c in client.completions.create(stream=True, **kw)
                    if c.choices
                )
            else:
                text = client.completions.create(**kw).choices[0].text
            assert check(text), (extra, text)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"guided_json": {"type": "strin"}}, "guided_json", "Unsupported type"),
        ({"guided_regex": "([a-"}, "guided_regex", "regex"),
        ({"guided_regex": r"[^\s\S]"}, "guided_regex", "admits no output"),
        ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "not defined"),
        ({"guided_choice": []}, "guided_choice", "non-empty"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "guided_json", "uniqueItems"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format",
            "json_schema.schema",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"not": {}}}}},
            "response_format",
            "not at #",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ],
)
def test_bad_structured_output_is_a_400_naming_the_field(
    stories: InProcessServer, body: dict[str, Any], param: str, words: str
) -> None:
    for path, base in (
        ("/v1/completions", {"prompt": "Once"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ):
        r = httpx.post(stories.url + path, json={**base, **body, "max_tokens": 5}, timeout=60)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
    assert httpx.get(stories.url + "/health", timeout=10).status_code == 200


def _tool_call_deltas(chunks: Any) -> tuple[str, list[dict[str, Any]], str | None]:
    """Content, accumulated tool calls and finish reason of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for d in choice.delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": d.id, "name": "", "arguments": ""})
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_tools_round_trip_required_then_tool_result(tools_server: InProcessServer) -> None:
    client = _client(tools_server)
    messages: list[Any] = [{"role": "user", "content": "What's the weather in Paris?"}]
    kw: dict[str, Any] = dict(model="tools", tools=[WEATHER, CLOCK], temperature=0, max_tokens=80)
    done = client.chat.completions.create(messages=messages, tool_choice="required", **kw)
    choice = done.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None and choice.message.tool_calls
    for call in choice.message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
    # streamed: the same calls, as delta.tool_calls
    stream = client.chat.completions.create(
        messages=messages, tool_choice="required", stream=True, **kw
    )
    content, calls, finish = _tool_call_deltas(stream)
    assert (content, finish) == ("", "tool_calls")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls
    ]
    # the tool's answer goes back as a tool message; the model then answers in text
    messages.append(choice.message)
    for call in choice.message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees"})
    answer = client.chat.completions.create(messages=messages, tool_choice="none", **kw)
    assert answer.choices[0].message.tool_calls is None
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_named_function_and_single_call(tools_server: InProcessServer) -> None:
    client = _client(tools_server)
    messages = [{"role": "user", "content": "Time?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for stream in (False, True):
        kw: dict[str, Any] = dict(
            model="tools", messages=messages, tools=[WEATHER, CLOCK], tool_choice=named,
            max_tokens=40, seed=5,
        )  # fmt: skip
        if stream:
            content, calls, finish = _tool_call_deltas(
                client.chat.completions.create(stream=True, **kw)
            )
        else:
            choice = client.chat.completions.create(**kw).choices[0]
            assert choice.message.tool_calls is not None
            content, finish = choice.message.content or "", choice.finish_reason
            calls = [
                {"name": c.function.name, "arguments": c.function.arguments}
                for c in choice.message.tool_calls
            ]
        assert content == "" and finish == "stop" and len(calls) == 1
        assert calls[0]["name"] == "get_time"
        jsonschema.validate(json.loads(calls[0]["arguments"]), PARAMS["get_time"])
    single = client.chat.completions.create(
        model="tools", messages=messages, tools=[WEATHER, CLOCK], tool_choice="required",
        parallel_tool_calls=False, max_tokens=80, seed=1,
    )  # fmt: skip
    assert len(single.choices[0].message.tool_calls or []) == 1


def test_auto_parses_hermes_calls_streamed_and_not(tools_server: InProcessServer) -> None:
    """The model's own call format, read by the parser: the output is steered into a Hermes
    call (with a guided regex), then parsed by ``tool_choice="auto"``."""
    client = _client(tools_server)
    regex = r'Let me check\. <tool_call>\{"name": "get_weather", "arguments": '
    regex += r'\{"city": "(Paris|Lima)", "days": [1-7]\}\}</tool_call>'
    kw: dict[str, Any] = dict(
        model="tools", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
        tool_choice="auto", max_tokens=300, seed=3, extra_body={"guided_regex": regex},
    )  # fmt: skip
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS["get_weather"])
    content, calls, finish = _tool_call_deltas(client.chat.completions.create(stream=True, **kw))
    assert content.strip() == "Let me check." and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (call.function.name, call.function.arguments)
    ]


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
        (
            {
                "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}
                ],
                "tool_choice": "required",
            },
            "tools",
            "of type 'object'",
        ),
        (
            {
                "tools": [WEATHER],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "response_format",
            "cannot be combined",
        ),
    ],
)
def test_bad_tool_requests_are_400s(
    tools_server: InProcessServer, body: dict[str, Any], param: str, words: str
) -> None:
    payload = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **body}
    r = httpx.post(tools_server.url + "/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_auto_without_a_tool_template_is_a_clear_400(stories: InProcessServer) -> None:
    payload = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    r = httpx.post(stories.url + "/v1/chat/completions", json=payload, timeout=60)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tool_choice"
    assert "chat template that renders tools" in r.json()["error"]["message"]
    # forced calls need no template support: the grammar writes them
    forced = {**payload, "tool_choice": "required", "max_tokens": 200, "seed": 0}
    forced["parallel_tool_calls"] = False
    r = httpx.post(stories.url + "/v1/chat/completions", json=forced, timeout=60)
    assert r.status_code == 200, r.text
    for call in r.json()["choices"][0]["message"]["tool_calls"]:
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS["get_weather"])


def test_tool_messages_reach_the_template(tools_model: Path) -> None:
    from foudre.loading.loader import load_tokenizer

    tok = load_tokenizer(tools_model)
    assert tok.chat_template_takes_tools
    messages = [
        ChatMessage(role="user", content="Weather?"),
        ChatMessage.model_validate(
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Lima"}'},
                    }
                ],
            }
        ),
        ChatMessage(role="tool", content="18 degrees", tool_call_id="call_1"),
    ]
    text = tok.apply_chat_template(template_messages(messages), tools=[WEATHER])
    assert '"name": "get_weather", "arguments": {"city": "Lima"}' in text
    assert "<tool_response>\n18 degrees\n</tool_response>" in text
    assert '"description": "The weather in a city"' in text


def test_parsers() -> None:
    text = 'Sure. <tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
    text += '<tool_call>{"name": "b", "arguments": "{\\"y\\": [2]}"}</tool_call>'
    content, calls = parse_hermes(text)
    assert content == "Sure."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("a", {"x": 1}),
        ("b", {"y": [2]}),
    ]
    assert parse_hermes("no calls here") == ("no calls here", [])
    assert parse_hermes("<tool_call>not json</tool_call>")[1] == []
    content, calls = parse_llama3_json(
        '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    )
    assert content is None and [c.name for c in calls] == ["a", "b"]
    assert parse_llama3_json("Hello {there}") == ("Hello {there}", [])
    assert parse_llama3_json('{"no": "name"}')[1] == []


@pytest.mark.parametrize("parser", ["hermes", "llama3_json"])
def test_streamer_matches_the_parser(parser: str) -> None:
    from foudre.server.protocol import ChatCompletionRequest

    outputs = {
        "hermes": [
            'Let me see <tool_call>{"name": "get_weather", "arguments": '
            '{"city": "Lima", "days": 2}}'
            '</tool_call><tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>',
            "A <tool_ plain answer, no calls <tool",
        ],
        "llama3_json": [
            '{"name": "get_weather", "parameters": {"city": "Lima", "days": 2}};'
            ' {"name": "get_time", "parameters": {"zone": "UTC"}}',
            "  plain {answer}",
        ],
    }[parser]
    req = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "tools": [WEATHER, CLOCK]}
    )

    class Tok:
        chat_template = "{{ tools }}"
        chat_template_takes_tools = True

    plan = ToolPlan.of(req, Tok(), parser)  # type: ignore[arg-type]
    for text in outputs:
        content, calls = plan.parse(text)
        streamer = plan.streamer()
        deltas = [streamer.feed(ch) for ch in text] + [streamer.close()]
        streamed = "".join(d.get("content", "") for d in deltas)
        streamed_calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert streamed.strip() == (content or "").strip(), text
        assert _accumulated(streamed_calls) == [(c.name, json.loads(c.arguments)) for c in calls]


class Item(BaseModel):
    sku: Literal["A1", "B2"]
    count: int = Field(ge=1, le=9)


class Order(BaseModel):
    item: Item
    size: Literal["small", "large"]


def test_required_with_a_schema_that_uses_defs(tools_server: InProcessServer) -> None:
    """``openai.pydantic_function_tool`` of a model with a nested model and enums: its schema
    refers to its own ``$defs``, which must still resolve once wrapped for "required"."""
    client = _client(tools_server)
    order = openai.pydantic_function_tool(Order)
    assert "$defs" in json.dumps(order)
    for tools in ([order], [order, CLOCK]):
        done = client.chat.completions.create(
            model="tools", messages=[{"role": "user", "content": "Order"}], tools=tools,
            tool_choice="required", max_tokens=300, seed=3,
        )  # fmt: skip
        calls = done.choices[0].message.tool_calls or []
        assert calls, done.choices[0].message.content
        for call in calls:
            if call.function.name == "Order":
                Order.model_validate_json(call.function.arguments)


def test_parameters_of_an_empty_schema_are_an_object(tools_server: InProcessServer) -> None:
    """``"parameters": {}`` (or none) admits any arguments object, never ``true``, ``null`` or a
    list; a schema of another type is a 400 naming ``tools``."""
    client = _client(tools_server)
    ping = {"type": "function", "function": {"name": "ping", "parameters": {}}}
    bare = {"type": "function", "function": {"name": "bare"}}
    named = {"type": "function", "function": {"name": "ping"}}
    for choice in ("required", named):
        for seed in range(4):
            done = client.chat.completions.create(
                model="tools", messages=[{"role": "user", "content": "Ping"}], tools=[ping, bare],
                tool_choice=choice, max_tokens=60, seed=seed,  # type: ignore[arg-type]
            )  # fmt: skip
            message = done.choices[0].message
            assert message.content is None and message.tool_calls, message
            for call in message.tool_calls:
                assert isinstance(json.loads(call.function.arguments), dict)
    scalar = {"type": "function", "function": {"name": "s", "parameters": {"type": "string"}}}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tools", messages=[{"role": "user", "content": "x"}], tools=[scalar],  # type: ignore[list-item]
            tool_choice="required", max_tokens=5,
        )  # fmt: skip
    assert info.value.param == "tools"


def test_tokenize_counts_what_chat_sees(tools_server: InProcessServer) -> None:
    """``/tokenize`` of messages with tools, tool calls and tool results gives the prompt a chat
    completion of the same messages is given (``usage.prompt_tokens``)."""
    messages: list[Any] = [
        {"role": "user", "content": "Weather in Lima?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Lima", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
    ]
    chat = _client(tools_server).chat.completions.create(
        model="tools", messages=messages, tools=[WEATHER, CLOCK], max_tokens=1
    )
    assert chat.usage is not None
    body = {"messages": messages, "tools": [WEATHER, CLOCK]}
    r = httpx.post(tools_server.url + "/tokenize", json=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == chat.usage.prompt_tokens
    bare = httpx.post(tools_server.url + "/tokenize", json={"messages": messages[:1]}, timeout=60)
    assert bare.json()["count"] < r.json()["count"] - 100  # the tools are in the count
    image = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    r = httpx.post(
        tools_server.url + "/tokenize",
        json={"messages": [{"role": "user", "content": image}]},
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def _accumulated(deltas: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """Streamed call deltas put together as a client does, by index: (name, arguments)."""
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
        assert ("id" in d) == (call["name"] == ""), d  # the id and name come first, once
        call["name"] += d["function"].get("name", "")
        call["arguments"] += d["function"].get("arguments", "")
    assert sorted(calls) == list(range(len(calls)))
    return [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)]


@pytest.mark.parametrize(
    ("choice", "parser", "text"),
    [
        ("auto", "hermes", 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": '
         '"Lima", "days": 2}}\n</tool_call><tool_call>{"name": "get_time", "arguments": '
         '{"zone": "UTC"}}</tool_call>'),
        ("required", "hermes", '[{"name": "get_weather", "parameters": {"city": "Lima", '
         '"days": 2}}, {"name": "get_time", "parameters": {"zone": "UTC"}}]'),
        ({"type": "function", "function": {"name": "get_weather"}}, "hermes",
         '{"city": "Lima", "days": 2}'),
    ],
)  # fmt: skip
def test_streamed_calls_stream_their_arguments(choice: Any, parser: str, text: str) -> None:
    """A call's header (id, name) comes as soon as its name is known, then its arguments in
    several deltas as they are written (so partial-streaming clients see them grow), adding
    up to the same calls as the complete output."""
    from foudre.server.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": "x"}],
            "tools": [WEATHER, CLOCK],
            "tool_choice": choice,
        }
    )

    class Tok:
        chat_template = "{{ tools }}"
        chat_template_takes_tools = True

    plan = ToolPlan.of(req, Tok(), parser)  # type: ignore[arg-type]
    _, calls = plan.parse(text)
    streamer = plan.streamer()
    deltas = [streamer.feed(ch) for ch in text] + [streamer.close()]
    streamed = [c for d in deltas for c in d.get("tool_calls", [])]
    assert _accumulated(streamed) == [(c.name, json.loads(c.arguments)) for c in calls]
    first = [c for c in streamed if c["index"] == 0]
    assert len(first) > 5 and first[0]["function"]["name"] == "get_weather"
    assert first[0]["function"]["arguments"] in ("", "{")  # the name before any argument
    assert "".join(d.get("content", "") for d in deltas).strip() in ("", "Sure")


def test_named_tool_call_streams_argument_deltas(tools_server: InProcessServer) -> None:
    """Over HTTP: a forced call streams its arguments in many deltas (instructor's
    ``create_partial`` reads them as they grow), adding up to a valid arguments object."""
    client = _client(tools_server)
    stream = client.chat.completions.create(
        model="tools", messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, seed=2, stream=True,
    )  # fmt: skip
    pieces = []
    for chunk in stream:
        for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
            pieces.append(d.function.arguments if d.function else None)
    assert len([p for p in pieces if p]) > 3, pieces
    jsonschema.validate(json.loads("".join(p or "" for p in pieces)), PARAMS["get_weather"])
