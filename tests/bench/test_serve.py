"""``run_bench_serve`` end to end against a fake OpenAI-compatible streaming server.

The fake server (FastAPI under uvicorn, in a thread) binds 127.0.0.1 on a port the OS picks, is
always stopped, and streams a known number of chunks after a known delay, so TTFT, output
lengths and failures have known answers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from foudre.bench.serve import add_bench_serve_args, run_bench_serve

TTFT_S = 0.1
ITL_S = 0.01


@dataclass
class FakeState:
    """What the fake server saw; written by the server thread, read after it stops."""

    count: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def make_app(state: FakeState) -> FastAPI:
    """``/v1/completions``: every 5th request gets HTTP 500, the 7th an error event after two
    chunks; the others stream one chunk per 2 tokens and report usage. ``/v1/chat/completions``:
    one chunk per token, no usage chunk, never fails."""
    app = FastAPI()

    async def stream(body: dict[str, Any], k: int, chat: bool) -> AsyncIterator[str]:
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            n = int(body["max_tokens"])
            step = 1 if chat else 2
            yield ": keep-alive comment\n\n"
            if chat:
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
            await asyncio.sleep(TTFT_S)
            for i in range(0, n, step):
                if i:
                    await asyncio.sleep(ITL_S)
                if not chat and k == 7 and i >= 4:
                    yield sse({"error": {"message": "engine exploded", "code": 500}})
                    return
                text = "".join(f" t{j}" for j in range(i, min(n, i + step)))
                choice = (
                    {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                )
                yield sse({"choices": [choice]})
            if not chat:
                prompt_tokens = len(body["prompt"])
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": n}
                yield sse({"choices": [], "usage": usage})
            yield "data: [DONE]\n\n"
        finally:
            state.in_flight -= 1

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await request.json()
        state.count += 1
        state.bodies.append(body)
        if state.count % 5 == 0:
            return JSONResponse({"error": {"message": "overloaded"}}, status_code=500)
        return StreamingResponse(stream(body, state.count, False), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        state.count += 1
        state.bodies.append(body)
        return StreamingResponse(stream(body, state.count, True), media_type="text/event-stream")

    return app


@contextmanager
def fake_server() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(make_app(state), log_level="warning", lifespan="off", access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 15.0
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=15.0)
        sock.close()
    assert not thread.is_alive(), "fake server did not stop"


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_serve_args(parser)
    return parser.parse_args(argv)


def test_completions_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result_path, plot_path = tmp_path / "run.json", tmp_path / "run.png"
    with fake_server() as (url, state):
        args = parse([
            "--base-url", url, "--model", "fake", "--num-prompts", "10",
            "--request-rate", "inf", "--dataset", "random", "--input-len", "8",
            "--output-len", "6", "--seed", "1", "--save-result", str(result_path),
            "--plot", str(plot_path), "--slo", "ttft_ms=5000", "--slo", "tpot_ms=5000",
        ])  # fmt: skip
        assert run_bench_serve(args) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Request goodput (req/s)" in out
    assert "error (2x): HTTP 500: overloaded" in out

    assert state.count == 10
    for body in state.bodies:
        assert body["model"] == "fake" and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert body["ignore_eos"] is True and body["max_tokens"] == 6
        assert len(body["prompt"]) == 8 and all(isinstance(t, int) for t in body["prompt"])

    res = json.loads(result_path.read_text())
    expected = {"completed", "failed", "duration", "total_input_tokens", "total_output_tokens",
                "request_throughput", "output_throughput", "total_token_throughput", "goodput",
                "ttfts", "itls", "e2els", "output_lens", "input_lens", "errors", "base_url",
                "model", "endpoint", "request_rate", "burstiness", "max_concurrency",
                "num_prompts", "date"}  # fmt: skip
    expected |= {f"{s}_{m}_ms" for s in ("mean", "median", "std", "p90", "p99")
                 for m in ("ttft", "tpot", "itl", "e2el")}  # fmt: skip
    assert expected <= res.keys()
    assert (res["completed"], res["failed"]) == (7, 3)
    errors = [e for e in res["errors"] if e]
    assert sorted(errors) == sorted(["HTTP 500: overloaded"] * 2 + [
        "error in stream: engine exploded"])  # fmt: skip
    ok = [i for i, e in enumerate(res["errors"]) if not e]
    # usage reports 6 tokens for 3 chunks: the usage count wins over the chunk count
    assert [res["output_lens"][i] for i in ok] == [6] * 7
    assert res["input_lens"] == [8] * 10
    assert (res["total_input_tokens"], res["total_output_tokens"]) == (56, 42)
    assert all(len(res["itls"][i]) == 2 for i in ok)
    ttfts = [res["ttfts"][i] for i in ok]
    # from the request, not from the keep-alive comment; the upper bounds only catch nonsense
    # (a loaded 2-core host delays the fake server's first chunk by seconds at times)
    assert all(TTFT_S * 0.95 <= t < TTFT_S + 10.0 for t in ttfts)
    assert TTFT_S * 0.95 <= res["median_ttft_ms"] / 1000.0 < TTFT_S + 5.0
    assert res["duration"] >= TTFT_S + 2 * ITL_S
    assert res["request_throughput"] == pytest.approx(7 / res["duration"])
    assert res["goodput"] == pytest.approx(res["request_throughput"])
    assert (res["model"], res["endpoint"], res["request_rate"]) == ("fake", "completions", "inf")
    assert (res["num_prompts"], res["max_concurrency"], res["burstiness"]) == (10, None, 1.0)

    assert plot_path.stat().st_size > 10_000
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = result_path.with_suffix(".md").read_text()
    assert "| Successful requests | 7 |" in md and "| Failed requests | 3 |" in md
    assert "engine exploded" in md


def test_chat_without_usage_rate_and_concurrency_cap(tmp_path: Path) -> None:
    result_path = tmp_path / "chat.json"
    with fake_server() as (url, state):
        args = parse([
            "--base-url", url + "/v1/", "--model", "fake", "--endpoint", "chat",
            "--num-prompts", "6", "--request-rate", "200", "--burstiness", "2",
            "--max-concurrency", "2", "--input-len", "5", "--output-len", "4",
            "--save-result", str(result_path), "--slo", "tpot_ms=0.001", "--disable-tqdm",
        ])  # fmt: skip
        assert run_bench_serve(args) == 0
    assert state.max_in_flight <= 2
    res = json.loads(result_path.read_text())
    assert (res["completed"], res["failed"]) == (6, 0)
    assert res["output_lens"] == [4] * 6  # no usage chunk: one token per content chunk
    assert all(len(gaps) == 3 for gaps in res["itls"])
    assert res["goodput"] == 0.0  # every request misses the TPOT objective
    for body in state.bodies:
        (message,) = body["messages"]
        assert message["role"] == "user" and len(message["content"].split()) == 5
        assert body["max_tokens"] == 4 and body["stream"] is True


def test_unreachable_server_reports_every_failure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result_path = tmp_path / "down.json"
    args = parse([
        "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--num-prompts", "3",
        "--input-len", "4", "--output-len", "2", "--save-result", str(result_path),
        "--request-timeout", "5", "--disable-tqdm",
    ])  # fmt: skip
    assert run_bench_serve(args) == 1
    res = json.loads(result_path.read_text())
    assert (res["completed"], res["failed"]) == (0, 3)
    assert all(e.startswith("ConnectError") for e in res["errors"])
    assert res["mean_ttft_ms"] is None
    assert "n/a" in capsys.readouterr().out


def test_bad_arguments_return_2(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--base-url", "http://127.0.0.1:9", "--model", "m"]
    assert run_bench_serve(parse([*base, "--slo", "latency=5"])) == 2
    assert run_bench_serve(parse([*base, "--dataset", "/nonexistent/prompts.txt"])) == 2
    assert run_bench_serve(parse([*base, "--num-prompts", "0"])) == 2
    assert "error" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse([*base, "--request-rate", "0"])


def test_search_max_rate_finds_the_threshold() -> None:
    from foudre.bench.serve import search_max_rate

    def capacity(limit: float) -> Any:
        return lambda rate: 1.0 if rate <= limit else 0.5

    best, tried = search_max_rate(capacity(5.0), start=1.0, target=0.9, steps=6)
    assert best is not None and 4.5 < best <= 5.0
    assert [r for r, _ in tried[:4]] == [1.0, 2.0, 4.0, 8.0]  # doubling, then bisecting
    best, tried = search_max_rate(capacity(0.3), start=1.0, target=0.9, steps=4)
    assert best is not None and 0.25 <= best <= 0.3
    assert [r for r, _ in tried][:3] == [1.0, 0.5, 0.25]  # halving, then bisecting
    assert search_max_rate(capacity(0.0), 1.0, 0.9, 3)[0] is None
    assert search_max_rate(capacity(1e9), 1.0, 0.9, 3, max_doublings=3)[0] == 8.0


def test_find_max_rate_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result_path = tmp_path / "rate.json"
    with fake_server() as (url, _):
        args = parse([
            "--base-url", url, "--model", "fake", "--num-prompts", "4", "--dataset", "random",
            "--input-len", "8", "--output-len", "4", "--request-rate", "50",
            "--slo", "ttft_ms=60000", "--find-max-rate", "--search-steps", "1",
            "--slo-attainment", "0.5", "--save-result", str(result_path), "--disable-tqdm",
        ])  # fmt: skip
        assert run_bench_serve(args) == 0
    assert "Highest request rate with 50% of requests meeting ttft_ms <= 60000" in (
        capsys.readouterr().out
    )
    saved = json.loads(result_path.read_text())
    assert saved["max_rate"] >= 50 and saved["runs"][0]["request_rate"] == 50
    assert all("slo_attainment" in run for run in saved["runs"])
    with fake_server() as (url, _):
        no_slo = parse(["--base-url", url, "--model", "fake", "--find-max-rate"])
        assert run_bench_serve(no_slo) == 2
