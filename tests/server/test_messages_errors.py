"""Every error under ``/v1/messages`` in Anthropic's shape, as the official ``anthropic``
client reads it (its exception class and ``body``): a path the server does not serve (404), a
wrong method (405), a body too large (413), a server error (500), beside the 400s and the
unknown model that ``test_messages`` covers; the OpenAI routes keep OpenAI's shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from foudre.server.serving_messages import AnthropicServingMessages
from tests.server.conftest import InProcessServer, start_in_process, stop_in_process

anthropic = pytest.importorskip("anthropic")

USER = [{"role": "user", "content": "Once upon a time"}]
MAX_BYTES = 4096


@pytest.fixture(scope="module")
def stories() -> Iterator[InProcessServer]:
    srv = start_in_process(max_request_bytes=MAX_BYTES)
    try:
        yield srv
    finally:
        stop_in_process(srv)


def _client(srv: InProcessServer) -> Any:
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=60)


def _anthropic_error(body: Any, kind: str) -> str:
    """The message of an Anthropic-shaped error body of type ``kind``."""
    assert isinstance(body, dict) and body.get("type") == "error", body
    assert set(body) == {"type", "error"} and body["error"]["type"] == kind, body
    message: str = body["error"]["message"]
    assert message
    return message


def test_unknown_path_and_method(stories: InProcessServer) -> None:
    client = _client(stories)
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.batches.retrieve("msgbatch_01")  # batches are not served
    _anthropic_error(missing.value.body, "not_found_error")
    with pytest.raises(anthropic.APIStatusError) as method:
        client.get("/v1/messages", cast_to=object)
    assert method.value.status_code == 405
    _anthropic_error(method.value.body, "invalid_request_error")
    assert method.value.response.headers["allow"] == "POST"
    r = httpx.get(stories.url + "/v1/messages/count_tokens", timeout=30)
    assert r.status_code == 405
    _anthropic_error(r.json(), "invalid_request_error")


def test_unknown_model_everywhere(stories: InProcessServer) -> None:
    client = _client(stories)
    with pytest.raises(anthropic.NotFoundError) as create:
        client.messages.create(model="claude-9", max_tokens=5, messages=USER)
    assert "claude-9" in _anthropic_error(create.value.body, "not_found_error")
    with pytest.raises(anthropic.NotFoundError) as count:
        client.messages.count_tokens(model="claude-9", messages=USER)
    assert "claude-9" in _anthropic_error(count.value.body, "not_found_error")
    streaming = client.messages.stream(model="claude-9", max_tokens=5, messages=USER)
    with pytest.raises(anthropic.NotFoundError) as streamed, streaming as stream:
        stream.get_final_message()
    assert "claude-9" in _anthropic_error(streamed.value.body, "not_found_error")


def test_body_too_large_and_malformed(stories: InProcessServer) -> None:
    client = _client(stories)
    long = [{"role": "user", "content": "x" * (2 * MAX_BYTES)}]
    with pytest.raises(anthropic.RequestTooLargeError) as large:
        client.messages.create(model="stories", max_tokens=5, messages=long)
    assert str(MAX_BYTES) in _anthropic_error(large.value.body, "request_too_large")
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model="stories", max_tokens=5, messages=[{"role": "user"}])
    assert "messages" in _anthropic_error(bad.value.body, "invalid_request_error")
    headers = {"content-type": "application/json"}
    r = httpx.post(stories.url + "/v1/messages", content=b"[1, 2", headers=headers, timeout=30)
    assert r.status_code == 400
    assert "malformed JSON" in _anthropic_error(r.json(), "invalid_request_error")


def test_server_error(stories: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """An unexpected exception in the route: a 500 in Anthropic's shape (``api_error``) that
    the client raises as ``InternalServerError``; the server answers the next request."""

    async def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected fault")

    client = _client(stories)
    monkeypatch.setattr(AnthropicServingMessages, "count_tokens", broken)
    with pytest.raises(anthropic.InternalServerError) as failed:
        client.messages.count_tokens(model="stories", messages=USER)
    assert failed.value.status_code == 500
    assert "injected fault" in _anthropic_error(failed.value.body, "api_error")
    monkeypatch.undo()
    assert client.messages.count_tokens(model="stories", messages=USER).input_tokens > 0


def test_openai_routes_keep_openai_errors(stories: InProcessServer) -> None:
    """The same failures on the OpenAI routes answer in OpenAI's shape."""
    with httpx.Client(base_url=stories.url, timeout=30) as http:
        for r, kind in (
            (http.get("/v1/chat/completions"), "invalid_request_error"),
            (http.get("/v1/nothing"), "not_found_error"),
            (http.post("/v1/chat/completions", content=b"{"), "invalid_request_error"),
        ):
            body = r.json()
            assert set(body) == {"error"} and body["error"]["type"] == kind, body
        r = http.post("/v1/messagesx", json={})
        assert r.status_code == 404 and set(r.json()) == {"error"}
