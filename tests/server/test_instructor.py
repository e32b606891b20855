"""``instructor`` against a live foudre server: ``create`` with a pydantic response model in
TOOLS, JSON_SCHEMA and JSON modes, ``create_partial`` (partial objects while the tool call's
arguments stream) and ``create_iterable``; and ``from_anthropic`` over ``/v1/messages``.

The server runs the random-weight Qwen2 with a Hermes tool template (``test_clients``'s): the
tool call and the JSON schema are enforced by the server's grammar engine, so the objects
validate even on random weights; what ``instructor`` parses is compared with what the server
sent (the raw completion), not only checked for its type."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from typing import Any

import openai
import pytest
from pydantic import BaseModel, ConfigDict

from tests.server.conftest import InProcessServer
from tests.server.test_clients import SERVED, Pet, server  # noqa: F401
from tests.server.test_structured_server import tools_model  # noqa: F401

instructor = pytest.importorskip("instructor")

ASK = [{"role": "user", "content": "Describe a pet."}]


def _client(srv: InProcessServer, mode: Any) -> Any:
    raw = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return instructor.from_openai(raw, mode=mode)


def _arguments(completion: Any, mode: Any) -> dict[str, Any]:
    """The JSON object the server answered with: the tool call's arguments, or the content."""
    message = completion.choices[0].message
    if mode == instructor.Mode.TOOLS:
        [call] = message.tool_calls
        assert call.function.name == "Pet"
        text = call.function.arguments
    else:
        assert not message.tool_calls
        text = message.content
    data = json.loads(text)
    assert isinstance(data, dict)
    return data


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_create_with_a_response_model(server: InProcessServer, mode: str) -> None:  # noqa: F811
    """The parsed ``Pet`` is the object the server wrote: a tool call forced by name (TOOLS)
    or a ``response_format`` JSON schema (JSON_SCHEMA), both held to the schema by the
    grammar."""
    client = _client(server, instructor.Mode[mode])
    pet, completion = client.chat.completions.create_with_completion(
        model=SERVED,
        response_model=Pet,
        messages=ASK,
        max_tokens=200,
        temperature=0,
        max_retries=0,
    )
    assert isinstance(pet, Pet)
    assert completion.choices[0].finish_reason in ("stop", "tool_calls")
    assert (
        pet.model_dump()
        == Pet.model_validate(_arguments(completion, instructor.Mode[mode])).model_dump()
    )
    assert pet.kind in ("cat", "dog", "owl") and 0 <= pet.age <= 20 and len(pet.name) <= 10


class Note(BaseModel):
    """What Mode.JSON can promise on random weights: ``json_object`` holds the output to a JSON
    object, not to this schema (the schema is only in the prompt), so every field is optional
    and the rest is kept."""

    model_config = ConfigDict(extra="allow")
    title: Any = None


def test_create_in_json_mode(server: InProcessServer) -> None:  # noqa: F811
    """Mode.JSON (``response_format`` json_object): the server answers a JSON object, which
    instructor parses into the model field for field. Random weights seldom close an object
    greedily, so seeds are tried until one ends within ``max_tokens`` (instructor refuses a
    cut one with ``IncompleteOutputException``)."""
    from instructor.core.exceptions import IncompleteOutputException

    client = _client(server, instructor.Mode.JSON)
    for seed in range(16):
        try:
            note, completion = client.chat.completions.create_with_completion(
                model=SERVED,
                response_model=Note,
                messages=ASK,
                max_tokens=160,
                temperature=1.0,
                seed=seed,
                max_retries=0,
            )
        except IncompleteOutputException:
            continue
        break
    else:
        pytest.fail("no seed closed a JSON object within max_tokens")
    assert completion.choices[0].finish_reason == "stop"
    raw = _arguments(completion, instructor.Mode.JSON)
    assert note.model_dump() == Note.model_validate(raw).model_dump()


def test_create_partial_streams_the_object(server: InProcessServer) -> None:  # noqa: F811
    """``create_partial`` (TOOLS mode, streamed): the tool call's arguments arrive in deltas,
    so more than one partial object comes, each a prefix of the next, the last one whole and
    equal to the non-streamed answer."""
    client = _client(server, instructor.Mode.TOOLS)
    kw: dict[str, Any] = dict(
        model=SERVED, response_model=Pet, messages=ASK, max_tokens=200, temperature=0
    )
    whole = client.chat.completions.create(max_retries=0, **kw)
    updates = [p.model_dump() for p in client.chat.completions.create_partial(**kw)]
    assert len(updates) > 1, updates
    assert updates[0] != updates[-1]
    assert updates[-1] == whole.model_dump()
    for before, after in itertools.pairwise(updates):
        known = {k: v for k, v in before.items() if v is not None}
        # a field once known only grows (a string) or stays (a finished value)
        for key, value in known.items():
            if isinstance(value, str):
                assert str(after[key]).startswith(value), (before, after)
            elif key != "age":  # a number's digits may still be arriving
                assert after[key] == value, (before, after)


def test_create_iterable(server: InProcessServer) -> None:  # noqa: F811
    """``create_iterable`` (TOOLS mode, streamed): each ``Pet`` of the forced tool call's list,
    yielded once its object is complete: the same pets as the non-streamed ``Iterable[Pet]``
    answer with the same seed (seeds are tried until the random model lists some)."""
    client = _client(server, instructor.Mode.TOOLS)
    kw: dict[str, Any] = dict(model=SERVED, messages=ASK, max_tokens=300, temperature=1.0)
    for seed in range(16):
        listed = client.chat.completions.create(
            response_model=Iterable[Pet], seed=seed, max_retries=0, **kw
        )
        listed = [p.model_dump() for p in listed]
        if listed:
            break
    else:
        pytest.fail("no seed listed a pet")
    pets = list(client.chat.completions.create_iterable(response_model=Pet, seed=seed, **kw))
    assert all(isinstance(p, Pet) for p in pets)
    assert [p.model_dump() for p in pets] == listed


def test_anthropic_tools_over_messages(server: InProcessServer) -> None:  # noqa: F811
    """``instructor.from_anthropic`` (ANTHROPIC_TOOLS) over ``/v1/messages``: the forced
    ``tool_use`` block's input, held to the schema by the grammar, parsed as a ``Pet``."""
    anthropic = pytest.importorskip("anthropic")
    raw = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    client = instructor.from_anthropic(raw, mode=instructor.Mode.ANTHROPIC_TOOLS)
    pet, message = client.messages.create_with_completion(
        model=SERVED, response_model=Pet, messages=ASK, max_tokens=200, max_retries=0
    )
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "Pet" and message.stop_reason == "tool_use"
    assert pet.model_dump() == Pet.model_validate(use.input).model_dump()
