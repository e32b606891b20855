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
from foudre.server.serving_responses import DEFAULT_STORE_BYTES, DEFAULT_STORE_SIZE


def default_served_name(model: str) -> str:
    """The basename of the model path (a hub id keeps its last component)."""
    return Path(model.rstrip("/")).name or model


# how long a server whose engine broke for good keeps answering (503 on /health, the error
# events of the streams that were in flight) before it exits
FATAL_GRACE_S = 1.0
DEFAULT_SHUTDOWN_TIMEOUT = 30.0  # seconds in-flight requests may run after the first signal


class _Server(uvicorn.Server):
    """uvicorn, plus: a drain at the first shutdown signal, an exit with status 0 instead of
    re-raising the signal, one ready line on stdout with the bound address, and an exit
    ``FATAL_GRACE_S`` after the engine broke for good (``LLMEngine.fatal_error``: a parallel
    engine lost a worker), so that a supervisor restarts the server rather than it answering
    503 for ever.

    The drain: the first SIGTERM/SIGINT stops admitting (new requests get 503 with
    ``Retry-After``, ``/health`` 503) while the requests in flight run on, for at most
    ``shutdown_timeout`` seconds; what is left then ends with ``finish_reason "abort"`` (what
    it generated, a last chunk, usage and ``[DONE]`` when streamed), and the server exits once
    the responses are written. A second signal ends the drain at once the same way."""

    def __init__(
        self, config: uvicorn.Config, llm: AsyncLLM, ready_line: str, shutdown_timeout: float
    ) -> None:
        super().__init__(config)
        self._llm = llm
        self._ready_line = ready_line
        self._shutdown_timeout = shutdown_timeout
        self._drain_deadline: float | None = None  # set by the first signal
        self.fatal_error: str | None = None
        self._fatal_since = 0.0

    async def on_tick(self, counter: int) -> bool:
        error = self._llm.engine.fatal_error
        if error is not None and self.fatal_error is None:
            self.fatal_error, self._fatal_since = error, time.monotonic()
            print(f"foudre: error: the engine cannot step ({error}); exiting", file=sys.stderr)
        if self.fatal_error is not None and time.monotonic() - self._fatal_since >= FATAL_GRACE_S:
            self._end_drain()
        deadline = self._drain_deadline
        draining = deadline is not None and not self.should_exit
        if draining and (self._llm.num_unfinished == 0 or time.monotonic() >= (deadline or 0)):
            self._end_drain()  # nothing left in flight, or the drain's time is up
        return await super().on_tick(counter)

    def _end_drain(self) -> None:
        """Abort what is still in flight (each response ends with ``finish_reason "abort"``)
        and exit once the responses are written."""
        if not self.should_exit:
            self._llm.abort_all()
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._drain_deadline is None:
            self._llm.drain()
            self._drain_deadline = time.monotonic() + self._shutdown_timeout
            print(
                f"foudre: draining: in-flight requests may run {self._shutdown_timeout:g} s more; "
                "signal again to stop now",
                file=sys.stderr,
            )
        else:
            self._end_drain()
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
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT,
    responses_store_size: int = DEFAULT_STORE_SIZE,
    responses_store_bytes: int = DEFAULT_STORE_BYTES,
    reasoning_parser: str | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM, then drain (``_Server``) for at most ``shutdown_timeout``
    seconds; returns 0 after a clean shutdown, 1 when the engine broke for good
    (``LLMEngine.fatal_error``)."""
    if shutdown_timeout < 0:
        raise ValueError(f"shutdown_timeout must be at least 0, got {shutdown_timeout}")
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
            responses_store_size=responses_store_size,
            responses_store_bytes=responses_store_bytes,
            reasoning_parser=reasoning_parser,
        )
        print(f"foudre: reasoning parser: {app.state.reasoning_parser}", file=sys.stderr)
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
        server = _Server(uv_config, llm, ready, shutdown_timeout)
        server.run()
        if not server.started:
            print(f"foudre: error: could not start the server on {host}:{port}", file=sys.stderr)
            return 1
        return 1 if server.fatal_error is not None else 0
    finally:
        llm.shutdown()
        sys.stdout.flush()
