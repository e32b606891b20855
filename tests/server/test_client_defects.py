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


def test_beam_search_and_best_of_on_chat(stories: InProcessServer) -> None:
    """``use_beam_search`` and ``best_of`` on chat are honoured as on completions: the same
    prompt ids give the same choices on both routes; what beam search cannot do is a 400."""
    messages = [{"role": "user", "content": "Tell me a story"}]
    with httpx.Client(base_url=stories.url, timeout=60) as http:
        ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
        cases: list[dict[str, Any]] = [
            {"use_beam_search": True, "best_of": 4, "n": 2, "max_tokens": 12},
            {"best_of": 4, "n": 1, "max_tokens": 12, "temperature": 1.0, "seed": 7},
        ]
        for extra in cases:
            chat = http.post("/v1/chat/completions", json={"messages": messages, **extra})
            text = http.post("/v1/completions", json={"prompt": ids, **extra})
            assert chat.status_code == 200 and text.status_code == 200, chat.text
            got = [(c["index"], c["message"]["content"]) for c in chat.json()["choices"]]
            assert got == [(c["index"], c["text"]) for c in text.json()["choices"]]
            assert chat.json()["usage"] == text.json()["usage"]
        beam = {"messages": messages, "use_beam_search": True, "max_tokens": 4}
        bad = [
            ({**beam, "stream": True}, "stream"),
            ({**beam, "logprobs": True}, "logprobs"),
            ({**beam, "guided_choice": ["a", "b"]}, "use_beam_search"),
            ({"messages": messages, "best_of": 2, "n": 3}, "best_of"),
        ]
        for body, param in bad:
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_a_grammar_the_allowed_tokens_cannot_write_is_never_a_500(stories: InProcessServer) -> None:
    """``guided_choice`` with ``allowed_token_ids`` that cannot begin it: a 400 naming both
    fields at admission. Allowed tokens that begin it but cannot finish it (``"y"`` of
    ``"yes"``, then nothing): the request ends with a 400-shaped error, streamed or not."""
    y, lily = 124, 317  # b"y" and b" Lily" in tok512
    body: dict[str, Any] = {"prompt": "Once", "guided_choice": ["yes"], "max_tokens": 5}
    with httpx.Client(base_url=stories.url, timeout=60) as http:
        for route, extra in (("/v1/completions", {}), ("/v1/chat/completions", {})):
            payload = {**body, **extra, "allowed_token_ids": [lily]}
            if route.endswith("chat/completions"):
                payload["messages"] = [{"role": "user", "content": payload.pop("prompt")}]
            r = http.post(route, json=payload)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["param"] == "allowed_token_ids" and "guided_choice" in error["message"]
        r = http.post("/v1/completions", json={**body, "allowed_token_ids": [y]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
        streamed = {**body, "allowed_token_ids": [y], "stream": True}
        with http.stream("POST", "/v1/completions", json=streamed) as resp:
            assert resp.status_code == 200
            lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        assert '"invalid_request_error"' in lines[-2], lines


def test_sampling_floats_past_float32_are_400s(stories: InProcessServer) -> None:
    """A temperature or repetition penalty that a float32 tensor cannot hold (found by
    schemathesis: 1e204) is a 400 naming it, not a failed step's 500."""
    for name in ("temperature", "repetition_penalty"):
        body = {"prompt": "Once", "max_tokens": 2, name: 1.0975015346009676e204}
        r = httpx.post(stories.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    ok = {"prompt": "Once", "max_tokens": 2, "temperature": 3e38}
    assert httpx.post(stories.url + "/v1/completions", json=ok, timeout=30).status_code == 200
