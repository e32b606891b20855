"""The Responses store is bounded in bytes as well as in count (``--responses-store-bytes``):
the least recently used responses go first, a response over the whole budget is not kept,
and the weight it keeps count of is the JSON it holds (response and conversation)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pytest

from foudre.cli import build_parser
from foudre.server.protocol import ChatMessage
from foudre.server.serving_responses import DEFAULT_STORE_BYTES, ResponseStore, StoredResponse
from tests.server.conftest import InProcessServer, start_in_process, stop_in_process


def _stored(rid: str, text_bytes: int) -> StoredResponse:
    messages = [ChatMessage(role="user", content="x" * text_bytes)]
    return StoredResponse({"id": rid}, messages)


def _weight(stored: StoredResponse) -> int:
    body = len(json.dumps(stored.body).encode())
    return body + sum(len(m.model_dump_json().encode()) for m in stored.messages)


def test_bytes_bound_evicts_the_least_recently_used() -> None:
    one = _weight(_stored("a", 1000))
    store = ResponseStore(size=100, max_bytes=3 * one)
    for rid in "abc":
        store.put(rid, _stored(rid, 1000))
    assert len(store) == 3 and store.nbytes == 3 * one
    assert store.get("a") is not None  # now the most recently used
    store.put("d", _stored("d", 1000))
    assert store.get("b") is None and [store.get(r) is not None for r in "acd"] == [True] * 3
    assert store.nbytes == 3 * one
    big = _stored("e", 2500)  # weighs as much as two and a half: three go for it
    store.put("e", big)
    assert [store.get(r) is not None for r in "acde"] == [False, False, False, True]
    assert store.nbytes == _weight(big) <= store.max_bytes
    store.put("f", _stored("f", 4000))  # over the whole budget: not kept, nothing evicted
    assert store.get("f") is None and store.get("e") is not None
    assert store.delete("e") and not store.delete("e") and store.nbytes == 0 and len(store) == 0


def test_replacing_a_response_counts_it_once() -> None:
    store = ResponseStore(size=4, max_bytes=10_000)
    store.put("a", _stored("a", 100))
    store.put("a", _stored("a", 200))
    assert len(store) == 1 and store.nbytes == _weight(_stored("a", 200))
    with pytest.raises(ValueError):
        ResponseStore(4, max_bytes=-1)


def test_flag_default() -> None:
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert args.responses_store_bytes == DEFAULT_STORE_BYTES == 64 << 20
    args = build_parser().parse_args(["serve", "--model", "m", "--responses-store-bytes", "7"])
    assert args.responses_store_bytes == 7


@pytest.fixture(scope="module")
def small_store() -> Iterator[InProcessServer]:
    srv = start_in_process(responses_store_size=100, responses_store_bytes=6000)
    try:
        yield srv
    finally:
        stop_in_process(srv)


def test_served_store_keeps_what_fits(small_store: InProcessServer) -> None:
    """Through the server: long inputs fill the byte budget long before the count bound, and
    the oldest responses are the ones ``GET`` no longer finds."""
    client = openai.OpenAI(base_url=small_store.url + "/v1", api_key="unused", max_retries=0)
    text = "Once upon a time " * 80  # about 1.4 KB a response with its conversation
    ids = [
        client.responses.create(model="stories", input=f"{i} {text}", max_output_tokens=1).id
        for i in range(6)
    ]
    kept = []
    for rid in ids:
        try:
            kept.append(client.responses.retrieve(rid).id)
        except openai.NotFoundError:
            kept.append(None)
    first = next(i for i, k in enumerate(kept) if k is not None)
    assert 0 < first < len(ids) - 1, kept  # some evicted, more than one kept
    assert kept[:first] == [None] * first and kept[first:] == ids[first:], kept
