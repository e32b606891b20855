"""``foudre serve`` over a real loopback socket, with the official ``openai`` client and httpx."""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import GREEDY, MODEL, TOKENIZER, ServerProcess, start_server

PROMPT = "Once upon a time"


def _stream_until_shutdown(url: str, seen: threading.Event, result: dict[str, Any]) -> None:
    body = {"prompt": PROMPT, "max_tokens": 500, "ignore_eos": True, "stream": True}
    try:
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", url + "/v1/completions", json=body) as resp,
        ):
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    seen.set()
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        result["error_event"] = obj["error"]
                        continue
                    reason = obj["choices"][0]["finish_reason"]
                    result["finish_reason"] = reason or result.get("finish_reason")
                elif line == "data: [DONE]":
                    result["done"] = True
    except httpx.HTTPError as e:
        result["error"] = repr(e)
    finally:
        seen.set()


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_server("--max-num-seqs", "128")
    try:
        yield srv
        # graceful shutdown with a stream in flight: the drain lets it finish (its last chunk
        # carries its finish reason, then [DONE]), the process exits 0 (tests/server/test_drain.py)
        seen, result = threading.Event(), dict[str, Any]()
        reader = threading.Thread(target=_stream_until_shutdown, args=(srv.url, seen, result))
        reader.start()
        assert seen.wait(20)
        t0 = time.monotonic()
        rc = srv.stop()
        reader.join(20)
        assert rc == 0, f"foudre serve exited with {rc}"
        assert time.monotonic() - t0 < 15
        assert result.get("finish_reason") == "length" and result.get("done"), result
        assert "error_event" not in result and "error" not in result, result
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(5)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def _sse(lines: Iterator[str]) -> list[dict[str, Any]]:
    """The JSON chunks of an SSE body; asserts it ends with [DONE]."""
    chunks, done = [], False
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        assert not done, "data after [DONE]"
        if line == "data: [DONE]":
            done = True
        else:
            chunks.append(json.loads(line[6:]))
    assert done
    return chunks


# -- basics -----------------------------------------------------------------------------------
def test_ready_line(server: ServerProcess) -> None:
    assert re.fullmatch(
        r"foudre: serving stories260K\.bin at http://127\.0\.0\.1:\d+ \(KV cache \d+ tokens, "
        r"max concurrency \d+ at full context 512\)",
        server.ready_line,
    ), server.ready_line


def test_models_health_and_unknown_route(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["stories260K.bin"]
    assert http.get("/health").status_code == 200
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()


def test_greedy_matches_offline_llm(client: openai.OpenAI) -> None:
    from foudre import LLM, SamplingParams

    llm = LLM(str(MODEL), tokenizer=str(TOKENIZER))
    expected = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=48))[0].outputs[0]
    got = client.completions.create(
        model="stories260K.bin", prompt=PROMPT, max_tokens=48, temperature=0
    )
    assert got.choices[0].text == expected.text
    assert got.choices[0].text.startswith(GREEDY)
    assert got.usage is not None
    assert got.usage.prompt_tokens == 5
    assert got.usage.completion_tokens == len(expected.token_ids)
    assert got.choices[0].finish_reason == "length"
    # token-id prompts and a list of prompts give the same text
    ids = llm.get_tokenizer().encode(PROMPT)
    many = client.completions.create(
        model="stories260K.bin", prompt=[ids, ids], max_tokens=48, temperature=0
    )
    assert [c.index for c in many.choices] == [0, 1]
    assert all(c.text == expected.text for c in many.choices)
    assert many.usage is not None and many.usage.prompt_tokens == 10


def test_completion_stream_equals_non_stream(client: openai.OpenAI) -> None:
    full = client.completions.create(
        model="stories260K.bin", prompt=PROMPT, max_tokens=30, temperature=0
    )
    stream = client.completions.create(
        model="stories260K.bin", prompt=PROMPT, max_tokens=30, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_echo(client: openai.OpenAI) -> None:
    got = client.completions.create(
        model="stories260K.bin", prompt=PROMPT, max_tokens=8, temperature=0, echo=True
    )
    assert got.choices[0].text.startswith(PROMPT + ", there was")


def test_chat_stream_and_not(client: openai.OpenAI) -> None:
    messages: Any = [{"role": "user", "content": "Tell me a story."}]
    full = client.chat.completions.create(
        model="stories260K.bin", messages=messages, max_tokens=24, temperature=0
    )
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert full.usage is not None and full.usage.completion_tokens <= 24
    chunks = list(
        client.chat.completions.create(
            model="stories260K.bin", messages=messages, max_tokens=24, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_n_two_choices(client: openai.OpenAI) -> None:
    got = client.completions.create(
        model="stories260K.bin", prompt=PROMPT, max_tokens=16, n=2, seed=7, temperature=1.0
    )
    assert sorted(c.index for c in got.choices) == [0, 1]
    again = client.completions.create(
        model="stories260K.bin", prompt=PROMPT, max_tokens=16, n=2, seed=7, temperature=1.0
    )
    assert [c.text for c in got.choices] == [c.text for c in again.choices]
    chat = client.chat.completions.create(
        model="stories260K.bin",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        n=2,
        stream=True,
    )
    indices = {c.choices[0].index for c in chat if c.choices}
    assert indices == {0, 1}


def test_stop_string_across_tokens(client: openai.OpenAI) -> None:
    stop = "girl na"  # " g" "ir" "l" " na"...: spans token boundaries
    expected = GREEDY[: GREEDY.index(stop)]
    got = client.completions.create(
        model="stories260K.bin", prompt=PROMPT, max_tokens=40, temperature=0, stop=stop
    )
    assert got.choices[0].text == expected
    assert got.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model="stories260K.bin",
        prompt=PROMPT,
        max_tokens=40,
        temperature=0,
        stop=[stop],
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    texts = [c.choices[0].text for c in chunks]
    assert "".join(texts) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"
    # no chunk shows any part of the stop string (the text before it has no "g")
    assert not any("g" in t for t in texts), texts


def test_completion_logprobs(client: openai.OpenAI) -> None:
    got = client.completions.create(
        model="stories260K.bin", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3
    )
    lp = got.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert lp.text_offset is not None
    assert len(lp.tokens) == 10 and "".join(lp.tokens) == got.choices[0].text
    assert all(x is not None and x <= 0 for x in lp.token_logprobs)
    for tok, top, value in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs, strict=True):
        assert len(top) == 3
        assert top[tok] == pytest.approx(value)  # greedy: the chosen token is the top one
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    # streamed: the per-chunk logprobs add up to the same
    stream = client.completions.create(
        model="stories260K.bin", prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3,
        stream=True,
    )  # fmt: skip
    tokens: list[str] = []
    offsets: list[int] = []
    for chunk in stream:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            tokens += chunk.choices[0].logprobs.tokens or []
            offsets += chunk.choices[0].logprobs.text_offset or []
    assert tokens == lp.tokens and offsets == lp.text_offset


def test_chat_logprobs(client: openai.OpenAI) -> None:
    got = client.chat.completions.create(
        model="stories260K.bin",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    content = got.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    for item in content:
        assert item.logprob <= 0 and len(item.top_logprobs) == 2
        assert item.bytes == list(item.token.encode())
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


def test_include_usage(http: httpx.Client) -> None:
    body = {"model": "stories260K.bin", "prompt": PROMPT, "max_tokens": 12, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(resp.iter_lines())
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert all(c["choices"] for c in chunks[:-1])
    body["messages"] = [{"role": "user", "content": "hi"}]
    with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        chat = _sse(resp.iter_lines())
    assert chat[-1]["choices"] == [] and chat[-1]["usage"]["completion_tokens"] == 12


def test_unknown_fields_ignored(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "frobnicate": {"x": 1}, "logit_bias": {"5": 1},
            "user": "me", "suffix": None}  # fmt: skip
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] <= 3


def test_tokenize_detokenize(http: httpx.Client) -> None:
    r = http.post("/tokenize", json={"prompt": PROMPT})
    assert r.status_code == 200 and r.json()["tokens"] == [1, 403, 407, 261, 378]
    r = http.post("/detokenize", json={"tokens": [403, 407, 261, 378]})
    assert r.status_code == 200 and r.json()["prompt"].strip() == PROMPT


# -- errors -----------------------------------------------------------------------------------
def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_errors(http: httpx.Client, client: openai.OpenAI) -> None:
    r = http.post(
        "/v1/completions", content=b'{"prompt": "x", ', headers={"content-type": "application/json"}
    )
    assert "JSON" in _error(r, 400)["message"]
    r = http.post("/v1/chat/completions", content=b"not json")
    _error(r, 400)
    r = http.post("/v1/completions", json=[1, 2])
    _error(r, 400)
    r = http.post("/v1/completions", json={"prompt": "x", "temperature": -1})
    assert _error(r, 400)["param"] == "temperature"
    r = http.post("/v1/completions", json={"prompt": "x", "top_p": 2})
    assert _error(r, 400)["param"] == "top_p"
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": "many"})
    assert _error(r, 400)["param"] == "max_tokens"  # a pydantic error: 400, not 422
    r = http.post("/v1/completions", json={"max_tokens": 2})
    assert _error(r, 400)["param"] == "prompt"
    r = http.post("/v1/chat/completions", json={"messages": []})
    assert _error(r, 400)["param"] == "messages"
    r = http.post("/v1/completions", json={"prompt": [5] * 600})
    err = _error(r, 400)
    assert "600" in err["message"] and "512" in err["message"], err
    r = http.post("/v1/completions", json={"prompt": "x" * 3000})  # long text too
    assert "512" in _error(r, 400)["message"]
    r = http.post("/v1/completions", json={"prompt": "x", "model": "gpt-9"})
    assert _error(r, 404)["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-9", prompt="x")
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="stories260K.bin", prompt="x", temperature=-2)
    # the server is still fine
    assert http.get("/health").status_code == 200


# -- load and disconnects ---------------------------------------------------------------------
def test_64_concurrent_streams(server: ServerProcess) -> None:
    async def main() -> list[tuple[int, int, str | None]]:
        async with openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120
        ) as aclient:

            async def one(i: int) -> tuple[int, int, str | None]:
                stream = await aclient.completions.create(
                    model="stories260K.bin",
                    prompt=f"Story number {i}:",
                    max_tokens=32,
                    temperature=0.8,
                    seed=i,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True},
                )
                usage, n_chunks, reason = None, 0, None
                async for chunk in stream:
                    if chunk.usage is not None:
                        usage = chunk.usage
                    if chunk.choices:
                        n_chunks += 1
                        reason = chunk.choices[0].finish_reason or reason
                assert usage is not None
                return usage.completion_tokens, n_chunks, reason

            return await asyncio.gather(*(one(i) for i in range(64)))

    t0 = time.monotonic()
    results = asyncio.run(asyncio.wait_for(main(), 120))
    elapsed = time.monotonic() - t0
    assert all(r[0] == 32 and r[2] == "length" and r[1] >= 1 for r in results), results
    print(f"64 streams x 32 tokens: {elapsed:.2f}s")


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_disconnect_frees_blocks(http: httpx.Client) -> None:
    before = _metric(
        http.get("/metrics").text, 'foudre:request_success_total{finish_reason="abort"}'
    )
    body = {"prompt": PROMPT, "max_tokens": 480, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as resp:
        got = 0
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                got += 1
                if got == 3:
                    break
        text = http.get("/metrics").text
        if _metric(text, "foudre:kv_cache_usage_perc") == 0:
            # a fast device (a GPU with CUDA graphs) can finish all 480 tokens before the client
            # has read three: then there is nothing left to abort
            pytest.skip("the request finished before the client disconnected")
    # the connection is closed: the request must be aborted and its blocks freed
    deadline = time.monotonic() + 10
    while True:
        text = http.get("/metrics").text
        if _metric(text, "foudre:kv_cache_usage_perc") == 0:
            break
        assert time.monotonic() < deadline, "blocks were not freed after the disconnect"
        time.sleep(0.05)
    assert _metric(text, "foudre:num_requests_running") == 0
    after = _metric(text, 'foudre:request_success_total{finish_reason="abort"}')
    assert after == before + 1


def test_metrics_exposition(http: httpx.Client) -> None:
    text = http.get("/metrics").text
    for name in (
        "foudre:time_to_first_token_seconds_count",
        "foudre:inter_token_latency_seconds_count",
        "foudre:time_per_output_token_seconds_count",
        "foudre:e2e_request_latency_seconds_count",
        "foudre:request_queue_time_seconds_count",
        "foudre:prompt_tokens_total",
        "foudre:generation_tokens_total",
        "foudre:num_preemptions_total",
        "foudre:prefix_cache_queries_total",
        "foudre:prefix_cache_hits_total",
        "foudre:num_requests_running",
        "foudre:num_requests_waiting",
        "foudre:kv_cache_usage_perc",
    ):
        _metric(text, name)
    assert _metric(text, "foudre:time_to_first_token_seconds_count") > 0
    assert _metric(text, "foudre:generation_tokens_total") > 0
    assert _metric(text, 'foudre:request_success_total{finish_reason="length"}') > 0


def test_identical_prompts_hit_prefix_cache(http: httpx.Client) -> None:
    hits = _metric(http.get("/metrics").text, "foudre:prefix_cache_hits_total")
    prompt = PROMPT + GREEDY  # 2 full blocks of 16 tokens
    body = {"prompt": prompt, "max_tokens": 4, "n": 2, "temperature": 0}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200
    r = http.post("/v1/completions", json=body)
    assert len({c["text"] for c in r.json()["choices"]}) == 1
    assert _metric(http.get("/metrics").text, "foudre:prefix_cache_hits_total") >= hits + 2
