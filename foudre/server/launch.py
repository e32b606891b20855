"""``foudre serve``: load the engine, run uvicorn, shut down cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn

from foudre.config import EngineConfig
from foudre.engine.async_llm import AsyncLLM
from foudre.server.app import DEFAULT_MAX_REQUEST_BYTES, build_app
from foudre.server.serving import DEFAULT_MAX_N


def default_served_name(model: str) -> str:
    """The basename of the model path (a hub id keeps its last component)."""
    return Path(model.rstrip("/")).name or model


# how long a server whose engine broke for good keeps answering (503 on /health, the error
# events of the streams that were in flight) before it exits
FATAL_GRACE_S = 1.0


class _Server(uvicorn.Server):
    """uvicorn, plus: abort in-flight requests at the first shutdown signal (so open streams
    end at once instead of holding the graceful shutdown), exit with status 0 instead of
    re-raising the signal, one ready line on stdout with the bound address, and an exit
    ``FATAL_GRACE_S`` after the engine broke for good (``LLMEngine.fatal_error``: a parallel
    engine lost a worker), so that a supervisor restarts the server rather than it answering
    503 for ever."""

    def __init__(self, config: uvicorn.Config, llm: AsyncLLM, ready_line: str) -> None:
        super().__init__(config)
        self._llm = llm
        self._ready_line = ready_line
        self.fatal_error: str | None = None
        self._fatal_since = 0.0

    async def on_tick(self, counter: int) -> bool:
        error = self._llm.engine.fatal_error
        if error is not None and self.fatal_error is None:
            self.fatal_error, self._fatal_since = error, time.monotonic()
            print(f"foudre: error: the engine cannot step ({error}); exiting", file=sys.stderr)
        if self.fatal_error is not None and time.monotonic() - self._fatal_since >= FATAL_GRACE_S:
            if not self.should_exit:
                self._llm.abort_all()
            self.should_exit = True
        return await super().on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self._llm.abort_all()
        super().handle_exit(sig, frame)
        self._captured_signals.clear()

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            host, port = self.config.host, self.config.port
            for server in self.servers:
                for sock in server.sockets:
                    host, port = sock.getsockname()[:2]
                    break
            print(self._ready_line.format(url=f"http://{host}:{port}"), flush=True)


def run_server(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_queue: int | None = None,
    log_level: str = "warning",
    max_n: int = DEFAULT_MAX_N,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    request_timeout: float | None = None,
    tool_call_parser: str | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM; returns 0 after a clean shutdown, 1 when the engine broke
    for good (``LLMEngine.fatal_error``)."""
    llm = AsyncLLM.from_config(config, max_queue=max_queue)
    try:
        engine = llm.engine
        name = served_model_name or default_served_name(engine.model_name)
        snap = llm.metrics()
        capacity = snap["num_total_blocks"] * snap["block_size"]
        ready = (
            f"foudre: serving {name} at {{url}} (KV cache {capacity} tokens, max concurrency "
            f"{capacity // engine.max_model_len} at full context {engine.max_model_len})"
        )
        app = build_app(
            llm,
            name,
            api_key=api_key,
            max_n=max_n,
            max_request_bytes=max_request_bytes,
            request_timeout=request_timeout,
            tool_call_parser=tool_call_parser,
        )
        uv_config = uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            access_log=log_level in ("info", "debug", "trace"),
            timeout_graceful_shutdown=10,
            # longer than clients keep idle connections (httpx: 5 s), so a client never reuses
            # a connection the server is closing at that moment
            timeout_keep_alive=75,
            lifespan="on",
        )
        server = _Server(uv_config, llm, ready)
        server.run()
        if not server.started:
            print(f"foudre: error: could not start the server on {host}:{port}", file=sys.stderr)
            return 1
        return 1 if server.fatal_error is not None else 0
    finally:
        llm.shutdown()
        sys.stdout.flush()
