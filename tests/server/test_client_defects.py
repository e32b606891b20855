"""What real client libraries hit against ``foudre serve`` (issue 48's defects), each over a real
loopback socket with the client that found it: model retrieval, beam search and ``best_of`` on
chat, non-text content parts, ``/tokenize`` of tool conversations, the context-window error
``litellm`` maps, and grammars that the allowed tokens leave nothing to write."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

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


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    ],
)
def test_non_text_content_is_a_400(stories: InProcessServer, part: dict[str, Any]) -> None:
    """An image or audio part sent to a text-only model is refused, not silently dropped."""
    content = [{"type": "text", "text": "What is in this picture?"}, part]
    messages: Any = [{"role": "user", "content": content}]
    with pytest.raises(openai.BadRequestError) as info:
        _client(stories).chat.completions.create(model="stories", messages=messages)
    assert info.value.param == "messages"
    assert "messages[0].content[1]" in info.value.message and part["type"] in info.value.message


def test_litellm_maps_a_prompt_over_the_context(stories: InProcessServer) -> None:
    """A prompt past ``max_model_len`` (or leaving no room for ``max_tokens``) is the 400 that
    ``litellm`` recognises as ``ContextWindowExceededError``, streamed or not, chat or text."""
    litellm = pytest.importorskip("litellm")
    common: dict[str, Any] = dict(
        model="openai/stories", api_base=stories.url + "/v1", api_key="unused", num_retries=0
    )
    long = "Once upon a time " * 400
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=[{"role": "user", "content": long}], **common)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=[{"role": "user", "content": long}], stream=True, **common)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=600, **common)
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.text_completion(prompt=[[1] * 600], **common)
    ok = litellm.completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=3, **common)
    assert ok.choices[0].message.content is not None
