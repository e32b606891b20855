"""``AsyncLLM``: the engine behind an asyncio server.

One dedicated thread owns the ``LLMEngine`` and runs its step loop; nothing else touches engine
state. The event loop talks to it through a command queue drained at step boundaries, and the
thread answers through per-request ``asyncio.Queue``s fed with ``loop.call_soon_threadsafe``::

    event loop                         engine thread
    ----------                         -------------
    add_requests() --("add", ack)-->   engine.add_group()     (ValueError -> ack)
    stream.abort() --("abort")----->   engine.abort_group()   (blocks freed at once)
    async for out in stream  <-------  engine.step() outputs, one per request per step

Torch releases the GIL inside its kernels, so the event loop stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from foudre.config import EngineConfig
from foudre.engine.engine import LLMEngine
from foudre.errors import InvalidParameterError
from foudre.outputs import RequestOutput
from foudre.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("foudre")
# how often an idle engine checks that a parallel engine's workers still answer
# (LLMEngine.heartbeat; a no-op on one device)
HEARTBEAT_INTERVAL_S = 2.0

Prompt = str | list[int]
OutputObserver = Callable[[RequestOutput], None]


def sequences_per_prompt(params: SamplingParams | BeamSearchParams) -> int:
    """Sequences one prompt of a submission runs at once (what ``max_queue`` counts)."""
    if isinstance(params, BeamSearchParams):
        return params.beam_width
    return params.num_samples


class QueueFullError(RuntimeError):
    """More unfinished requests than ``max_queue`` allows; retry later."""


class EngineStoppedError(RuntimeError):
    """The engine thread has been shut down; no new request is accepted."""


@dataclass(slots=True)
class _Add:
    """Queue a group: ``params.n`` samples of each prompt (``LLMEngine.add_group``)."""

    group_id: str
    prompts: list[Prompt]
    params: SamplingParams | BeamSearchParams
    cache_salt: str | None
    num_children: int
    stream: RequestStream
    ack: asyncio.Future[None]


@dataclass(slots=True)
class _Abort:
    """Abort these groups (every unfinished child); ``None`` aborts everything."""

    group_ids: list[str] | None


def _resolve(fut: asyncio.Future[None], error: BaseException | None) -> None:
    if fut.done():  # the caller was cancelled meanwhile
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _put_all(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    for stream, out in items:
        stream._queue.put_nowait(out)


class RequestStream:
    """The outputs of one submitted request (all its children when ``n > 1`` or several
    prompts), in step order, ending once every child has finished.

    Iterating raises the engine's error if a step failed. ``abort()`` is idempotent and safe to
    call from the event loop at any time; the stream then ends with ``finish_reason="abort"``.
    """

    def __init__(self, owner: AsyncLLM, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.child_ids: list[str] = []  # set by the engine thread when the group is queued
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._pending: set[str] = set()
        self._accepted = False
        self._abort_sent = False
        self._live = 0  # engine thread: outputs not yet finished
        self._reserved = 0  # engine thread: queue slots it holds (its sequences), freed at its end

    @property
    def finished(self) -> bool:
        return self._accepted and not self._pending

    def abort(self) -> None:
        if not self.finished and not self._abort_sent:
            self._abort_sent = True
            self._owner._submit(_Abort([self.request_id]))

    def _deliver(self, item: RequestOutput | BaseException) -> None:
        """Called from the engine thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._pending.clear()
            raise item
        if item.finished:
            self._pending.discard(item.request_id)
        return item


class AsyncLLM:
    """An ``LLMEngine`` stepped by one background thread, driven from asyncio.

    Guarantees: the engine is only ever touched by its thread; the thread sleeps when there is
    no work; a failing step fails the requests then in flight (their streams raise) and the
    loop keeps serving; ``shutdown()`` aborts what is in flight and joins the thread.
    ``max_queue`` bounds the number of unfinished requests (children counted one by one).
    """

    def __init__(self, engine: LLMEngine, max_queue: int | None = None) -> None:
        if max_queue is not None and max_queue < 1:
            raise ValueError(f"max_queue must be positive, got {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._cv = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._stopping = False
        self._stopped = False
        self._draining = False  # admits nothing more; what is in flight runs on
        self._lock = threading.Lock()  # guards _num_unfinished
        self._num_unfinished = 0
        self._observers: list[OutputObserver] = []
        # engine-thread state: each child's stream, and each group's
        self._sinks: dict[str, RequestStream] = {}
        self._streams: dict[str, RequestStream] = {}
        self._busy = False
        self._snapshot: dict[str, Any] = self._make_snapshot()
        self._thread = threading.Thread(target=self._run, name="foudre-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, max_queue: int | None = None) -> AsyncLLM:
        return cls(LLMEngine(config), max_queue)

    # -- public API (event loop) ---------------------------------------------------------------
    def add_observer(self, observer: OutputObserver) -> None:
        """Call ``observer(output)`` from the engine thread for every output, aborts included.
        Register before the first request; exceptions it raises are logged and ignored."""
        self._observers.append(observer)

    async def add_requests(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | BeamSearchParams,
        request_id: str,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Submit ``params.n`` samples of each prompt and return their stream once the engine
        has accepted them all (or none).

        The submission is one request group (``LLMEngine.add_group``: child ids, output indices
        and seeds are numbered there). Raises ``InvalidParameterError`` (the engine's
        validation, e.g. ``PromptTooLongError``), ``QueueFullError`` or ``EngineStoppedError``.
        """
        total = len(prompts) * sequences_per_prompt(params)
        if total == 0:
            raise InvalidParameterError("prompt", "prompt must not be empty")
        with self._lock:
            if self._stopping or self._draining:
                raise EngineStoppedError("the engine is shutting down")
            if self.max_queue is not None and self._num_unfinished + total > self.max_queue:
                raise QueueFullError(
                    f"the server has {self._num_unfinished} unfinished requests and accepts at "
                    f"most {self.max_queue}; retry later"
                )
            self._num_unfinished += total
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, loop)
        ack: asyncio.Future[None] = loop.create_future()
        self._submit(_Add(request_id, list(prompts), params, cache_salt, total, stream, ack))
        try:
            await ack
        except asyncio.CancelledError:
            stream.abort()  # queued after the add, so it lands on the added requests
            raise
        return stream

    async def generate(
        self, prompt: Prompt, params: SamplingParams, request_id: str
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield each step's output of ``prompt`` (every child's when ``n > 1``) until all are
        finished. Validation errors raise before the first output. If the consumer stops early
        (cancellation, ``aclose``), the request is aborted and its blocks freed within a step.
        """
        stream = await self.add_requests([prompt], params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def abort(self, request_id: str) -> None:
        """Abort a submitted request (every child of its group) by id; unknown ids are
        ignored."""
        self._submit(_Abort([request_id]))

    def drain(self) -> None:
        """Admit no more requests (``add_requests`` raises ``EngineStoppedError``, and
        ``is_running`` turns False) while those in flight run on; thread-safe."""
        with self._lock:
            self._draining = True

    @property
    def num_unfinished(self) -> int:
        """Sequences submitted and not finished yet (aborted ones count until their stream
        has ended)."""
        with self._lock:
            return self._num_unfinished

    def abort_all(self) -> None:
        """Abort every request in flight (thread-safe; used on shutdown signals)."""
        self._submit(_Abort(None))

    def metrics(self) -> dict[str, Any]:
        """A snapshot of ``engine.metrics()`` taken at the last step boundary, plus
        ``num_unfinished_requests`` and ``max_queue``. Thread-safe."""
        snap = dict(self._snapshot)
        with self._lock:
            snap["num_unfinished_requests"] = self._num_unfinished
        snap["max_queue"] = self.max_queue
        return snap

    @property
    def is_running(self) -> bool:
        """The engine thread is alive, not stopping nor draining, and its engine can still
        step."""
        return (
            self._thread.is_alive() and not self._stopping and not self._draining and self._healthy
        )

    @property
    def _healthy(self) -> bool:
        # the snapshot is refreshed by steps; a fatal error (a parallel engine's lost worker)
        # is read live, so that an idle engine reports it too
        return bool(self._snapshot.get("healthy", True)) and self.engine.fatal_error is None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Abort in-flight requests and stop the engine thread, which then stops a parallel
        engine's workers (``LLMEngine.shutdown``, from the thread that steps it). Idempotent."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- engine thread -------------------------------------------------------------------------
    def _submit(self, command: _Add | _Abort) -> None:
        with self._cv:
            if not self._stopped:
                self._commands.append(command)
                self._cv.notify()
                return
        if isinstance(command, _Add):  # the thread is gone: refuse the add
            self._reject(command)

    def _reject(self, command: _Add) -> None:
        self._release(command.num_children)
        with contextlib.suppress(RuntimeError):
            command.stream._loop.call_soon_threadsafe(
                _resolve, command.ack, EngineStoppedError("the engine is shutting down")
            )

    def _end(self, stream: RequestStream) -> None:
        """Give back the queue slots of a stream that ended (finished, aborted or failed): all
        its sequences', however many outputs it had (a beam search has one, best_of n)."""
        self._release(stream._reserved)
        stream._reserved = 0

    def _release(self, count: int) -> None:
        with self._lock:
            self._num_unfinished -= count

    def _make_snapshot(self) -> dict[str, Any]:
        return {**self.engine.metrics(), "healthy": self.engine.healthy}

    def _run(self) -> None:
        while True:
            idle = False
            with self._cv:
                while not self._commands and not self._stopping and not self._busy:
                    if not self._cv.wait(timeout=HEARTBEAT_INTERVAL_S):
                        idle = True  # nothing to do for a while: check the workers below
                        break
                if self._busy and self.engine.stalled and not self._commands:
                    # requests wait for a batch to form: poll the policy, don't spin
                    self._cv.wait(timeout=0.002)
                commands, self._commands = self._commands, []
                stopping = self._stopping
            try:
                if idle:
                    self.engine.heartbeat()
                for command in commands:
                    self._apply(command)
                if stopping:
                    for group_id in list(self._streams):
                        self._abort_group(group_id)
                    self._snapshot = self._make_snapshot()
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._busy = self.engine.has_unfinished_requests()
                self._snapshot = self._make_snapshot()
            except Exception:  # never let the engine thread die
                logger.exception("engine loop error")
                self._busy = False
        try:  # the workers of a parallel engine, told to stop by the thread that steps them
            self.engine.shutdown()
        except Exception:
            logger.exception("stopping the engine failed")
        with self._cv:  # adds that raced with shutdown are refused, never left hanging
            self._stopped = True
            late, self._commands = self._commands, []
        for command in late:
            if isinstance(command, _Add):
                self._reject(command)

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            groups = list(self._streams) if command.group_ids is None else command.group_ids
            for group_id in groups:
                self._abort_group(group_id)
            return
        error: BaseException | None = None
        stream = command.stream
        try:
            stream.child_ids = self.engine.add_group(
                command.group_id, command.prompts, command.params, cache_salt=command.cache_salt
            )
        except Exception as e:
            error = e
            self._release(command.num_children)
        else:
            stream._pending = set(stream.child_ids)
            stream._live = len(stream.child_ids)
            stream._reserved = command.num_children
            stream._accepted = True
            self._streams[command.group_id] = stream
            for rid in stream.child_ids:
                self._sinks[rid] = stream
        with contextlib.suppress(RuntimeError):
            stream._loop.call_soon_threadsafe(_resolve, command.ack, error)

    def _abort_group(self, group_id: str) -> None:
        stream = self._streams.pop(group_id, None)
        if stream is None:
            return
        for rid in stream.child_ids:
            self._sinks.pop(rid, None)
        self._end(stream)  # released first: a failing abort leaks no queue slot
        for out in self.engine.abort_group(group_id):
            self._observe(out)
            stream._deliver(out)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            logger.exception("engine step failed; failing %d in-flight requests", len(self._sinks))
            streams = dict(self._streams)
            self._streams.clear()
            self._sinks.clear()
            for stream in streams.values():
                self._end(stream)
            for group_id in streams:
                with contextlib.suppress(Exception):
                    self.engine.abort_group(group_id)
            error = RuntimeError(f"engine step failed: {type(e).__name__}: {e}")
            for stream in streams.values():
                stream._deliver(error)
            return
        # one wake-up of each event loop per step, however many requests it serves
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            self._observe(out)
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
                sink._live -= 1
                if not sink._live:
                    self._streams.pop(sink.request_id, None)
                    self._end(sink)
            batches.setdefault(sink._loop, []).append((sink, out))
        for loop, items in batches.items():
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
                loop.call_soon_threadsafe(_put_all, items)

    def _observe(self, out: RequestOutput) -> None:
        for observer in self._observers:
            try:
                observer(out)
            except Exception:
                logger.exception("output observer failed")
