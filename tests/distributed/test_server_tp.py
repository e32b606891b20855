"""``foudre serve --tensor-parallel-size 2``: the engine's process and one worker process it
starts itself (gloo on the CPU), behind the OpenAI server, queried over a loopback socket with
the official ``openai`` client. Oracles: a single-process ``LLM`` on the same model (text and
log-probabilities) and stories260K's known greedy text."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import GREEDY, MODEL, TOKENIZER, ServerProcess, start_server

PROMPT = "Once upon a time"
NAME = MODEL.name


def child_pids(pid: int) -> list[int]:
    """The live child processes of ``pid`` (Linux ``/proc``), in no particular order."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def worker_pids(pid: int) -> list[int]:
    """The tensor-parallel workers that process ``pid`` started: its children spawned by
    ``multiprocessing`` that are not its resource tracker."""
    workers = []
    for kid in child_pids(pid):
        try:
            cmd = Path(f"/proc/{kid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        if b"spawn_main" in cmd or b"forkserver" in cmd:
            workers.append(kid)
    return workers


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except OSError:
        return False


def start_tp_server(*extra: str) -> ServerProcess:
    """``foudre serve`` of stories260K with ``--tensor-parallel-size 2``: ready, and with its
    one worker process running."""
    srv = start_server("--tensor-parallel-size", "2", *extra, timeout=120)
    deadline = time.monotonic() + 10
    while len(worker_pids(srv.proc.pid)) != 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # the ready line comes after the workers joined; belt and braces
    assert len(worker_pids(srv.proc.pid)) == 1, child_pids(srv.proc.pid)
    return srv


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    srv = start_tp_server("--max-num-seqs", "16")
    workers = worker_pids(srv.proc.pid)
    try:
        yield srv
        # a clean shutdown stops the workers too
        assert srv.stop() == 0
        deadline = time.monotonic() + 10
        while any(alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(w) for w in workers), "a worker outlived the server"
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
            srv.proc.wait(5)


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_health_and_models(server: ServerProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_greedy_and_logprobs_match_single_process(client: openai.OpenAI) -> None:
    from foudre import LLM, SamplingParams

    llm = LLM(str(MODEL), tokenizer=str(TOKENIZER), dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=32, logprobs=1)
    expected = llm.generate(PROMPT, params)[0].outputs[0]
    got = client.completions.create(
        model=NAME, prompt=PROMPT, max_tokens=32, temperature=0, logprobs=1
    )
    choice = got.choices[0]
    assert choice.text == expected.text
    assert choice.text.startswith(GREEDY[:40])
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    ours = choice.logprobs.token_logprobs
    assert expected.logprobs is not None
    theirs = [step[tok] for step, tok in zip(expected.logprobs, expected.token_ids, strict=True)]
    assert len(ours) == len(theirs) == 32
    # the shards sum partial products in another order: float32 rounding, no more
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) < 1e-3


def test_concurrent_streams_and_chat(client: openai.OpenAI) -> None:
    """Eight requests at once (one batch across both ranks) give the text each gives alone."""
    alone = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    texts: list[str] = []
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            chunks = client.completions.create(
                model=NAME, prompt=PROMPT, max_tokens=24, temperature=0, stream=True
            )
            texts.append("".join(c.choices[0].text for c in chunks if c.choices))
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=stream) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert texts == [alone.choices[0].text] * 8
    chat = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0
    )
    assert chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 8
