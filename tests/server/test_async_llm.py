"""``AsyncLLM`` on its own: streaming, validation errors, early exit aborts, shutdown."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from foudre.config import EngineConfig
from foudre.engine.async_llm import AsyncLLM, EngineStoppedError, QueueFullError
from foudre.sampling_params import SamplingParams
from tests.server.conftest import MODEL, TOKENIZER


@pytest.fixture(scope="module")
def llm() -> Iterator[AsyncLLM]:
    if not MODEL.exists():
        pytest.skip("../shared/models/stories260K is not present")
    a = AsyncLLM.from_config(EngineConfig(model=str(MODEL), tokenizer=str(TOKENIZER)), max_queue=8)
    try:
        yield a
    finally:
        a.shutdown()


def _wait_idle(llm: AsyncLLM, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        m = llm.metrics()
        if m["kv_cache_usage"] == 0 and m["num_unfinished_requests"] == 0:
            return
        assert time.monotonic() < deadline, m
        time.sleep(0.01)


def test_generate_streams_deltas(llm: AsyncLLM) -> None:
    async def main() -> tuple[str, str, int]:
        params = SamplingParams(temperature=0.0, max_tokens=20)
        deltas, last = [], None
        async for out in llm.generate("Once upon a time", params, "r1"):
            deltas.append(out.outputs[0].delta_text)
            last = out
        assert last is not None and last.finished
        return "".join(deltas), last.outputs[0].text, len(last.outputs[0].token_ids)

    joined, text, n = asyncio.run(main())
    assert joined == text and text.startswith(", there was a little girl")
    assert n == 20
    _wait_idle(llm)


def test_n_children(llm: AsyncLLM) -> None:
    async def main() -> dict[int, list[int]]:
        params = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=1, ignore_eos=True)
        finals = {}
        async for out in llm.generate("Once", params, "fam"):
            assert out.request_id == f"fam-{out.outputs[0].index}"
            if out.finished:
                finals[out.outputs[0].index] = out.outputs[0].token_ids
        return finals

    finals = asyncio.run(main())
    assert sorted(finals) == [0, 1, 2] and all(len(t) == 8 for t in finals.values())
    _wait_idle(llm)


def test_validation_error_propagates(llm: AsyncLLM) -> None:
    async def main() -> None:
        async for _ in llm.generate([5] * 600, SamplingParams(), "too-long"):
            pass

    with pytest.raises(ValueError, match=r"600.*512"):
        asyncio.run(main())
    _wait_idle(llm)


def test_early_exit_aborts(llm: AsyncLLM) -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=400, ignore_eos=True)
        gen = llm.generate("Once", params, "quitter")
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 3:
                break
        await gen.aclose()  # what a cancelled consumer does

    asyncio.run(main())
    _wait_idle(llm)


def test_cancelled_task_aborts(llm: AsyncLLM) -> None:
    async def consume() -> None:
        async for _ in llm.generate("Once", SamplingParams(max_tokens=400, ignore_eos=True), "c"):
            pass

    async def main() -> None:
        task = asyncio.create_task(consume())
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    _wait_idle(llm)


def test_queue_full(llm: AsyncLLM) -> None:
    async def main() -> None:
        params = SamplingParams(max_tokens=400, ignore_eos=True, n=8)
        stream = await llm.add_requests(["Once"], params, "big")
        with pytest.raises(QueueFullError):
            await llm.add_requests(["Once"], SamplingParams(), "one-more")
        stream.abort()
        reasons = [out.outputs[0].finish_reason async for out in stream if out.finished]
        assert reasons == ["abort"] * 8

    asyncio.run(main())
    _wait_idle(llm)


def test_shutdown_aborts_in_flight() -> None:
    if not MODEL.exists():
        pytest.skip("../shared/models/stories260K is not present")
    a = AsyncLLM.from_config(EngineConfig(model=str(MODEL), tokenizer=str(TOKENIZER)))

    async def main() -> str | None:
        params = SamplingParams(max_tokens=500, ignore_eos=True)
        stream = await a.add_requests(["Once"], params, "victim")
        await stream.__anext__()
        a.shutdown()
        last = None
        async for out in stream:
            last = out
        assert last is not None
        with pytest.raises(EngineStoppedError):
            await a.add_requests(["Once"], params, "late")
        return last.outputs[0].finish_reason

    try:
        assert asyncio.run(asyncio.wait_for(main(), 30)) == "abort"
        assert not a._thread.is_alive()
        assert a.metrics()["kv_cache_usage"] == 0
    finally:
        a.shutdown()
