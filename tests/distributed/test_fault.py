"""A tensor-parallel server that loses a worker (SIGKILL) or finds one hung (SIGSTOP) fails
loudly and fast: the request in flight gets an error, ``/health`` answers 503, and the server
process exits non-zero within 30 seconds, so that a supervisor restarts it instead of leaving it
hung on a collective."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

import httpx
import pytest

from foudre.engine.async_llm import HEARTBEAT_INTERVAL_S
from tests.distributed.test_server_tp import PROMPT, alive, start_tp_server, worker_pids
from tests.server.conftest import ServerProcess

EXIT_WITHIN = 30.0


def _stream(url: str, seen: threading.Event, result: dict[str, Any]) -> None:
    """A long greedy stream; records its error event, finish reason or transport error."""
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    try:
        with (
            httpx.Client(timeout=60) as client,
            client.stream("POST", url + "/v1/completions", json=body) as resp,
        ):
            result["status"] = resp.status_code
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    seen.set()
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        result["error_event"] = obj["error"]
                    elif obj["choices"][0]["finish_reason"]:
                        result["finish_reason"] = obj["choices"][0]["finish_reason"]
                elif line == "data: [DONE]":
                    result["done"] = True
    except httpx.HTTPError as e:
        result["error"] = repr(e)
    finally:
        seen.set()


def _until_unhealthy(srv: ServerProcess, t0: float) -> list[int]:
    """Poll ``/health`` until it answers 503, the process exits or ``EXIT_WITHIN`` seconds
    pass since ``t0``; the statuses seen (transport errors skipped: the socket may close
    before the process ends)."""
    statuses: list[int] = []
    with httpx.Client(timeout=2) as client:
        while srv.proc.poll() is None and time.monotonic() - t0 < EXIT_WITHIN:
            with contextlib.suppress(httpx.HTTPError):
                statuses.append(client.get(srv.url + "/health").status_code)
            if statuses and statuses[-1] == 503:
                break
            time.sleep(0.05)
    return statuses


def _exit_status(srv: ServerProcess, t0: float) -> int:
    """The server's exit status, which must come within ``EXIT_WITHIN`` seconds of ``t0``."""
    try:
        return srv.proc.wait(max(0.1, t0 + EXIT_WITHIN - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the server did not exit within {EXIT_WITHIN} s") from None


def _cleanup(srv: ServerProcess, worker: int) -> None:
    """Kill what the test left: the server, and a worker it stopped (which cannot see its
    parent go)."""
    if srv.proc.poll() is None:
        srv.proc.kill()
        srv.proc.wait(5)
    if alive(worker):
        os.kill(worker, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_worker_lost_during_a_request(sig: signal.Signals) -> None:
    # a hung worker is found by the step's collective timeout, shortened here
    srv = start_tp_server("--distributed-timeout-s", "3")
    (worker,) = worker_pids(srv.proc.pid)
    try:
        seen, result = threading.Event(), dict[str, Any]()
        reader = threading.Thread(target=_stream, args=(srv.url, seen, result))
        reader.start()
        assert seen.wait(30), "no token streamed"
        t0 = time.monotonic()
        os.kill(worker, sig)
        assert _until_unhealthy(srv, t0)[-1:] == [503]
        reader.join(max(0.1, t0 + EXIT_WITHIN - time.monotonic()))
        assert not reader.is_alive(), "the stream hangs after its worker died"
        assert _exit_status(srv, t0) != 0
        # the stream did not end as if it had succeeded
        assert "done" not in result or "error_event" in result, result
        assert result.get("finish_reason") in (None, "error"), result
        assert "error_event" in result or "error" in result or result.get("finish_reason")
    finally:
        _cleanup(srv, worker)


@pytest.mark.slow
def test_worker_killed_between_requests() -> None:
    srv = start_tp_server()
    (worker,) = worker_pids(srv.proc.pid)
    try:
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        t0 = time.monotonic()
        os.kill(worker, signal.SIGKILL)
        # noticed while idle: no request needed to find out
        assert _until_unhealthy(srv, t0)[-1:] == [503]
        # a request now fails at once (or finds the socket closed: the server is exiting)
        # instead of waiting on a collective that will never complete
        try:
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=EXIT_WITHIN)
            assert r.status_code >= 500, r.text
        except httpx.TransportError:
            pass
        assert _exit_status(srv, t0) != 0
    finally:
        _cleanup(srv, worker)


@pytest.mark.slow
def test_worker_hung_between_requests() -> None:
    """A worker stopped while it waits for the next step: the idle engine's heartbeat (a step
    with no rows every ``HEARTBEAT_INTERVAL_S``) times out on it, with no request to find out:
    ``/health`` answers 503 and the server exits non-zero; a request sent meanwhile fails."""
    srv = start_tp_server("--distributed-timeout-s", "3")
    (worker,) = worker_pids(srv.proc.pid)
    try:
        os.kill(worker, signal.SIGSTOP)
        t0 = time.monotonic()
        assert _until_unhealthy(srv, t0)[-1:] == [503]
        assert time.monotonic() - t0 < HEARTBEAT_INTERVAL_S + 3 + 5  # heartbeat + step timeout
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
        try:
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=EXIT_WITHIN)
            assert r.status_code >= 500, r.text
        except httpx.TransportError:
            pass  # the server is already exiting
        assert _exit_status(srv, t0) != 0
    finally:
        _cleanup(srv, worker)
