"""Soak test: many concurrent clients against ``foudre serve`` for a while, mixed traffic.

    .venv/bin/python benchmarks/soak.py --minutes 10 --concurrency 128 \\
        --out benchmarks/results/soak-YYYY-MM-DD.md

Starts ``foudre serve`` (stories260K from ../shared by default, or ``--model``/``--tokenizer``,
or ``--embedded`` for the packaged default model) on a free loopback port. Each of the
``--concurrency`` clients loops until the time is up, sending completions and chat requests,
streamed or not, with random ``n`` (1-3), stop strings, logprobs, seeds and temperatures, and
disconnecting from 10% of its streams after a few chunks. A request is an error when it gets a
status other than 200, an error event, a stream without ``[DONE]`` or a transport failure
(deliberate disconnects are counted apart). After the run, once the server is idle, the KV
blocks still held are the leaked ones (``foudre:kv_cache_blocks_used``). Prints and writes:
requests by kind, errors, p50/p99 TTFT of streamed requests, leaked blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import re
import selectors
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from common import machine

REPO = Path(__file__).resolve().parent.parent
STORIES = REPO.parent / "shared" / "models" / "stories260K"
PROMPTS = [
    "Once upon a time",
    "The little dog",
    "Lily and Tom went to the park. They",
    "One day, a big red ball",
    "The sun was shining and the birds",
]


def start_server(extra: list[str], timeout: float = 120.0) -> tuple[subprocess.Popen[str], str]:
    """``foudre serve`` on a free loopback port with ``extra`` flags: the process and its URL."""
    cmd = [sys.executable, "-m", "foudre.cli", "serve", "--host", "127.0.0.1", "--port", "0",
           "--max-queue", "4096", *extra]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if line.startswith("foudre: serving"):
                return proc, line.split(" at ", 1)[1].split(" ", 1)[0]
    proc.kill()
    raise SystemExit(f"foudre serve {' '.join(extra)} did not start (rc={proc.poll()})")


def blocks_used(url: str) -> tuple[int, int]:
    text = httpx.get(url + "/metrics", timeout=10).text

    def gauge(name: str) -> float:
        m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", text, re.M)
        return float(m.group(1)) if m else float("nan")

    return int(gauge("foudre:kv_cache_blocks_used")), int(gauge("foudre:num_requests_running"))


class Tally:
    def __init__(self) -> None:
        self.kinds: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.disconnects = 0
        self.ttfts: list[float] = []


def request_body(rng: random.Random, chat: bool, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {
        "max_tokens": rng.randint(8, 96),
        "n": rng.choice([1, 1, 1, 2, 3]),
        "stream": stream,
        "temperature": rng.choice([0.0, 0.8]),
        "seed": rng.randrange(1 << 30),
    }
    if rng.random() < 0.3:
        body["stop"] = rng.choice([["."], [" the", "!"], ["\n"]])
    if rng.random() < 0.3:
        body["ignore_eos"] = True
    prompt = rng.choice(PROMPTS)
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
        if rng.random() < 0.3:
            body["logprobs"], body["top_logprobs"] = True, rng.randint(0, 3)
    else:
        body["prompt"] = prompt
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 3)
        if stream and rng.random() < 0.3:
            body["stream_options"] = {"include_usage": True}
    return body


async def one(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    chat, stream = rng.random() < 0.5, rng.random() < 0.6
    kind = f"{'chat' if chat else 'completions'}{' stream' if stream else ''}"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = request_body(rng, chat, stream)
    tally.kinds[kind] += 1
    try:
        if not stream:
            r = await client.post(path, json=body)
            if r.status_code != 200:
                tally.errors[f"HTTP {r.status_code}: {r.text[:120]}"] += 1
            return
        leave_after = rng.randint(1, 4) if rng.random() < 0.1 else None
        t0 = time.perf_counter()
        chunks, done = 0, False
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                await resp.aread()
                tally.errors[f"HTTP {resp.status_code}: {resp.text[:120]}"] += 1
                return
            async for line in resp.aiter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    obj = json.loads(line[6:])
                    if "error" in obj:
                        tally.errors[f"error event: {obj['error']['message'][:120]}"] += 1
                        return
                    if chunks == 0:
                        tally.ttfts.append(time.perf_counter() - t0)
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        tally.disconnects += 1
                        return  # closing the stream disconnects
        if not done:
            tally.errors["stream ended without [DONE]"] += 1
    except httpx.HTTPError as e:
        where = "stream" if stream else "request"
        tally.errors[f"{type(e).__name__} ({where}): {e!r}"[:160]] += 1


async def soak(url: str, seconds: float, concurrency: int, seed: int) -> Tally:
    tally = Tally()
    deadline = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=concurrency + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:

        async def worker(i: int) -> None:
            rng = random.Random(seed * 100_003 + i)
            while time.monotonic() < deadline:
                await one(client, rng, tally)

        await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return tally


def pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] * 1e3 if len(values) > 1 else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--minutes", type=float, default=1.0)
    ap.add_argument("--concurrency", type=int, default=128)
    ap.add_argument("--model", default=None)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--embedded", action="store_true", help="the packaged default model")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    extra: list[str] = []
    if not args.embedded:
        extra += ["--model", args.model or str(STORIES / "stories260K.bin")]
        tok = args.tokenizer or (None if args.model else str(STORIES / "tok512.bin"))
        extra += ["--tokenizer", tok] if tok else []
    proc, url = start_server(["--max-num-seqs", "128", *extra])
    try:
        t0 = time.monotonic()
        tally = asyncio.run(soak(url, args.minutes * 60, args.concurrency, args.seed))
        wall = time.monotonic() - t0
        deadline = time.monotonic() + 30
        used, running = blocks_used(url)
        while (used or running) and time.monotonic() < deadline:
            time.sleep(0.2)
            used, running = blocks_used(url)
        health = httpx.get(url + "/health", timeout=10).status_code
    finally:
        proc.terminate()
        rc = proc.wait(30)
    total = sum(tally.kinds.values())
    errors = sum(tally.errors.values())
    lines = [
        f"# Soak: {args.concurrency} concurrent clients for {args.minutes:g} min",
        "",
        f"- date: {datetime.date.today().isoformat()}; machine: {machine()}",
        f"- command: `{' '.join(['benchmarks/soak.py', *sys.argv[1:]])}`",
        f"- server: `foudre serve {' '.join(extra)}` (exit status {rc} after SIGTERM)",
        "",
        "| requests | errors | client disconnects | p50 TTFT ms | p99 TTFT ms | leaked blocks "
        "| requests still running | /health after |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {total} ({total / wall:.1f}/s) | {errors} | {tally.disconnects} | "
        f"{pct(tally.ttfts, 50):.0f} | {pct(tally.ttfts, 99):.0f} | {used} | {running} "
        f"| {health} |",
        "",
        "Requests by kind: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.kinds.items())),
    ]
    if tally.errors:
        lines += ["", "Errors:", *(f"- {n}x {m}" for m, n in tally.errors.most_common(10))]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    if errors or used or running:
        sys.exit(1)


if __name__ == "__main__":
    main()
