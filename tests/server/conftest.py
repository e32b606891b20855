"""Servers for the server tests: ``foudre serve`` as a subprocess, and an in-process uvicorn.

Both bind 127.0.0.1 on a port the OS picks, are bounded in time, and are always stopped.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from tests.conftest import REPO, STORIES

# litellm reads its model cost map from the network at import unless told to use its own copy
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

MODEL = STORIES / "stories260K.bin"
TOKENIZER = STORIES / "tok512.bin"
GREEDY = ", there was a little girl named Lily. She loved to play outside in the park."


def _require_model() -> None:
    if not MODEL.exists():
        pytest.skip("../shared/models/stories260K is not present")


@dataclass
class ServerProcess:
    proc: subprocess.Popen[str]
    url: str
    ready_line: str

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise


def start_server(*extra: str, timeout: float = 60.0) -> ServerProcess:
    """Run ``foudre serve`` on a free loopback port; return once it printed its ready line."""
    _require_model()
    cmd = [sys.executable, "-m", "foudre.cli", "serve", "--model", str(MODEL),
           "--tokenizer", str(TOKENIZER), "--host", "127.0.0.1", "--port", "0", *extra]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    line = ""
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if sel.select(timeout=0.5):
                line = proc.stdout.readline()
                if line.startswith("foudre: serving"):
                    break
        else:
            raise RuntimeError(f"foudre serve did not start (rc={proc.poll()}); last: {line!r}")
        url = line.split(" at ", 1)[1].split(" ", 1)[0]
        with httpx.Client(timeout=5) as client:  # ready line means bound; check /health anyway
            assert client.get(url + "/health").status_code == 200
        return ServerProcess(proc, url, line.strip())
    except BaseException:
        proc.kill()
        proc.wait(5)
        raise
    finally:
        sel.close()


@dataclass
class InProcessServer:
    url: str
    llm: Any
    server: uvicorn.Server
    thread: threading.Thread


def start_in_process(**app_kwargs: Any) -> InProcessServer:
    """``build_app`` over a fresh ``AsyncLLM`` in a uvicorn thread on a free loopback port.

    ``max_queue`` and ``engine`` options go to the engine; the rest to ``build_app``."""
    _require_model()
    from foudre.config import EngineConfig
    from foudre.engine.async_llm import AsyncLLM
    from foudre.server.app import build_app

    max_queue = app_kwargs.pop("max_queue", None)
    engine_opts = app_kwargs.pop("engine", {})
    engine_opts = {"model": str(MODEL), "tokenizer": str(TOKENIZER), **engine_opts}
    llm = AsyncLLM.from_config(EngineConfig(**engine_opts), max_queue)
    app = build_app(llm, "stories", **app_kwargs)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            llm.shutdown()
            raise RuntimeError("in-process server did not start")
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return InProcessServer(f"http://127.0.0.1:{port}", llm, server, thread)


def stop_in_process(srv: InProcessServer) -> None:
    srv.server.should_exit = True
    srv.thread.join(20)
    srv.llm.shutdown()
    assert not srv.thread.is_alive()


@pytest.fixture(scope="module")
def in_process_server(request: pytest.FixtureRequest) -> Iterator[InProcessServer]:
    srv = start_in_process(**getattr(request, "param", {}))
    try:
        yield srv
    finally:
        stop_in_process(srv)
