"""``foudre bench serve``: an open-loop load generator for any OpenAI-compatible server.

Requests are sent at the times given by ``datasets.arrival_times`` (optionally capped at
``--max-concurrency`` in flight), each one streamed, and timed chunk by chunk::

    sent ──TTFT──▶ chunk 1 ─ITL─▶ chunk 2 ─ITL─▶ … ─ITL─▶ chunk k ──▶ [DONE]
    └──────────────────────────── E2EL ──────────────────────────────────┘

The figures are computed by ``metrics.compute_metrics``; every request, failed or not, appears
in the saved result with its error message.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from foudre.bench.datasets import (
    DEFAULT_RANDOM_VOCAB,
    SampledRequest,
    arrival_times,
    sample_file,
    sample_random,
)
from foudre.bench.metrics import SLO_KEYS, RequestResult, compute_metrics, request_arrays

if TYPE_CHECKING:
    from foudre.loading.tokenizer import Tokenizer

_MAX_ERROR_CHARS = 500


@dataclass(slots=True, frozen=True)
class BenchConfig:
    """Where and how to send the requests of one benchmark run."""

    base_url: str
    model: str
    endpoint: str = "completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    api_key: str | None = None
    request_timeout_s: float = 1800.0
    progress: bool = True

    @property
    def url(self) -> str:
        """The endpoint's URL: ``base_url`` with ``/v1`` appended unless it already ends so."""
        root = self.base_url.rstrip("/")
        if not root.endswith("/v1"):
            root += "/v1"
        return root + ("/chat/completions" if self.endpoint == "chat" else "/completions")


class _RequestError(Exception):
    """A request failed in a way the server told us about (status, error event, no content)."""


# ---------------------------------------------------------------------------------------------
# one request


def build_payload(request: SampledRequest, config: BenchConfig) -> dict[str, Any]:
    """The JSON body for ``request``: streamed, with a usage chunk, ``max_tokens`` equal to the
    asked output length, and ``ignore_eos`` when the request asks for it."""
    payload: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        if not isinstance(request.prompt, str):
            raise ValueError("the chat endpoint needs text prompts, not token ids")
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    if request.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _error_message(body: str) -> str:
    """The message of an error body (OpenAI ``{"error": {"message"}}``, FastAPI ``detail``)."""
    try:
        obj = json.loads(body)
    except ValueError:
        return body.strip()[:_MAX_ERROR_CHARS]
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:_MAX_ERROR_CHARS]
        return str(err)[:_MAX_ERROR_CHARS]
    return str(obj)[:_MAX_ERROR_CHARS]


def _chunk_content(obj: dict[str, Any], endpoint: str) -> str:
    """The generated text carried by one stream chunk ("" for usage-only or role chunks)."""
    choices = obj.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if endpoint == "chat":
        delta = choice.get("delta") or {}
        return str(delta.get("content") or delta.get("reasoning_content") or "")
    return str(choice.get("text") or "")


async def send_request(
    client: httpx.AsyncClient,
    request: SampledRequest,
    config: BenchConfig,
    bench_start: float,
    tokenizer: Tokenizer | None = None,
) -> RequestResult:
    """Send one streamed request and time it. Never raises (except on cancellation): any
    failure, from a refused connection to an error event mid-stream, comes back as a result
    with ``success`` false and a non-empty ``error``.

    Output tokens are the server's ``usage.completion_tokens`` when it sends a usage chunk, else
    the re-tokenized length of the text when a tokenizer is given, else the number of content
    chunks. Input tokens are ``usage.prompt_tokens`` when given, else the request's own count.
    """
    result = RequestResult(input_len=request.input_len)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    sent = time.perf_counter()
    result.start = sent - bench_start
    last = sent
    pieces: list[str] = []
    usage: dict[str, Any] = {}
    try:
        payload = build_payload(request, config)
        async with client.stream("POST", config.url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                raise _RequestError(f"HTTP {response.status_code}: {_error_message(body)}")
            async for line in response.aiter_lines():
                now = time.perf_counter()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments and keep-alives
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if not isinstance(obj, dict):
                    raise _RequestError(f"unexpected stream chunk: {data[:_MAX_ERROR_CHARS]}")
                if obj.get("error"):
                    raise _RequestError(f"error in stream: {_error_message(data)}")
                if obj.get("usage"):
                    usage = obj["usage"]
                content = _chunk_content(obj, config.endpoint)
                if content:
                    if not pieces:
                        result.ttft = now - sent
                    else:
                        result.itls.append(now - last)
                    last = now
                    pieces.append(content)
        result.latency = time.perf_counter() - sent
        if not pieces:
            raise _RequestError("the stream ended without any generated text")
        if isinstance(usage.get("completion_tokens"), int):
            result.output_len = usage["completion_tokens"]
        elif tokenizer is not None:
            result.output_len = len(tokenizer.encode("".join(pieces), add_special_tokens=False))
        else:
            result.output_len = len(pieces)
        if isinstance(usage.get("prompt_tokens"), int):
            result.input_len = usage["prompt_tokens"]
        result.success = True
    except _RequestError as exc:
        result.error = str(exc)
    except json.JSONDecodeError as exc:
        result.error = f"malformed stream chunk: {exc}"
    except Exception as exc:  # connection errors, timeouts, protocol errors: report, never drop
        result.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    if not result.success:
        result.latency = time.perf_counter() - sent
        result.error = result.error or "unknown error"
    return result


# ---------------------------------------------------------------------------------------------
# the load generator


async def run_benchmark(
    requests: Sequence[SampledRequest],
    config: BenchConfig,
    tokenizer: Tokenizer | None = None,
) -> tuple[list[RequestResult], float]:
    """Send ``requests`` at their arrival times and wait for all of them.

    Returns one result per request, in the order of ``requests``, and the duration in seconds
    from the first send to the last completion. No more than ``config.max_concurrency``
    requests are in flight at once (when set); a request's clock starts when it is actually
    sent, so queueing behind that cap is not counted in its latency.
    """
    from tqdm import tqdm

    arrivals = arrival_times(len(requests), config.request_rate, config.burstiness, config.seed)
    cap = config.max_concurrency
    semaphore = asyncio.Semaphore(cap) if cap else None
    bar = tqdm(total=len(requests), file=sys.stderr, disable=not config.progress, unit="req")
    failed = 0
    timeout = httpx.Timeout(config.request_timeout_s, connect=30.0, pool=None)
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap or len(requests))

    # trust_env=False: measure the server, never a proxy picked up from the environment
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:

        async def one(request: SampledRequest) -> RequestResult:
            nonlocal failed
            if semaphore is None:
                result = await send_request(client, request, config, start, tokenizer)
            else:
                async with semaphore:
                    result = await send_request(client, request, config, start, tokenizer)
            if not result.success:
                failed += 1
                bar.set_postfix(failed=failed, refresh=False)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        try:
            for request, at in zip(requests, arrivals):
                delay = at - (time.perf_counter() - start)
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(request)))
            results = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
            bar.close()
        duration = time.perf_counter() - start
    return results, duration


# ---------------------------------------------------------------------------------------------
# reporting

_LATENCY_SECTIONS = (
    ("ttft", "TTFT", "Time to First Token"),
    ("tpot", "TPOT", "Time per Output Token (excl. 1st token)"),
    ("itl", "ITL", "Inter-token Latency"),
    ("e2el", "E2EL", "End-to-end Latency"),
)


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


_SPEC_COUNTERS = {
    "spec_num_drafts": "foudre:spec_decode_num_drafts_total",
    "spec_draft_tokens": "foudre:spec_decode_num_draft_tokens_total",
    "spec_accepted_tokens": "foudre:spec_decode_num_accepted_tokens_total",
}


def scrape_spec_counters(base_url: str) -> dict[str, float] | None:
    """The server's speculative-decoding counters from its Prometheus ``/metrics`` (a foudre
    server); None when the server does not expose them."""
    root = base_url.rstrip("/").removesuffix("/v1")
    try:
        text = httpx.get(root + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    values: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        for key, metric in _SPEC_COUNTERS.items():
            if name == metric:
                values[key] = float(value)
    return values if len(values) == len(_SPEC_COUNTERS) else None


def spec_figures(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Draft tokens, accepted tokens, acceptance rate and mean acceptance length of a run."""
    d = {k: after[k] - before[k] for k in _SPEC_COUNTERS}
    drafts, proposed, accepted = (
        d["spec_num_drafts"],
        d["spec_draft_tokens"],
        d["spec_accepted_tokens"],
    )
    return {
        "spec_draft_tokens": proposed,
        "spec_accepted_tokens": accepted,
        "spec_acceptance_rate": accepted / proposed if proposed else 0.0,
        "spec_mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
    }


def _summary_rows(metrics: dict[str, Any]) -> list[tuple[str, str] | str]:
    """The summary as (label, value) rows, with section titles as plain strings."""
    rows: list[tuple[str, str] | str] = [
        ("Successful requests", str(metrics["completed"])),
        ("Failed requests", str(metrics["failed"])),
        ("Benchmark duration (s)", f"{metrics['duration']:.2f}"),
        ("Total input tokens", str(metrics["total_input_tokens"])),
        ("Total generated tokens", str(metrics["total_output_tokens"])),
        ("Request throughput (req/s)", f"{metrics['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{metrics['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{metrics['total_token_throughput']:.2f}"),
    ]
    if "goodput" in metrics:
        rows.append(("Request goodput (req/s)", f"{metrics['goodput']:.2f}"))
    for key, short, long in _LATENCY_SECTIONS:
        rows.append(long)
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            rows.append((f"{label} {short} (ms)", _fmt(metrics[f"{stat}_{key}_ms"])))
    if metrics.get("spec_draft_tokens"):
        rows.append("Speculative decoding (server counters)")
        rows.append(("Draft tokens", f"{metrics['spec_draft_tokens']:.0f}"))
        rows.append(("Accepted tokens", f"{metrics['spec_accepted_tokens']:.0f}"))
        rows.append(("Acceptance rate", f"{metrics['spec_acceptance_rate']:.3f}"))
        rows.append(("Mean acceptance length", f"{metrics['spec_mean_acceptance_length']:.2f}"))
    return rows


def _error_counts(errors: Sequence[str]) -> list[tuple[str, int]]:
    counts: dict[str, int] = {}
    for e in errors:
        if e:
            counts[e] = counts.get(e, 0) + 1
    return sorted(counts.items(), key=lambda kv: -kv[1])


def format_summary(metrics: dict[str, Any], errors: Sequence[str] = ()) -> str:
    """The plain-text result block, in the layout of vLLM's ``benchmark_serving``, followed by
    the distinct error messages (most frequent first) when some requests failed."""
    lines = ["{s:{c}^50}".format(s=" Serving Benchmark Result ", c="=")]
    for row in _summary_rows(metrics):
        if isinstance(row, str):
            lines.append("{s:{c}^50}".format(s=row, c="-"))
        else:
            lines.append(f"{row[0] + ':':<40}{row[1]}")
    lines.append("=" * 50)
    for message, count in _error_counts(errors)[:10]:
        lines.append(f"error ({count}x): {message}")
    return "\n".join(lines)


def format_markdown(metrics: dict[str, Any], meta: dict[str, Any], errors: Sequence[str]) -> str:
    """The summary as a markdown document: a header naming the run and one table."""
    rate = meta["request_rate"]
    lines = [
        f"# Serving benchmark: {meta['model']}",
        "",
        f"`{meta['base_url']}` · endpoint `{meta['endpoint']}` · {meta['num_prompts']} prompts · "
        f"rate {rate} req/s · burstiness {meta['burstiness']} · "
        f"max concurrency {meta['max_concurrency'] or 'unlimited'} · {meta['date']}",
        "",
        "| Metric | Value |",
        "| --- | ---: |",
    ]
    for row in _summary_rows(metrics):
        lines.append(f"| **{row}** | |" if isinstance(row, str) else f"| {row[0]} | {row[1]} |")
    counts = _error_counts(errors)
    if counts:
        lines += ["", "## Errors", "", "| Count | Message |", "| ---: | --- |"]
        lines += [f"| {n} | {_md_escape(m)} |" for m, n in counts]
    return "\n".join(lines) + "\n"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---------------------------------------------------------------------------------------------
# CLI


def parse_rate(text: str) -> float:
    """An argparse type for request rates: a positive number or ``inf``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or 'inf': {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def parse_slos(items: Sequence[str] | None) -> dict[str, float]:
    """``["ttft_ms=150", "tpot_ms=50"]`` -> ``{"ttft_ms": 150.0, "tpot_ms": 50.0}``.

    Raises ``ValueError`` for an unknown key, a malformed item or a non-positive bound."""
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ValueError(
                f"bad --slo {item!r}; expected KEY=MS with KEY in {', '.join(SLO_KEYS)}"
            )
        try:
            bound = float(value)
        except ValueError:
            raise ValueError(f"bad --slo {item!r}: {value!r} is not a number") from None
        if not bound > 0:
            raise ValueError(f"bad --slo {item!r}: the bound must be positive")
        slos[key] = bound
    return slos


def _add_target_args(p: argparse.ArgumentParser) -> None:
    """The server and the model asked."""
    p.add_argument(
        "--base-url",
        required=True,
        help="server root, e.g. http://127.0.0.1:8000 (/v1 is appended if missing)",
    )
    p.add_argument("--model", required=True, help="model name sent in each request")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """The requests: how many, how fast, of what lengths, from which prompts."""
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument(
        "--request-rate",
        type=parse_rate,
        default=math.inf,
        help="requests per second, or inf to send all at once (default)",
    )
    p.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="gamma shape of inter-arrival times: 1 = Poisson, <1 burstier, >1 more regular",
    )
    p.add_argument(
        "--max-concurrency", type=int, default=None, help="at most this many requests in flight"
    )
    p.add_argument(
        "--dataset",
        default="random",
        help="'random', or a prompt file (text split on blank lines or "
        "<|endoftext|>, or JSONL with prompt and output_len)",
    )
    p.add_argument("--input-len", type=int, default=256, help="random prompt length (tokens)")
    p.add_argument("--output-len", type=int, default=128, help="output length (tokens)")
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="draw lengths uniformly in [L*(1-X), L*(1+X)]",
    )
    p.add_argument(
        "--random-vocab-size",
        type=int,
        default=DEFAULT_RANDOM_VOCAB,
        help="without --tokenizer, random token ids are drawn below this",
    )
    p.add_argument("--seed", type=int, default=0)


def _add_output_args(p: argparse.ArgumentParser) -> None:
    """Where the result goes."""
    p.add_argument(
        "--save-result",
        default=None,
        metavar="FILE.json",
        help="write the result as JSON, and a markdown summary beside it (.md)",
    )
    p.add_argument("--plot", default=None, metavar="FILE.png", help="write a summary figure")


def _add_slo_args(p: argparse.ArgumentParser) -> None:
    """Service-level objectives, goodput and the search of the highest rate meeting them."""
    p.add_argument(
        "--slo",
        action="append",
        default=None,
        metavar="KEY=MS",
        help="service-level objective for goodput (ttft_ms, tpot_ms, e2el_ms); repeatable",
    )
    p.add_argument(
        "--find-max-rate",
        action="store_true",
        help="with --slo: search the highest request rate at which --slo-attainment of the "
        "requests meet every SLO (doubling from --request-rate, then bisecting)",
    )
    p.add_argument(
        "--slo-attainment",
        type=float,
        default=0.9,
        help="fraction of requests that must meet the SLOs (default: 0.9)",
    )
    p.add_argument("--search-steps", type=int, default=4, help="bisection steps of --find-max-rate")


def _add_client_args(p: argparse.ArgumentParser) -> None:
    """How the client talks to the server and counts tokens."""
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer (file or model directory) to make text prompts and count "
        "tokens when the server sends no usage",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=1800.0,
        help="seconds to wait for any byte of a response before failing it",
    )
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_bench_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add the flags of ``foudre bench serve`` to ``parser``."""
    _add_target_args(parser)
    _add_workload_args(parser)
    _add_output_args(parser)
    _add_slo_args(parser)
    _add_client_args(parser)


def _build_requests(args: argparse.Namespace, tokenizer: Tokenizer | None) -> list[SampledRequest]:
    if args.dataset == "random":
        return sample_random(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.seed,
            tokenizer=tokenizer,
            as_text=args.endpoint == "chat",
            vocab_size=args.random_vocab_size,
        )
    requests = sample_file(
        args.dataset,
        args.num_prompts,
        args.output_len,
        args.range_ratio,
        args.seed,
        tokenizer=tokenizer,
    )
    if args.endpoint == "chat" and any(not isinstance(r.prompt, str) for r in requests):
        if tokenizer is None:
            raise ValueError("token-id prompts need --tokenizer to be sent to the chat endpoint")
        requests = [
            SampledRequest(tokenizer.decode(r.prompt), r.input_len, r.output_len)
            if not isinstance(r.prompt, str)
            else r
            for r in requests
        ]
    return requests


def search_max_rate(
    attainment_at: Callable[[float], float],
    start: float,
    target: float,
    steps: int,
    max_doublings: int = 10,
) -> tuple[float | None, list[tuple[float, float]]]:
    """The highest request rate whose SLO attainment (``attainment_at(rate)``) reaches
    ``target``: double from ``start`` until it fails, then bisect ``steps`` times between the
    last rate that passed and the first that failed. Returns that rate (None when even
    ``start`` fails, after halving it ``steps`` times) and every (rate, attainment) tried."""
    tried: list[tuple[float, float]] = []

    def ok(rate: float) -> bool:
        value = attainment_at(rate)
        tried.append((rate, value))
        return value >= target

    good: float | None = None
    bad: float | None = None
    rate = start
    if ok(rate):
        good = rate
        for _ in range(max_doublings):
            rate *= 2
            if not ok(rate):
                bad = rate
                break
            good = rate
        else:
            return good, tried  # never failed: the search's ceiling
    else:
        bad = rate
        for _ in range(steps):
            rate /= 2
            if ok(rate):
                good = rate
                break
            bad = rate
        if good is None:
            return None, tried
    for _ in range(steps):
        mid = (good + bad) / 2
        if ok(mid):
            good = mid
        else:
            bad = mid
    return good, tried


def _find_max_rate(
    args: argparse.Namespace,
    requests: list[SampledRequest],
    config: BenchConfig,
    tokenizer: Tokenizer | None,
    slos: dict[str, float],
) -> int:
    if not slos:
        print(
            "foudre bench serve: error: --find-max-rate needs at least one --slo", file=sys.stderr
        )
        return 2
    if not 0 < args.slo_attainment <= 1:
        print("foudre bench serve: error: --slo-attainment must be in (0, 1]", file=sys.stderr)
        return 2
    start = config.request_rate if math.isfinite(config.request_rate) else 1.0
    runs: list[dict[str, Any]] = []

    def attainment_at(rate: float) -> float:
        cfg = dataclasses.replace(config, request_rate=rate, progress=False)
        results, duration = asyncio.run(run_benchmark(requests, cfg, tokenizer))
        metrics = compute_metrics(results, duration, slos)
        runs.append({"request_rate": rate, **metrics})
        print(
            f"rate {rate:8.3f} req/s: {metrics['slo_attainment']:.1%} meet the SLOs, goodput "
            f"{metrics['goodput']:.2f} req/s, p90 TTFT {_fmt(metrics['p90_ttft_ms'])} ms, "
            f"p90 TPOT {_fmt(metrics['p90_tpot_ms'])} ms",
            file=sys.stderr,
            flush=True,
        )
        return float(metrics["slo_attainment"])

    best, _ = search_max_rate(attainment_at, start, args.slo_attainment, args.search_steps)
    slo_text = ", ".join(f"{k} <= {v:g}" for k, v in slos.items())
    found = "none" if best is None else f"{best:.3f} req/s"
    print(
        f"Highest request rate with {args.slo_attainment:.0%} of requests meeting "
        f"{slo_text}: {found}"
    )
    if args.save_result:
        path = Path(args.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        summary = {"slos": slos, "slo_attainment": args.slo_attainment, "max_rate": best}
        path.write_text(json.dumps({**summary, "runs": runs}, indent=2) + "\n")
    return 0 if best is not None else 1


def _check_args(args: argparse.Namespace) -> dict[str, float]:
    """The SLOs of ``--slo``, once the flags are checked (``ValueError`` names the first bad)."""
    slos = parse_slos(args.slo)
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ValueError(f"--burstiness must be a positive number, got {args.burstiness}")
    return slos


def _bench_config(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        api_key=args.api_key,
        request_timeout_s=args.request_timeout,
        progress=not args.disable_tqdm,
    )


def _run_meta(
    args: argparse.Namespace, config: BenchConfig, slos: dict[str, float]
) -> dict[str, Any]:
    """What a result records of the run besides its metrics."""
    return {
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "base_url": args.base_url,
        "model": args.model,
        "endpoint": args.endpoint,
        "request_rate": "inf" if math.isinf(config.request_rate) else config.request_rate,
        "burstiness": config.burstiness,
        "max_concurrency": config.max_concurrency,
        "num_prompts": args.num_prompts,
        "dataset": args.dataset,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "seed": args.seed,
        "tokenizer": args.tokenizer,
        "slos": slos,
    }


def _write_outputs(
    args: argparse.Namespace,
    config: BenchConfig,
    meta: dict[str, Any],
    results: Sequence[RequestResult],
    metrics: dict[str, Any],
    arrays: dict[str, Any],
) -> None:
    """The JSON result and its markdown summary (``--save-result``), the figure (``--plot``)."""
    if args.save_result:
        path = Path(args.save_result)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**meta, **metrics, **arrays}, indent=2) + "\n")
        path.with_suffix(".md").write_text(format_markdown(metrics, meta, arrays["errors"]))
    if args.plot:
        from foudre.bench.plots import plot_benchmark

        title = (
            f"{args.model} · {args.endpoint} · rate {meta['request_rate']} req/s · "
            f"burstiness {config.burstiness} · concurrency {config.max_concurrency or '∞'}"
        )
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        plot_benchmark(results, metrics, args.plot, title=title, slos=meta["slos"])


def run_bench_serve(args: argparse.Namespace) -> int:
    """Run ``foudre bench serve`` with parsed ``args`` (see ``add_bench_serve_args``).

    Prints the summary block to stdout (progress to stderr) and writes the optional JSON,
    markdown and PNG outputs. Returns 0 when at least one request succeeded, 1 when none did,
    2 for invalid arguments or inputs (reported on stderr).
    """
    try:
        slos = _check_args(args)
        tokenizer = None
        if args.tokenizer:
            from foudre.loading.loader import load_tokenizer

            tokenizer = load_tokenizer(args.tokenizer)
        requests = _build_requests(args, tokenizer)
    except (ValueError, OSError) as exc:
        print(f"foudre bench serve: error: {exc}", file=sys.stderr)
        return 2

    config = _bench_config(args)
    print(
        f"Benchmarking {config.url} ({args.model}): {len(requests)} prompts, "
        f"rate {config.request_rate} req/s, burstiness {config.burstiness}, "
        f"max concurrency {config.max_concurrency or 'unlimited'}",
        file=sys.stderr,
    )
    if args.find_max_rate:
        return _find_max_rate(args, requests, config, tokenizer, slos)
    spec_before = scrape_spec_counters(args.base_url)
    results, duration = asyncio.run(run_benchmark(requests, config, tokenizer))
    metrics = compute_metrics(results, duration, slos)
    spec_after = scrape_spec_counters(args.base_url) if spec_before is not None else None
    if spec_before is not None and spec_after is not None:
        metrics.update(spec_figures(spec_before, spec_after))
    arrays = request_arrays(results)
    print(format_summary(metrics, arrays["errors"]))
    _write_outputs(args, config, _run_meta(args, config, slos), results, metrics, arrays)
    return 0 if metrics["completed"] else 1
