"""Third-party clients against a live foudre server: ``litellm`` (as an openai-compatible
endpoint), ``langchain-openai`` (``ChatOpenAI``: invoke, stream, structured output both ways,
``bind_tools`` and the Responses API) and the OpenAI Agents SDK (one agent, one function tool).

The server runs the random-weight Qwen2 with a Hermes tool template: plain text is compared
with the ``openai`` client's greedy answer, and structured output and tool calls are
enforced by the server's grammar engine, so they validate even on random weights.
``instructor`` has its own file (``test_instructor.py``) over the same server."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import InProcessServer
from tests.server.test_structured_server import _serve, _stop, tools_model  # noqa: F401

SERVED = "tools"
PROMPT = "Tell me about the weather."

WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER_PARAMS,
    },
}


class Pet(BaseModel):
    kind: Literal["cat", "dog", "owl"]
    age: int = Field(ge=0, le=20)
    name: str = Field(max_length=10)


@pytest.fixture(scope="module")
def server(tools_model: Path) -> Iterator[InProcessServer]:  # noqa: F811
    from foudre.config import EngineConfig

    srv = _serve(EngineConfig(model=str(tools_model), max_model_len=1024))
    yield srv
    _stop(srv)


def _greedy(srv: InProcessServer, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    chat = client.chat.completions.create(
        model=SERVED,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=max_tokens,
        temperature=0,
    )
    return chat.choices[0].message.content or ""


# -- litellm ---------------------------------------------------------------------------------


def test_litellm_completion_and_stream(server: InProcessServer) -> None:
    import litellm

    expected = _greedy(server, 8)
    kw: dict[str, Any] = dict(
        model=f"openai/{SERVED}",
        api_base=server.url + "/v1",
        api_key="unused",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
    )
    done = litellm.completion(**kw)
    choice = done.choices[0]
    assert choice.message.content == expected
    assert choice.finish_reason in ("stop", "length")
    assert done.usage.completion_tokens <= 8 and done.usage.prompt_tokens > 0

    text = ""
    for chunk in litellm.completion(stream=True, **kw):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    assert text == expected


# -- langchain-openai ------------------------------------------------------------------------


def _chat(srv: InProcessServer, **kw: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        model=SERVED,
        base_url=srv.url + "/v1",
        api_key="unused",  # type: ignore[arg-type]
        max_retries=0,
        temperature=0,
        **kw,
    )


def test_langchain_invoke_and_stream(server: InProcessServer) -> None:
    expected = _greedy(server, 8)
    llm = _chat(server, max_tokens=8)
    answer = llm.invoke(PROMPT)
    assert answer.content == expected
    assert answer.response_metadata["finish_reason"] in ("stop", "length")
    assert answer.usage_metadata["output_tokens"] <= 8
    chunks = list(llm.stream(PROMPT))
    assert "".join(str(c.content) for c in chunks) == expected


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_structured_output(server: InProcessServer, method: str) -> None:
    llm = _chat(server, max_tokens=120, seed=0)
    pet = llm.with_structured_output(Pet, method=method).invoke("Describe a pet.")  # type: ignore[arg-type]
    assert isinstance(pet, Pet)
    assert pet.kind in ("cat", "dog", "owl") and 0 <= pet.age <= 20 and len(pet.name) <= 10


def test_langchain_bind_tools(server: InProcessServer) -> None:
    llm = _chat(server, max_tokens=80, seed=0)
    answer = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Lima?")
    [call] = answer.tool_calls
    assert call["name"] == "get_weather" and call["id"]
    jsonschema.validate(call["args"], WEATHER_PARAMS)


def test_langchain_responses_api(server: InProcessServer) -> None:
    expected = _greedy(server, 8)
    llm = _chat(server, max_tokens=8, use_responses_api=True)
    answer = llm.invoke(PROMPT)
    assert answer.text == expected
    assert answer.response_metadata["id"].startswith("resp")
    assert answer.usage_metadata["output_tokens"] <= 8


# -- OpenAI Agents SDK -----------------------------------------------------------------------


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agents_sdk_one_agent_one_tool(server: InProcessServer, api: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen: list[tuple[str, int]] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Tokyo", "Lima"], days: int) -> str:
        """The weather in a city.

        Args:
            city: the city
            days: how many days ahead
        """
        seen.append((city, days))
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    model_cls = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
    model = model_cls(model=SERVED, openai_client=client)
    agent = Agent(
        name="forecaster",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=model,
        model_settings=ModelSettings(tool_choice="required", max_tokens=80, temperature=0),
        tool_use_behavior="stop_on_first_tool",
    )
    result = Runner.run_sync(agent, "What's the weather in Tokyo?", max_turns=2)
    assert len(seen) >= 1
    city, days = seen[0]
    assert city in ("Paris", "Tokyo", "Lima") and isinstance(days, int)
    assert result.final_output == f"sunny in {city}"
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    assert calls and json.loads(calls[0].raw_item.arguments)["city"] == city  # type: ignore[union-attr]
