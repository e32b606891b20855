"""Parallel samples, best_of and beam search through the OpenAI server; copy-on-write counters
on /metrics. In-process uvicorn over a real loopback socket, stories260K."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from foudre import LLM, BeamSearchParams
from tests.server.conftest import (
    MODEL,
    TOKENIZER,
    InProcessServer,
    start_in_process,
    stop_in_process,
)


@pytest.fixture(scope="module")
def srv() -> Iterator[InProcessServer]:
    s = start_in_process(max_queue=64)
    try:
        yield s
    finally:
        stop_in_process(s)


@pytest.fixture
def http(srv: InProcessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client


def _param(r: httpx.Response) -> Any:
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


def test_beam_search_choices_are_the_best_beams(http: httpx.Client) -> None:
    body = {"prompt": "Once upon a time", "max_tokens": 12, "use_beam_search": True,
            "best_of": 4, "n": 2}  # fmt: skip
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    llm = LLM(str(MODEL), tokenizer=str(TOKENIZER), num_kv_blocks=64)
    [ref] = llm.beam_search(["Once upon a time"], BeamSearchParams(beam_width=4, max_tokens=12))
    assert [c["text"] for c in choices] == [s.text for s in ref.sequences[:2]]
    assert [c["index"] for c in choices] == [0, 1]
    assert r.json()["usage"]["completion_tokens"] == sum(
        len(s.token_ids) for s in ref.sequences[:2]
    )


def test_bad_beam_and_best_of_requests_are_400(http: httpx.Client) -> None:
    base = {"prompt": "Once", "max_tokens": 4}
    beam = {**base, "use_beam_search": True}
    cases = [
        ({**beam, "stream": True}, "stream"),
        ({**beam, "n": 3, "best_of": 2}, "n"),
        ({**beam, "temperature": 0.7}, "temperature"),
        ({**beam, "early_stopping": "sometimes"}, "early_stopping"),
        ({**beam, "logprobs": 2}, "logprobs"),
        ({**beam, "guided_choice": ["a", "b"]}, "use_beam_search"),
        ({**base, "n": 3, "best_of": 2}, "best_of"),
        ({**base, "best_of": 3, "stream": True}, "best_of"),
    ]
    for body, param in cases:
        assert _param(http.post("/v1/completions", json=body)) == param, body


def test_best_of_and_n_through_the_server(srv: InProcessServer, http: httpx.Client) -> None:
    before = srv.llm.metrics()["num_cow_copies"]
    body = {"prompt": "Once upon a time", "max_tokens": 8, "n": 2, "best_of": 4, "seed": 5,
            "temperature": 1.0}  # fmt: skip
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200 and [c["index"] for c in r.json()["choices"]] == [0, 1]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "n": 3, "max_tokens": 5, "seed": 1}
    r = http.post("/v1/chat/completions", json=chat)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert srv.llm.metrics()["num_cow_copies"] > before
    beams = {"prompt": "Once", "max_tokens": 4, "use_beam_search": True, "best_of": 3}
    assert http.post("/v1/completions", json=beams).status_code == 200
    # every queue slot comes back: a beam search's and best_of's sequences, not only outputs
    assert srv.llm.metrics()["num_unfinished_requests"] == 0
    metrics = http.get("/metrics").text
    assert "foudre:kv_cache_cow_copies_total" in metrics
    assert "foudre:kv_cache_shared_blocks 0.0" in metrics
