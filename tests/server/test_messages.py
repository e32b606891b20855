"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``) over a real
loopback socket with the official ``anthropic`` client: plain and streamed messages, stop
reasons, tool use round trips on a Qwen2 with a tool template, token counts, errors in
Anthropic's shape and ``x-api-key`` authentication."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from tests.server.conftest import InProcessServer, start_in_process, stop_in_process
from tests.server.test_structured_server import tools_model  # noqa: F401

anthropic = pytest.importorskip("anthropic")

KEY = "sk-messages-test"
USER = [{"role": "user", "content": "Once upon a time"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "days"],
    },
}
CLOCK = {
    "name": "get_time",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
    },
}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, CLOCK)}


@pytest.fixture(scope="module")
def stories() -> Iterator[InProcessServer]:
    srv = start_in_process(api_key=KEY)
    try:
        yield srv
    finally:
        stop_in_process(srv)


@pytest.fixture(scope="module")
def tools(tools_model: Path) -> Iterator[InProcessServer]:  # noqa: F811
    """``test_structured_server``'s random Qwen2 with a Hermes template, served in process."""
    path = tools_model
    srv = start_in_process(engine={"model": str(path), "tokenizer": None, "max_model_len": 1024})
    try:
        yield srv
    finally:
        stop_in_process(srv)


def _client(srv: InProcessServer, key: str = KEY) -> Any:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, timeout=120)


def _chat(srv: InProcessServer, body: dict[str, Any]) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_message_is_the_chat_answer(stories: InProcessServer) -> None:
    """A greedy message says what the chat path says for the same conversation, with the same
    token counts, and its stop reason tells why it ended."""
    client = _client(stories)
    msg = client.messages.create(
        model="stories", max_tokens=40, messages=USER, system="Tell a story.", temperature=0.0
    )
    chat = _chat(
        stories,
        {
            "messages": [{"role": "system", "content": "Tell a story."}, *USER],
            "max_tokens": 40,
            "temperature": 0.0,
        },
    )
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "stories"
    assert msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert msg.content[0].text
    expected = {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]]
    assert msg.stop_reason == expected and msg.stop_sequence is None
    assert msg.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_max_tokens_and_stop_sequences(stories: InProcessServer) -> None:
    client = _client(stories)
    cut = client.messages.create(model="stories", max_tokens=3, messages=USER, temperature=0.0)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 3
    full = client.messages.create(model="stories", max_tokens=40, messages=USER, temperature=0.0)
    text = full.content[0].text
    word = text.split()[2]
    stopped = client.messages.create(
        model="stories", max_tokens=40, messages=USER, temperature=0.0, stop_sequences=[word]
    )
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert stopped.content[0].text == text[: text.index(word)]
    # top_p / top_k where a client sends them (the 2.x SDK takes them as extra_body)
    sampled = client.messages.create(
        model="stories", max_tokens=5, messages=USER, extra_body={"top_k": 1, "top_p": 0.5}
    )
    assert (
        sampled.content[0].text
        == _client(stories)
        .messages.create(model="stories", max_tokens=5, messages=USER, temperature=0.0)
        .content[0]
        .text
    )


def test_stream_joins_to_the_message(stories: InProcessServer) -> None:
    client = _client(stories)
    kwargs: dict[str, Any] = dict(model="stories", max_tokens=30, messages=USER, temperature=0.0)
    whole = client.messages.create(**kwargs)
    events = []
    with client.messages.stream(**kwargs) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) > 1
    assert "".join(texts) == final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    # the raw events, in Anthropic's order
    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
    kinds = [e for e in events if e not in ("text",)]
    assert kinds[0] == "message_start" and kinds[1] == "content_block_start"
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}


def test_count_tokens_is_the_usage(stories: InProcessServer) -> None:
    client = _client(stories)
    messages = [
        *USER,
        {"role": "assistant", "content": "there was"},
        {"role": "user", "content": "a cat"},
    ]
    counted = client.messages.count_tokens(model="stories", messages=messages, system="Be brief.")
    used = client.messages.create(
        model="stories", max_tokens=2, messages=messages, system="Be brief."
    )
    assert counted.input_tokens == used.usage.input_tokens > 10
    shorter = client.messages.count_tokens(model="stories", messages=USER)
    assert 0 < shorter.input_tokens < counted.input_tokens


def _raw(srv: InProcessServer, path: str, body: Any, **headers: str) -> httpx.Response:
    headers = {"x-api-key": KEY, **headers}
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(srv.url + path, content=content, headers=headers, timeout=60)


def test_errors_in_anthropic_shape(stories: InProcessServer) -> None:
    client = _client(stories)
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="stories", max_tokens=0, messages=USER)
    assert bad.value.status_code == 400
    assert bad.value.body["type"] == "error"
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-9", max_tokens=5, messages=USER)
    assert missing.value.body["error"]["type"] == "not_found_error"
    assert "claude-9" in missing.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as no_tools:
        client.messages.create(
            model="stories", max_tokens=5, messages=USER, tool_choice={"type": "any"}
        )
    assert "tool_choice" in no_tools.value.body["error"]["message"]
    cases: list[tuple[str, Any, str]] = [
        ("/v1/messages", {"model": "stories", "messages": USER}, "max_tokens"),
        ("/v1/messages", b"{not json", "malformed JSON"),
        ("/v1/messages", {"model": "stories", "max_tokens": 5, "messages": []}, "messages"),
        ("/v1/messages", {**_body(), "temperature": -1.0}, "temperature"),
        ("/v1/messages", {**_body(), "stop_sequences": ["x" * 10_000]}, "stop_sequences"),
        ("/v1/messages", {**_body(), "max_tokens": 10**9}, "max_tokens"),
        ("/v1/messages", {**_body(), "tool_choice": {"type": "tool"}}, "tool_choice"),
        ("/v1/messages/count_tokens", {"model": "stories"}, "messages"),
    ]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    cases.append(
        (
            "/v1/messages",
            {**_body(), "messages": [{"role": "user", "content": [image]}]},
            "messages",
        )
    )
    # a conversation of nothing the model reads (a user's thinking block: left out)
    thinking = [{"role": "user", "content": [{"type": "thinking", "thinking": "hm"}]}]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        cases.append((path, {**_body(), "messages": thinking}, "messages"))
    for path, body, named in cases:
        r = _raw(stories, path, body)
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert named in err["error"]["message"], (body, err)


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": "stories", "max_tokens": 5, "messages": USER, **extra}


def test_x_api_key_and_bearer(stories: InProcessServer) -> None:
    with pytest.raises(anthropic.AuthenticationError) as denied:
        _client(stories, key="wrong").messages.create(model="stories", max_tokens=5, messages=USER)
    assert denied.value.body["error"]["type"] == "authentication_error"
    r = httpx.post(stories.url + "/v1/messages", json=_body(), timeout=60)
    assert r.status_code == 401 and r.json()["type"] == "error"
    bearer = {"Authorization": f"Bearer {KEY}"}
    r = httpx.post(stories.url + "/v1/messages", json=_body(), headers=bearer, timeout=60)
    assert r.status_code == 200 and r.json()["content"][0]["type"] == "text"
    # the OpenAI routes take x-api-key too, and still answer in OpenAI's shape
    chat = {"messages": USER, "max_tokens": 3}
    r = httpx.post(stories.url + "/v1/chat/completions", json=chat, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = httpx.post(stories.url + "/v1/chat/completions", json=chat, headers={"x-api-key": "no"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def _tool_uses(msg: Any) -> list[Any]:
    return [b for b in msg.content if b.type == "tool_use"]


def test_tool_use_round_trip(tools: InProcessServer) -> None:
    """tool_choice any forces a tool_use block whose input fits its schema; the call and its
    result go back as blocks, and count_tokens counts that conversation as the usage does."""
    client = _client(tools)
    msg = client.messages.create(
        model="stories",
        max_tokens=120,
        messages=[{"role": "user", "content": "Weather in Paris?"}],
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        temperature=0.0,
    )
    uses = _tool_uses(msg)
    assert msg.stop_reason == "tool_use" and len(uses) == 1, msg
    use = uses[0]
    assert use.id.startswith("toolu_") and use.name in SCHEMAS
    jsonschema.validate(use.input, SCHEMAS[use.name])
    conversation = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 21 C"},
                {"type": "text", "text": "Thanks!"},
            ],
        },
    ]
    kwargs: dict[str, Any] = dict(model="stories", messages=conversation, tools=[WEATHER, CLOCK])
    counted = client.messages.count_tokens(**kwargs, tool_choice={"type": "none"})
    reply = client.messages.create(
        **kwargs, tool_choice={"type": "none"}, max_tokens=8, temperature=0.0
    )
    assert _tool_uses(reply) == [] and reply.content[0].type == "text"
    assert counted.input_tokens == reply.usage.input_tokens
    without = client.messages.count_tokens(**{**kwargs, "messages": conversation[:1]})
    assert counted.input_tokens > without.input_tokens + 20  # the call and its result are in
    # the template renders the call and the result as the chat path renders them
    chat = _chat_tokens(tools, use)
    assert counted.input_tokens == chat


def _chat_tokens(srv: InProcessServer, use: Any) -> int:
    """The prompt tokens of the same conversation sent to /v1/chat/completions."""
    functions = [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                "description": t.get("description"),
                "parameters": t["input_schema"],
            },
        }
        for t in (WEATHER, CLOCK)
    ]
    arguments = json.dumps(use.input)
    call = {
        "id": use.id,
        "type": "function",
        "function": {"name": use.name, "arguments": arguments},
    }
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"},
        {"role": "user", "content": "Thanks!"},
    ]
    body = {"messages": messages, "tools": functions, "tool_choice": "none", "max_tokens": 1}
    r = httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    count: int = r.json()["usage"]["prompt_tokens"]
    return count


def test_named_tool_streamed(tools: InProcessServer) -> None:
    """tool_choice tool forces that tool; streamed, its input arrives as input_json_delta
    pieces that join to the final block's input, and the stream ends with tool_use."""
    client = _client(tools)
    kwargs: dict[str, Any] = dict(
        model="stories",
        max_tokens=60,
        messages=[{"role": "user", "content": "What time is it?"}],
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "tool", "name": "get_time"},
        temperature=0.0,
    )
    whole = client.messages.create(**kwargs)
    assert [b.type for b in whole.content] == ["tool_use"] and whole.stop_reason == "tool_use"
    assert whole.content[0].name == "get_time"
    jsonschema.validate(whole.content[0].input, SCHEMAS["get_time"])
    pieces = []
    with client.messages.stream(**kwargs) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                assert event.delta.type == "input_json_delta"
                pieces.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert len(pieces) > 1
    assert json.loads("".join(pieces)) == final.content[0].input == whole.content[0].input
    assert final.stop_reason == "tool_use" and final.content[0].name == "get_time"
    assert final.usage.output_tokens == whole.usage.output_tokens
