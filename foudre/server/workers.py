"""CPU work of requests (tokenizing, rendering chat templates) off the event loop, bounded.

``asyncio.to_thread`` would do the work, but its threads are not daemons (the interpreter waits
for them at exit, so a long tokenization could hold a shutting-down server) and its queue has
no bound (a flood of long prompts would queue without limit while every text request waits).
``WorkerPool`` has a few daemon threads and a bound on pending jobs: past it a job is refused
at once (503), never queued.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class PoolFullError(RuntimeError):
    """Too many jobs pending; retry later."""


class WorkerPool:
    def __init__(self, workers: int = 2, max_pending: int = 64, name: str = "foudre-worker"):
        if workers < 1 or max_pending < 1:
            raise ValueError("workers and max_pending must be positive")
        self.max_pending = max_pending
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.Future[Any]] | None] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._pending = 0
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on a worker thread; ``PoolFullError`` when ``max_pending`` jobs wait."""
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        with self._lock:  # queued under the lock: never after close()'s sentinels
            if self._closed:
                raise PoolFullError("the server is shutting down")
            if self._pending >= self.max_pending:
                raise PoolFullError(f"{self._pending} jobs are pending; retry later")
            self._pending += 1
            self._jobs.put((lambda: fn(*args), future))
        return await future

    def close(self) -> None:
        """Stop taking jobs; the threads end after their current one (daemons: never waited)."""
        with self._lock:
            self._closed = True
        for _ in self._threads:
            self._jobs.put(None)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, future = job
            try:
                result, error = fn(), None
            except BaseException as e:  # delivered to the awaiting request
                result, error = None, e
            with self._lock:
                self._pending -= 1
            loop = future.get_loop()
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, future, result, error)


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the request was cancelled meanwhile
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
