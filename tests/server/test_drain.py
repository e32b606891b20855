"""``foudre serve``'s drain on SIGTERM: new requests get 503 with ``Retry-After`` (``/health``
503) while those in flight run on for at most ``--shutdown-timeout`` seconds; what is left then
ends with ``finish_reason "abort"`` (streams: a last chunk, usage, ``[DONE]``; non-streaming: a
200 with what was generated), and the server exits 0. A second signal cuts the drain short."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx

from tests.server.conftest import ServerProcess, start_server

# sequences one at a time, so that most requests are still in flight when the signal comes
SERIAL = ("--max-num-seqs", "1")
BODY = {"prompt": "Once upon a time", "max_tokens": 480, "ignore_eos": True}


class _Request(threading.Thread):
    """One completion request (streamed or not) run to its end in a thread."""

    def __init__(self, url: str, stream: bool, started: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.stream, self.started = url, stream, started
        self.status = 0
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.done = False
        self.text = ""
        self.error: str | None = None

    def run(self) -> None:
        body = {**BODY, "stream": self.stream}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        try:
            with httpx.Client(timeout=60) as client:
                if not self.stream:
                    r = client.post(self.url + "/v1/completions", json=body)
                    self.status = r.status_code
                    choice = r.json()["choices"][0]
                    self.text, self.finish_reason = choice["text"], choice["finish_reason"]
                    self.usage = r.json()["usage"]
                    return
                with client.stream("POST", self.url + "/v1/completions", json=body) as resp:
                    self.status = resp.status_code
                    for line in resp.iter_lines():
                        self._line(line)
        except Exception as e:
            self.error = repr(e)
        finally:
            self.started.set()

    def _line(self, line: str) -> None:
        if line == "data: [DONE]":
            self.done = True
        elif line.startswith("data: "):
            self.started.set()
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                self.text += choice["text"]
                self.finish_reason = choice["finish_reason"] or self.finish_reason
            self.usage = chunk.get("usage") or self.usage


def _start(srv: ServerProcess, count: int) -> list[_Request]:
    started = threading.Event()
    requests = [_Request(srv.url, i % 4 != 3, started) for i in range(count)]
    for r in requests:
        r.start()
    assert started.wait(30)
    time.sleep(0.2)  # every request has reached the engine's queue
    return requests


def _join(srv: ServerProcess, requests: list[_Request]) -> None:
    for r in requests:
        r.join(60)
        assert not r.is_alive() and r.error is None and r.status == 200, vars(r)
        assert r.finish_reason in ("length", "abort") and r.usage is not None, vars(r)
        assert r.usage["completion_tokens"] > 0 or r.finish_reason == "abort"
        assert r.done or not r.stream
    assert srv.proc.wait(30) == 0


def test_drain_lets_in_flight_requests_finish() -> None:
    srv = start_server(*SERIAL)
    try:
        requests = _start(srv, 8)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        with httpx.Client(base_url=srv.url, timeout=10) as http:
            refused = http.post("/v1/completions", json={**BODY, "max_tokens": 2})
            health = http.get("/health")
        assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
        assert refused.json()["error"]["type"] == "service_unavailable"
        assert health.status_code == 503
        _join(srv, requests)
        assert [r.finish_reason for r in requests] == ["length"] * len(requests)
    finally:
        srv.stop()


def test_drain_timeout_ends_what_is_left_with_abort() -> None:
    srv = start_server(*SERIAL, "--shutdown-timeout", "0.5")
    try:
        requests = _start(srv, 12)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        _join(srv, requests)
        assert time.monotonic() - t0 < 15
        reasons = [r.finish_reason for r in requests]
        assert "abort" in reasons, reasons
        assert any(r.finish_reason == "abort" and not r.stream for r in requests), reasons
    finally:
        srv.stop()


def test_a_second_signal_aborts_at_once() -> None:
    srv = start_server(*SERIAL, "--shutdown-timeout", "600")
    try:
        requests = _start(srv, 12)
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        srv.proc.send_signal(signal.SIGTERM)
        _join(srv, requests)
        assert time.monotonic() - t0 < 15
        assert "abort" in [r.finish_reason for r in requests]
    finally:
        srv.stop()
