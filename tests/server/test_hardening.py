"""Bad input gets a 4xx naming the parameter, never a 5xx, a hang or another request's failure;
request ids, body and nesting limits, deadlines, tenant salts. In-process uvicorn over a real
loopback socket, stories260K (vocabulary 512, max_model_len 512)."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from foudre.server.workers import PoolFullError, WorkerPool
from tests.server.conftest import InProcessServer, start_in_process, stop_in_process


@pytest.fixture(scope="module")
def srv() -> Iterator[InProcessServer]:
    s = start_in_process(max_queue=64, max_n=4, max_request_bytes=3 << 20)
    try:
        yield s
    finally:
        stop_in_process(s)


@pytest.fixture
def http(srv: InProcessServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60) as client:
        yield client


def _error(r: httpx.Response, status: int, param: str | None = "any") -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    if param != "any":
        assert err["param"] == param, err
    return err


def _idle(srv: InProcessServer) -> None:
    deadline = time.monotonic() + 10
    while srv.llm.metrics()["kv_cache_usage"] != 0 or srv.llm.metrics()["num_running"]:
        assert time.monotonic() < deadline, srv.llm.metrics()
        time.sleep(0.02)


STREAM = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True}


async def _bad_during_streams(url: str, bad: dict[str, Any]) -> tuple[list[int], int]:
    """Four streams running while ``bad`` is sent: their statuses and the bad one's."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:

        async def stream() -> int:
            chunks = 0
            async with client.stream("POST", "/v1/completions", json=STREAM) as resp:
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        assert "error" not in json.loads(line[6:]), line
                        chunks += 1
            assert chunks >= 40
            return resp.status_code

        tasks = [asyncio.create_task(stream()) for _ in range(4)]
        await asyncio.sleep(0.05)
        r = await client.post("/v1/completions", json=bad)
        return list(await asyncio.gather(*tasks)), r.status_code


@pytest.mark.parametrize(
    ("bad", "param"),
    [
        ({"stop_token_ids": [512]}, "stop_token_ids"),
        ({"stop_token_ids": [10**30]}, "stop_token_ids"),
        ({"logit_bias": {"512": 5}}, "logit_bias"),
        ({"logit_bias": {"x": 5}}, "logit_bias"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids"),
        ({"top_k": 100000}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"n": 10_000_000}, "n"),
        ({"n": 5}, "n"),  # above --max-n
        ({"stop": ["x"] * 100}, "stop"),
        ({"max_tokens": 10_000}, "max_tokens"),  # more than max_model_len leaves
    ],
)
def test_bad_parameters_are_400_and_fail_nobody_else(
    srv: InProcessServer, http: httpx.Client, bad: dict[str, Any], param: str
) -> None:
    body = {"prompt": "Once", "max_tokens": 8, "min_tokens": 2, **bad}
    t0 = time.monotonic()
    _error(http.post("/v1/completions", json=body), 400, param)
    assert time.monotonic() - t0 < 5  # n=10M is refused before anything is built
    statuses, status = asyncio.run(_bad_during_streams(srv.url, body))
    assert statuses == [200] * 4 and status == 400
    _idle(srv)


def test_non_finite_floats_are_400(http: httpx.Client) -> None:
    for raw in (b'{"prompt": "x", "temperature": Infinity}', b'{"prompt": "x", "top_p": NaN}'):
        r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert _error(r, 400)["param"] in ("temperature", "top_p")


def test_unicode_and_nesting_limits(http: httpx.Client) -> None:
    lone = '{"prompt": "a\\ud800b", "echo": true, "max_tokens": 2}'
    for body in (lone, lone.replace("}", ', "stream": true}')):
        r = http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert "surrogate" in _error(r, 400, "prompt")["message"]
    chat = '{"messages": [{"role": "user", "content": "\\udc00"}]}'
    r = http.post("/v1/chat/completions", content=chat)
    _error(r, 400, "messages")
    r = http.post("/tokenize", content='{"prompt": "\\ud83d"}')
    _error(r, 400, "prompt")
    deep = "[" * 2000 + "]" * 2000
    r = http.post("/v1/completions", content='{"prompt": "x", "stop": ' + deep + "}")
    assert "nested" in _error(r, 400)["message"]
    r = http.post("/v1/completions", content='{"prompt": "x", "user": ' + "[" * 70 + "]" * 70 + "}")
    _error(r, 400, "user")


def test_echo_with_token_ids_outside_the_vocabulary(http: httpx.Client) -> None:
    for stream in (False, True):
        body = {"prompt": [1, 600], "echo": True, "max_tokens": 2, "stream": stream}
        _error(http.post("/v1/completions", json=body), 400, "prompt")


def test_the_engine_checks_prompts_and_the_server_names_the_field(
    srv: InProcessServer, http: httpx.Client
) -> None:
    """The engine refuses an empty prompt, token ids outside the vocabulary and a prompt over
    max_model_len (the server keeps no copy of these checks); the answer names the API field."""
    for body in (
        {"prompt": [1, 10**30]},
        {"prompt": [[1, 2], [1, 600]], "echo": True},
        {"prompt": [1, 600], "use_beam_search": True, "n": 2, "echo": True},
    ):
        assert "outside the vocabulary" in _error(_post(http, body), 400, "prompt")["message"]
    for prompt in ([], [[]], [[1, 2], []]):
        assert "empty" in _error(_post(http, {"prompt": prompt}), 400, "prompt")["message"]
    long = list(range(1, 501)) * 2  # 1000 ids, max_model_len 512
    for body in ({"prompt": long}, {"prompt": [[1, 2], long]}, {"prompt": long, "max_tokens": 8}):
        err = _error(_post(http, body), 400, "prompt")
        assert err["code"] == "context_length_exceeded" and "512" in err["message"]
    chat = {"messages": [{"role": "user", "content": "once " * 600}]}
    assert _error(_post(http, chat, "/v1/chat/completions"), 400, "messages")["code"] == (
        "context_length_exceeded"
    )
    # a prompt that fits but leaves no room for max_tokens: the server's own (OpenAI's) rule
    err = _error(_post(http, {"prompt": list(range(1, 501)), "max_tokens": 20}), 400, "max_tokens")
    assert err["code"] == "context_length_exceeded"
    assert srv.llm.metrics()["num_unfinished_requests"] == 0


def test_echo_of_token_ids(http: httpx.Client) -> None:
    ids = http.post("/tokenize", json={"prompt": "Once upon a time"}).json()["tokens"]
    text = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    for search in (False, True):
        body = {"prompt": [ids, ids], "echo": True, "max_tokens": 3, "temperature": 0}
        body |= {"use_beam_search": True, "n": 1, "best_of": 2} if search else {}
        choices = _post(http, body).json()["choices"]
        assert len(choices) == 2 and all(c["text"].startswith(text) for c in choices)


def _post(http: httpx.Client, body: dict[str, Any], path: str = "/v1/completions") -> Any:
    return http.post(path, json={"max_tokens": 2, **body})


def test_long_prompts_are_refused_before_tokenizing(http: httpx.Client) -> None:
    huge = "Once upon a time " * 120_000  # 2M characters
    t0 = time.monotonic()
    err = _error(http.post("/v1/completions", json={"prompt": huge}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    body = {"messages": [{"role": "user", "content": huge}]}
    _error(http.post("/v1/chat/completions", json=body), 400, "messages")
    _error(http.post("/tokenize", json={"prompt": huge}), 400, "prompt")
    assert time.monotonic() - t0 < 10
    # a text that fits the character bound but not the context: tokenized, then refused
    err = _error(http.post("/v1/completions", json={"prompt": "once " * 2000}), 400, "prompt")
    assert "512" in err["message"]
    assert http.get("/health").status_code == 200


def test_body_size_limit(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "x" * (4 << 20)})
    assert _error(r, 413)["code"] == "request_too_large"


def test_request_ids(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2}, headers={
        "X-Request-Id": "client-42"})  # fmt: skip
    assert r.status_code == 200 and r.headers["x-request-id"] == "client-42"
    r = http.post("/v1/completions", json={"prompt": "Once", "temperature": -1})
    assert r.status_code == 400 and len(r.headers["x-request-id"]) == 32  # generated
    r = http.get("/health", headers={"X-Request-Id": "bad id with spaces"})
    assert r.headers["x-request-id"] != "bad id with spaces"


def test_finish_reasons_are_openai_values(http: httpx.Client) -> None:
    body = {"prompt": "Once", "max_tokens": 30, "n": 3, "temperature": 1.0, "seed": 1}
    choices = http.post("/v1/completions", json=body).json()["choices"]
    reasons = {c["finish_reason"] for c in choices}
    assert reasons <= {"stop", "length"}


def test_cache_salt_keeps_tenants_apart(srv: InProcessServer, http: httpx.Client) -> None:
    prompt = list(range(1, 70))

    def hits(salt: str) -> float:
        before = srv.llm.metrics()["prefix_cache_hits"]
        body = {"prompt": prompt, "max_tokens": 1, "cache_salt": salt}
        assert http.post("/v1/completions", json=body).status_code == 200
        time.sleep(0.05)  # the snapshot is taken at the step boundary
        return float(srv.llm.metrics()["prefix_cache_hits"] - before)

    assert hits("tenant-a") == 0
    assert hits("tenant-a") == 64
    assert hits("tenant-b") == 0


def test_openapi_declares_every_body(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    posts = {path: ops["post"] for path, ops in spec["paths"].items() if "post" in ops}
    declared = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize"}
    assert declared | {"/detokenize"} <= set(posts)
    for op in posts.values():
        assert "$ref" in op["requestBody"]["content"]["application/json"]["schema"]
        assert "200" in op["responses"] and "default" in op["responses"]
    assert "CompletionRequest" in spec["components"]["schemas"]


def test_disconnect_while_sending_the_body_is_no_error(
    srv: InProcessServer, caplog: pytest.LogCaptureFixture
) -> None:
    host, port = srv.url.removeprefix("http://").split(":")
    with caplog.at_level(logging.ERROR, logger="foudre"):
        for _ in range(5):
            with socket.create_connection((host, int(port))) as sock:
                sock.sendall(
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                    b'\r\nContent-Length: 1000\r\n\r\n{"prompt": '
                )
        time.sleep(0.5)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_request_timeout_aborts_and_frees() -> None:
    s = start_in_process(request_timeout=0.3, engine={"max_num_seqs": 4})
    # Paced so that 480 tokens take about a second on any host (unpaced, a fast one finished
    # them inside the 0.3 s timeout), while two tokens still take a few milliseconds.
    step = s.llm.engine.step

    def paced_step() -> Any:
        time.sleep(0.002)
        return step()

    s.llm.engine.step = paced_step  # type: ignore[method-assign]
    try:
        body = {"prompt": "Once", "max_tokens": 480, "ignore_eos": True}
        with httpx.Client(base_url=s.url, timeout=60) as http:
            assert _error(http.post("/v1/completions", json=body), 408)["code"] == "timeout"
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
                lines = [line for line in resp.iter_lines() if line]
            assert lines[-1] == "data: [DONE]"
            assert json.loads(lines[-2][6:])["error"]["code"] == "timeout"
            ok = http.post("/v1/completions", json={**body, "max_tokens": 2})
            assert ok.status_code == 200
        _idle(s)
    finally:
        stop_in_process(s)


def test_worker_pool_is_bounded() -> None:
    async def main() -> None:
        pool = WorkerPool(workers=1, max_pending=1)
        gate = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wait() -> int:
            asyncio.run_coroutine_threadsafe(gate.wait(), loop).result(5)
            return 7

        first = asyncio.create_task(pool.run(wait))
        await asyncio.sleep(0.05)
        with pytest.raises(PoolFullError):
            await pool.run(len, "x")
        gate.set()
        assert await first == 7
        assert await pool.run(len, "abc") == 3
        pool.close()

    asyncio.run(main())
