"""``/v1/responses`` with the official ``openai`` client: plain and streamed responses, function
tools round trips, ``text.format``, ``previous_response_id`` chains, retrieve and delete, the
bounded store, and 4xx naming the parameter for bad input."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from foudre.server.protocol_responses import InputItem
from foudre.server.serving_responses import ResponseStore, StoredResponse, conversation
from tests.server.conftest import InProcessServer, start_in_process, stop_in_process
from tests.server.test_structured_server import _serve, _stop, tools_model  # noqa: F401

WEATHER = {
    "type": "function",
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
}


class Pet(BaseModel):
    kind: str = Field(max_length=10)
    age: int = Field(ge=0, le=20)


@pytest.fixture(scope="module")
def stories() -> Iterator[InProcessServer]:
    srv = start_in_process(responses_store_size=4)
    try:
        yield srv
    finally:
        stop_in_process(srv)


@pytest.fixture(scope="module")
def tools_server(tools_model: Path) -> Iterator[InProcessServer]:  # noqa: F811
    from foudre.config import EngineConfig

    srv = _serve(EngineConfig(model=str(tools_model), max_model_len=1024))
    yield srv
    _stop(srv)


def _client(srv: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def _chat_text(srv: InProcessServer, messages: list[dict[str, Any]], max_tokens: int) -> str:
    chat = _client(srv).chat.completions.create(
        model="stories",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens,
        temperature=0,
    )
    return chat.choices[0].message.content or ""


def test_plain_response_is_the_chat_answer(stories: InProcessServer) -> None:
    client = _client(stories)
    r = client.responses.create(
        model="stories", input="Tell me a story.", max_output_tokens=12, temperature=0
    )
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    assert len(r.output) == 1 and r.output[0].type == "message"
    messages = [{"role": "user", "content": "Tell me a story."}]
    assert r.output_text == _chat_text(stories, messages, 12) != ""
    assert r.usage is not None and r.usage.output_tokens == 12
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    # instructions are a system message; input items are the conversation
    r2 = client.responses.create(
        model="stories",
        instructions="Be brief.",
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]}],
        max_output_tokens=8,
        temperature=0,
    )
    system = [{"role": "system", "content": "Be brief."}, *messages]
    assert r2.output_text == _chat_text(stories, system, 8)
    assert r2.instructions == "Be brief."


def test_streamed_events_join_to_the_final_response(stories: InProcessServer) -> None:
    client = _client(stories)
    events = list(
        client.responses.create(
            model="stories", input="Tell me a story.", max_output_tokens=16, temperature=0,
            stream=True,
        )
    )  # fmt: skip
    kinds = [e.type for e in events]
    assert kinds[:5] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = next(e for e in events if e.type == "response.output_text.done")
    final = events[-1].response  # type: ignore[union-attr]
    assert deltas == done.text == final.output_text  # type: ignore[union-attr]
    plain = client.responses.create(
        model="stories", input="Tell me a story.", max_output_tokens=16, temperature=0
    )
    assert final.output_text == plain.output_text
    assert final.usage is not None and final.usage.output_tokens == 16
    # the streamed response was stored like any other
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_text_format_json_schema_and_json_object(stories: InProcessServer) -> None:
    client = _client(stories)
    schema = Pet.model_json_schema()
    fmt = {"type": "json_schema", "name": "pet", "schema": schema, "strict": True}
    for seed_input in ("Describe a pet.", "A pet, please."):
        r = client.responses.create(
            model="stories", input=seed_input, max_output_tokens=80, text={"format": fmt}
        )
        assert r.status == "completed"
        jsonschema.validate(json.loads(r.output_text), schema)
        assert r.text is not None and r.text.format is not None
        assert r.text.format.type == "json_schema"
    parsed = client.responses.parse(
        model="stories", input="Describe a pet.", max_output_tokens=80, text_format=Pet
    )
    assert isinstance(parsed.output_parsed, Pet)
    r = client.responses.create(
        model="stories",
        input="JSON please",
        max_output_tokens=60,
        text={"format": {"type": "json_object"}},
    )
    assert r.output_text.startswith("{")  # an open-ended object may run past the limit
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_previous_response_id_chain_retrieve_and_delete(stories: InProcessServer) -> None:
    client = _client(stories)
    first = client.responses.create(
        model="stories", input="Once upon a time", max_output_tokens=6, temperature=0
    )
    second = client.responses.create(
        model="stories",
        input="And then?",
        previous_response_id=first.id,
        max_output_tokens=6,
        temperature=0,
    )
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": "Once upon a time"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And then?"},
    ]
    assert second.output_text == _chat_text(stories, messages, 6)
    assert second.usage is not None and first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    got = client.responses.retrieve(second.id)
    assert got.id == second.id and got.output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(second.id)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model="stories", input="x", previous_response_id=second.id)
    assert err.value.param == "previous_response_id"  # type: ignore[attr-defined]
    # store=False: answered, not kept
    kept_out = client.responses.create(model="stories", input="x", max_output_tokens=2, store=False)
    assert kept_out.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept_out.id)


def test_store_is_bounded_lru(stories: InProcessServer) -> None:
    client = _client(stories)  # the server keeps 4
    ids = [
        client.responses.create(model="stories", input=f"{i}", max_output_tokens=1).id
        for i in range(4)
    ]
    client.responses.retrieve(ids[0])  # now the most recently used
    client.responses.create(model="stories", input="4", max_output_tokens=1)
    assert client.responses.retrieve(ids[0]).id == ids[0]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[1])  # evicted: the least recently used
    store = ResponseStore(2)
    for rid in "abc":
        store.put(rid, StoredResponse({"id": rid}, []))
    assert len(store) == 2 and store.get("a") is None and store.get("c") is not None
    ResponseStore(0).put("a", StoredResponse({}, []))  # keeps nothing
    with pytest.raises(ValueError):
        ResponseStore(-1)


def test_function_tool_round_trip(tools_server: InProcessServer) -> None:
    client = _client(tools_server)
    first = client.responses.create(
        model="tools",
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,  # one call: a bounded output
        max_output_tokens=200,
    )
    assert first.status == "completed"
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and all(c.name == "get_weather" for c in calls)
    call = calls[0]
    assert call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the client answers the call: explicitly, with the earlier items as input
    output_item = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    items: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    items += [
        {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments}
        for c in calls
    ]
    items.append(output_item)
    explicit = client.responses.create(
        model="tools",
        input=items,
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=4,
        temperature=0,
    )
    # and through previous_response_id: the same conversation, so the same prompt
    chained = client.responses.create(
        model="tools",
        input=[output_item],  # type: ignore[list-item]
        previous_response_id=first.id,
        tools=[WEATHER],  # type: ignore[list-item]
        max_output_tokens=4,
        temperature=0,
    )
    assert explicit.usage is not None and chained.usage is not None
    assert chained.usage.input_tokens == explicit.usage.input_tokens
    assert chained.output_text == explicit.output_text
    tok = httpx.post(
        tools_server.url + "/tokenize",
        json={"messages": [{"role": "user", "content": "What is the weather in Paris?"}],
              "tools": [{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                          if k != "type"}}]},
    ).json()  # fmt: skip
    assert explicit.usage.input_tokens > tok["count"]  # the call and its output were rendered


def test_named_function_streams_argument_deltas(tools_server: InProcessServer) -> None:
    client = _client(tools_server)
    events = list(
        client.responses.create(
            model="tools",
            input="Weather?",
            tools=[WEATHER],  # type: ignore[list-item]
            tool_choice={"type": "function", "name": "get_weather"},
            max_output_tokens=200,
            stream=True,
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1  # written as they come, not once complete
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert "".join(deltas) == done.arguments  # type: ignore[union-attr]
    jsonschema.validate(json.loads(done.arguments), WEATHER["parameters"])  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert [item.type for item in final.output] == ["function_call"]
    assert final.output[0].arguments == done.arguments  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": [{"type": "message", "content": "no role"}]}, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
        ({"input": [{"type": "nonsense"}]}, "input"),
        ({"input": 3}, "input"),
        ({"input": []}, "input"),
        ({"input": "x", "max_output_tokens": -1}, "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 10**9}, "max_output_tokens"),
        ({"input": "x", "temperature": -1}, "temperature"),
        ({"input": "x", "top_p": 7}, "top_p"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": "x", "tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools"),
        ({"input": "x", "text": {"format": {"type": "json_schema"}}}, "text"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {"type": 3}}}},
         "text"),
        ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"input": "x" * 200_000}, "input"),
        ({"input": "x", "model": "gpt-4o"}, "model"),
    ],
)  # fmt: skip
def test_bad_input_is_a_4xx_naming_the_parameter(
    stories: InProcessServer, body: dict[str, Any], param: str
) -> None:
    r = httpx.post(stories.url + "/v1/responses", json=body, timeout=60)
    assert 400 <= r.status_code < 500, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_conversation_merges_calls_into_the_assistant_turn() -> None:
    items = [
        InputItem(role="user", content="hi"),
        InputItem(role="assistant", content="let me look"),
        InputItem(type="function_call", call_id="c1", name="f", arguments="{}"),
        InputItem(type="function_call", call_id="c2", name="g"),
        InputItem(type="function_call_output", call_id="c1", output="1"),
        InputItem(role="developer", content="be kind"),
    ]
    messages = conversation(items)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "system"]
    calls = messages[1].tool_calls or []
    assert messages[1].text() == "let me look" and [c.id for c in calls] == ["c1", "c2"]
    assert calls[1].function.arguments == "{}" and messages[2].tool_call_id == "c1"


def test_openapi_declares_the_responses_routes(stories: InProcessServer) -> None:
    spec = httpx.get(stories.url + "/openapi.json", timeout=10).json()
    post = spec["paths"]["/v1/responses"]["post"]
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/ResponsesRequest"
    )
    assert set(spec["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}


def test_a_stream_closed_early_frees_its_request(stories: InProcessServer) -> None:
    body = {"input": "Tell me a story.", "max_output_tokens": 400, "stream": True}
    with httpx.stream("POST", stories.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines) == "event: response.created"
        first = json.loads(next(lines).removeprefix("data: "))
        assert first["type"] == "response.created" and first["sequence_number"] == 0
        assert first["response"]["status"] == "in_progress"
    deadline = time.monotonic() + 10
    while stories.llm.metrics()["num_running"] or stories.llm.metrics()["kv_cache_usage"]:
        assert time.monotonic() < deadline, "the request still runs after the client left"
        time.sleep(0.05)


def test_the_sdk_stream_helper_accumulates_our_events(
    stories: InProcessServer, tools_server: InProcessServer
) -> None:
    with _client(stories).responses.stream(
        model="stories",
        input="Describe a pet.",
        max_output_tokens=300,
        temperature=0,
        text_format=Pet,
    ) as stream:
        texts = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(texts) == final.output_text
    assert isinstance(final.output_parsed, Pet)
    with _client(tools_server).responses.stream(
        model="tools",
        input="Weather?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        parallel_tool_calls=False,  # one call: a bounded output
        max_output_tokens=200,
    ) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["function_call"]
    call = final.output[0]
    assert call.call_id.startswith("call_")  # type: ignore[union-attr]
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])  # type: ignore[union-attr]


def test_a_timeout_is_a_408_or_an_error_event_then_failed() -> None:
    s = start_in_process(request_timeout=0.3)
    step = s.llm.engine.step

    def paced_step() -> Any:  # 30 tokens at most before the timeout, on any host
        time.sleep(0.01)
        return step()

    s.llm.engine.step = paced_step  # type: ignore[method-assign]
    try:
        client = _client(s)
        with pytest.raises(openai.APIStatusError) as err:
            client.responses.create(model="stories", input="Once", max_output_tokens=400)
        assert err.value.status_code == 408
        events = list(
            client.responses.create(
                model="stories", input="Once", max_output_tokens=400, temperature=0, stream=True
            )
        )
        assert [e.type for e in events[-2:]] == ["error", "response.failed"]
        assert events[-2].code == "timeout"  # type: ignore[union-attr]
        failed = events[-1].response  # type: ignore[union-attr]
        assert failed.status == "failed" and failed.error is not None
        assert [e.sequence_number for e in events] == list(range(len(events)))
    finally:
        stop_in_process(s)
