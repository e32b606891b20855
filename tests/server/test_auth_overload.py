"""Authentication, overload (503), unexpected errors (500) and engine-step failures, on an
in-process uvicorn over a real loopback socket."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import InProcessServer, start_in_process, stop_in_process

KEY = "sekret-key"


@pytest.fixture(scope="module")
def srv() -> Iterator[InProcessServer]:
    s = start_in_process(api_key=KEY, max_queue=2)
    try:
        yield s
    finally:
        stop_in_process(s)


def _auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _error(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_api_key(srv: InProcessServer) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        body = {"prompt": "Once", "max_tokens": 2}
        assert _error(http.post("/v1/completions", json=body), 401)["code"] == "invalid_api_key"
        _error(http.post("/v1/completions", json=body, headers=_auth("wrong")), 401)
        _error(http.get("/v1/models"), 401)
        _error(http.get("/v1/models", headers={"Authorization": KEY}), 401)  # no "Bearer"
        _error(http.post("/tokenize", json={"prompt": "x"}), 401)
        assert http.get("/health").status_code == 200  # open
        assert http.get("/metrics").status_code == 200
        r = http.post("/v1/completions", json=body, headers=_auth())
        assert r.status_code == 200, r.text
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
    ok = openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in ok.models.list().data] == ["stories"]


def test_queue_full_503(srv: InProcessServer) -> None:
    long = {"prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True, "n": 2}
    with httpx.Client(base_url=srv.url, timeout=30, headers=_auth()) as http:
        with http.stream("POST", "/v1/completions", json=long) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            # two unfinished requests == max_queue: one more is refused
            r = http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
            err = _error(r, 503)
            assert "retry" in err["message"].lower()
            assert r.headers["retry-after"] == "1"
        # the stream is closed: its requests are aborted and the queue drains
        deadline = time.monotonic() + 10
        while True:
            r = http.post("/v1/completions", json={"prompt": "Once", "max_tokens": 2})
            if r.status_code == 200:
                break
            assert r.status_code == 503 and time.monotonic() < deadline
            time.sleep(0.05)
    assert srv.llm.metrics()["num_unfinished_requests"] == 0


def test_unexpected_error_is_500(srv: InProcessServer, monkeypatch: pytest.MonkeyPatch) -> None:
    app: Any = srv.server.config.app
    serving = app.state.serving

    def boom(*args: Any, **kwargs: Any) -> Any:
        raise KeyError("boom")

    monkeypatch.setattr(serving, "check_model", boom)
    with httpx.Client(base_url=srv.url, timeout=30, headers=_auth()) as http:
        err = _error(http.post("/v1/completions", json={"prompt": "x"}), 500)
        assert err["type"] == "internal_server_error"
        monkeypatch.undo()
        assert (
            http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}).status_code == 200
        )


def test_engine_step_failure_fails_requests_not_server(
    srv: InProcessServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = srv.llm.engine
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step() -> Any:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated kernel failure")
        return real_step()

    monkeypatch.setattr(engine, "step", flaky_step)
    body = {"prompt": "Once", "max_tokens": 20, "ignore_eos": True}
    with httpx.Client(base_url=srv.url, timeout=30, headers=_auth()) as http:
        err = _error(http.post("/v1/completions", json=body), 500)
        assert "simulated kernel failure" in err["message"]
        # streamed: an error event then [DONE]
        calls["n"] = 0
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
            lines = [line for line in resp.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        assert "simulated kernel failure" in json.loads(lines[-2][6:])["error"]["message"]
        # and the server goes on
        r = http.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 20
    deadline = time.monotonic() + 5
    while srv.llm.metrics()["kv_cache_usage"] != 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
