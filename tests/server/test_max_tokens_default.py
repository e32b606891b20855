"""One default for ``max_tokens`` whatever decodes: a chat request that leaves it out runs until
the end of sequence or the context (OpenAI's rule for chat), with beam search as with
sampling; ``/v1/completions`` keeps its default of 16 for both, and ``null`` means the
context there too. A beam search of width 1 is greedy decoding: the oracle."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from foudre.sampling_params import DEFAULT_MAX_TOKENS
from tests.server.conftest import InProcessServer, start_in_process, stop_in_process

MESSAGES = [{"role": "user", "content": "Tell me a story"}]
BEAM = {"use_beam_search": True, "best_of": 1}
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def stories() -> Iterator[InProcessServer]:
    srv = start_in_process()
    try:
        yield srv
    finally:
        stop_in_process(srv)


def _post(srv: InProcessServer, route: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(srv.url + route, json=body, timeout=120)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _answer(out: dict[str, Any]) -> tuple[str, str, int]:
    [choice] = out["choices"]
    text = choice["message"]["content"] if "message" in choice else choice["text"]
    return text, choice["finish_reason"], out["usage"]["completion_tokens"]


def test_chat_without_max_tokens_beams_as_it_samples(stories: InProcessServer) -> None:
    sampled = _answer(_post(stories, "/v1/chat/completions", {"messages": MESSAGES, **GREEDY}))
    assert sampled[2] > DEFAULT_MAX_TOKENS  # else the two defaults could not be told apart
    beamed = _answer(_post(stories, "/v1/chat/completions", {"messages": MESSAGES, **BEAM}))
    assert beamed == sampled


def test_completions_default_and_null(stories: InProcessServer) -> None:
    ids = httpx.post(stories.url + "/tokenize", json={"messages": MESSAGES}, timeout=30)
    prompt = ids.json()["tokens"]
    for extra in ({}, {"max_tokens": None}):
        body = {"prompt": prompt, **extra}
        sampled = _answer(_post(stories, "/v1/completions", {**body, **GREEDY}))
        beamed = _answer(_post(stories, "/v1/completions", {**body, **BEAM}))
        assert beamed == sampled
        assert (sampled[2] == DEFAULT_MAX_TOKENS) == ("max_tokens" not in extra), sampled
