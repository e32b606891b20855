"""In-process benchmarks: a timed replay driver, ``foudre bench throughput`` and ``latency``.

``replay`` drives an ``LLMEngine`` directly, as a server's engine loop would, but without HTTP:
each request enters the engine when its arrival time comes, and is timed from that moment::

    scheduled arrival ──(queue)──▶ first token ─ITL─▶ token 2 ─ITL─▶ … ─▶ last token
    └──────────── TTFT ────────────┘
    └──────────────────────────────── E2EL ───────────────────────────────────┘

The per-request traces are ``metrics.RequestResult``s, so the figures come from the same
``metrics.compute_metrics`` as ``foudre bench serve``.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from foudre.bench.metrics import RequestResult, compute_metrics

if TYPE_CHECKING:
    from foudre.engine.engine import LLMEngine
    from foudre.engine.llm import LLM

IDLE_SLEEP_S = 0.001
"""How long the driver sleeps when requests are queued but the engine scheduled nothing (a
batching policy waiting for a fuller batch)."""


@dataclass(slots=True)
class WorkItem:
    """One request of a replayed workload.

    It arrives ``arrival`` seconds after the start, and not before the run has produced
    ``after_tokens`` output tokens in all (0: no such condition); its clock starts at the later of
    the two. ``tag`` groups requests for reporting (e.g. "short" and "long").
    """

    prompt: str | list[int]
    output_len: int
    arrival: float = 0.0
    after_tokens: int = 0
    tag: str = ""
    ignore_eos: bool = True


@dataclass(slots=True)
class ReplayResult:
    """What ``replay`` measured. ``results`` and ``arrivals`` follow the workload's order; times
    are seconds from the start of the run. ``duration`` runs from the start to the last token.

    ``peak_rss_bytes`` is the process's peak resident memory so far (``peak_rss_bytes``), which
    only ``reset_peak_rss`` lowers: it bounds this run's peak from above.
    """

    results: list[RequestResult]
    arrivals: list[float]
    tags: list[str]
    duration: float
    num_steps: int
    peak_kv_usage: float
    num_preemptions: int
    max_running: int
    prefix_cache_hits: int
    prefix_cache_queries: int
    peak_rss_bytes: int
    step_times: list[float] = field(default_factory=list)

    def select(self, tag: str) -> list[RequestResult]:
        """The results of the requests tagged ``tag``."""
        return [r for r, t in zip(self.results, self.tags, strict=True) if t == tag]


def peak_rss_bytes() -> int:
    """The peak resident set size of this process so far (since ``reset_peak_rss``), in bytes:
    Linux's ``VmHWM``, else ``getrusage``'s."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def reset_peak_rss() -> bool:
    """Set ``peak_rss_bytes`` to what the process holds now (Linux: ``clear_refs``), so that
    memory held a while and freed (a bandwidth probe's matrix) leaves no peak; whether it could
    (elsewhere the peak keeps counting it)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


class _Replay:
    """The driver's state over one ``replay``: the requests still pending, and what each of the
    workload's requests got (lists in the workload's order)."""

    def __init__(self, engine: LLMEngine, workload: Sequence[WorkItem], temperature: float):
        self.engine = engine
        self.workload = workload
        self.temperature = temperature
        n = len(workload)
        self.pending = sorted(range(n), key=lambda i: workload[i].arrival)
        self.ids = [f"replay-{id(workload)}-{i}" for i in range(n)]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.arrivals = [math.nan] * n
        self.chunk_times: list[list[float]] = [[] for _ in range(n)]
        self.num_tokens = [0] * n
        self.input_lens = [len(w.prompt) if not isinstance(w.prompt, str) else 0 for w in workload]
        self.released: set[int] = set()  # requests whose after_tokens condition was dropped
        self.finished = [False] * n
        self.triggered: dict[int, float] = {}  # after_tokens threshold -> time first reached
        self.produced = 0
        self.max_running = 0
        self.peak_kv = 0.0  # after each step; the engine's own peak (mid-step) is used when it rose
        self.step_times: list[float] = []
        self.base = engine.metrics()
        self.added: list[str] = []
        self.start = time.monotonic()

    def admit(self, now: float) -> None:
        """Add every pending request due at ``now``: its arrival time passed, and its
        ``after_tokens`` condition met (its clock then starts no earlier) or dropped."""
        from foudre.sampling_params import SamplingParams

        still: list[int] = []
        for i in self.pending:
            item = self.workload[i]
            due = self.start + item.arrival
            if item.after_tokens > 0 and i not in self.released:
                if self.produced < item.after_tokens:
                    still.append(i)
                    continue
                due = max(due, self.triggered.setdefault(item.after_tokens, now))
            if due > now:
                still.append(i)
                continue
            params = SamplingParams(
                temperature=self.temperature,
                max_tokens=item.output_len,
                ignore_eos=item.ignore_eos,
                seed=i if self.temperature > 0 else None,
            )
            self.engine.add_request(item.prompt, params, request_id=self.ids[i], arrival_time=due)
            self.added.append(self.ids[i])
            self.arrivals[i] = due - self.start
        self.pending = still

    def held_by_tokens_only(self) -> bool:
        """Whether every pending request waits for the run's own tokens (none for a time)."""
        return all(
            self.workload[i].after_tokens > 0 and i not in self.released for i in self.pending
        )

    def step(self) -> None:
        """One engine step, timed, with its batch's figures and its outputs' tokens recorded."""
        engine = self.engine
        t0 = time.perf_counter()
        outputs = engine.step()
        self.step_times.append(time.perf_counter() - t0)
        # the batch of this step (including requests it finished) and what still runs
        figs = engine.metrics()
        running_now = max(int(figs["num_scheduled_last_step"]), int(figs["num_running"]))
        self.max_running = max(self.max_running, running_now)
        self.peak_kv = max(self.peak_kv, float(figs["kv_cache_usage"]))
        for out in outputs:
            i = self.index[out.request_id]
            comp = out.outputs[0]
            if comp.delta_token_ids:
                stamp = out.metrics.last_token_time if out.metrics else None
                self.chunk_times[i].append(stamp if stamp is not None else time.monotonic())
                self.produced += len(comp.delta_token_ids)
            self.num_tokens[i] = len(comp.token_ids)
            self.input_lens[i] = len(out.prompt_token_ids)
            if out.finished:
                self.finished[i] = comp.finish_reason != "abort"
        if engine.stalled and not outputs:
            time.sleep(IDLE_SLEEP_S)

    def request_results(self) -> list[RequestResult]:
        """Each request's trace, timed from its scheduled arrival; unfinished ones failed."""
        results = []
        for i in range(len(self.workload)):
            r = RequestResult(input_len=self.input_lens[i])
            r.start = self.arrivals[i]
            times = self.chunk_times[i]
            if self.finished[i] and times:
                sched = self.start + self.arrivals[i]
                r.ttft = times[0] - sched
                r.itls = np.diff(times).tolist()
                r.latency = times[-1] - sched
                r.output_len = self.num_tokens[i]
                r.success = True
            else:
                r.error = "did not finish"
            results.append(r)
        return results

    def result(self) -> ReplayResult:
        """The run's ``ReplayResult``: the engine's counters as their change over the run."""
        end = max((t[-1] for t in self.chunk_times if t), default=time.monotonic())
        results = self.request_results()
        metrics, base = self.engine.metrics(), self.base
        return ReplayResult(
            results=results,
            arrivals=self.arrivals,
            tags=[w.tag for w in self.workload],
            duration=max(end - self.start, 1e-9),
            num_steps=len(self.step_times),
            peak_kv_usage=(
                float(metrics["peak_kv_cache_usage"])
                if metrics["peak_kv_cache_usage"] > base["peak_kv_cache_usage"]
                else self.peak_kv
            ),
            num_preemptions=int(metrics["num_preemptions"]) - int(base["num_preemptions"]),
            max_running=self.max_running,
            prefix_cache_hits=int(metrics["prefix_cache_hits"]) - int(base["prefix_cache_hits"]),
            prefix_cache_queries=int(metrics["prefix_cache_queries"])
            - int(base["prefix_cache_queries"]),
            peak_rss_bytes=peak_rss_bytes(),
            step_times=self.step_times,
        )


def replay(
    engine: LLMEngine, workload: Sequence[WorkItem], *, temperature: float = 0.0
) -> ReplayResult:
    """Run ``workload`` through ``engine`` in real time and time every request.

    Guarantees: a request is added no earlier than its arrival time (and its ``after_tokens``
    condition), with that scheduled time as its ``arrival_time``, so time spent queued (behind
    the driver's current step or in the engine's waiting queue) counts in its TTFT and E2EL; every
    token's time is the engine's own timestamp of that step. The engine must be idle on entry
    and is idle on return; when the driver raises, every request it added is aborted. Once every
    timed request has been added, the engine's batching policy is told that no more will come
    (as ``LLM.generate`` does), so a static batch that can never fill still runs.
    """
    if engine.has_unfinished_requests():
        raise ValueError("replay needs an idle engine")
    run = _Replay(engine, workload, temperature)
    try:
        while run.pending or engine.has_unfinished_requests():
            run.admit(time.monotonic())
            if run.held_by_tokens_only():
                # only the run's own tokens can bring more requests: batches must not wait
                engine.set_draining(True)
            if not engine.has_unfinished_requests():
                run.released |= _wait_for_next(run.pending, workload, run.start, run.released)
                continue
            run.step()
    except BaseException:
        for rid in run.added:
            engine.abort_request(rid)
        raise
    finally:
        engine.set_draining(False)
    return run.result()


def _wait_for_next(
    pending: Sequence[int], workload: Sequence[WorkItem], start: float, released: set[int]
) -> set[int]:
    """With the engine idle: sleep until the next timed arrival among requests not held by an
    ``after_tokens`` condition. When only such held requests remain, no token can come anymore,
    so return them to be released (they then arrive at their time, ignoring the condition)."""
    timed = [i for i in pending if workload[i].after_tokens == 0 or i in released]
    if not timed:
        return set(pending)
    delay = min(start + workload[i].arrival for i in timed) - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    return set()


def replay_summary(
    rep: ReplayResult, results: Sequence[RequestResult] | None = None
) -> dict[str, Any]:
    """``compute_metrics`` of the run (or of a subset of its ``results``) plus the engine-side
    figures: steps, peak KV usage, preemptions, max running requests, prefix-cache hits, peak
    RSS."""
    out = compute_metrics(rep.results if results is None else results, rep.duration)
    out.update(
        num_steps=rep.num_steps,
        peak_kv_cache_usage=rep.peak_kv_usage,
        num_preemptions=rep.num_preemptions,
        max_running=rep.max_running,
        prefix_cache_hits=rep.prefix_cache_hits,
        prefix_cache_queries=rep.prefix_cache_queries,
        peak_rss_mib=rep.peak_rss_bytes / (1 << 20),
    )
    return out


# ---------------------------------------------------------------------------------------------
# shared CLI pieces


def random_prompts(
    n: int, input_len: int, vocab_size: int, seed: int, range_ratio: float = 0.0
) -> list[list[int]]:
    """``n`` random prompts of token ids in the model's vocabulary (``datasets.sample_random``)."""
    from foudre.bench.datasets import sample_random

    reqs = sample_random(n, input_len, 1, range_ratio, seed, vocab_size=vocab_size)
    return [list(r.prompt) for r in reqs]  # type: ignore[arg-type]


def _build_llm(args: argparse.Namespace, need_tokenizer: bool) -> LLM:
    from foudre.engine.llm import LLM
    from foudre.engine.options import engine_config_from

    config = engine_config_from(args)
    if not need_tokenizer:
        config.skip_tokenizer_init = True
    return LLM.from_config(config)


def _save_json(path: str | Path, payload: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, default=str) + "\n")


def _meta(args: argparse.Namespace, command: str) -> dict[str, Any]:
    from foudre.bench.roofline import machine

    return {
        "command": command,
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "model": args.model,
        "dtype": args.dtype,
    }


# ---------------------------------------------------------------------------------------------
# foudre bench throughput


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``foudre bench throughput`` besides the engine flags."""
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128, help="random prompt length")
    parser.add_argument("--output-len", type=int, default=128, help="output length (tokens)")
    parser.add_argument(
        "--range-ratio", type=float, default=0.0, help="lengths uniform in [L*(1-X), L*(1+X)]"
    )
    parser.add_argument(
        "--dataset",
        default=None,
        help="prompt file (text split on blank lines / <|endoftext|>, or JSONL with prompt and "
        "output_len) instead of random token ids",
    )
    parser.add_argument("--save-result", default=None, metavar="FILE.json")


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    """Offline throughput: every request submitted at once through ``LLM.generate``.

    Returns (and prints) ``requests_per_s``, ``output_tokens_per_s``, ``total_tokens_per_s``,
    ``peak_kv_cache_usage``, ``num_preemptions`` and the run's sizes; writes them with the run's
    metadata to ``--save-result`` when given. Random prompts are token ids with ``ignore_eos``,
    so each output has exactly the asked length.
    """
    from foudre.bench.datasets import sample_file, sample_lengths
    from foudre.sampling_params import SamplingParams

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    llm = _build_llm(args, need_tokenizer=args.dataset is not None)
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(args.seed)
    prompts: list[str | list[int]]
    if args.dataset is None:
        prompts = list(
            random_prompts(args.num_prompts, args.input_len, vocab, args.seed, args.range_ratio)
        )
        out_lens = sample_lengths(args.num_prompts, args.output_len, args.range_ratio, rng)
        ignore_eos = True
    else:
        reqs = sample_file(
            args.dataset, args.num_prompts, args.output_len, args.range_ratio, args.seed
        )
        prompts = [r.prompt for r in reqs]
        out_lens = [r.output_len for r in reqs]
        ignore_eos = False
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos) for n in out_lens
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    m = llm.metrics()
    num_in = sum(len(o.prompt_token_ids) for o in outs)
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        **_meta(args, "throughput"),
        "num_prompts": len(outs),
        "input_len": args.input_len if args.dataset is None else None,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "dataset": args.dataset,
        "elapsed_s": elapsed,
        "total_input_tokens": num_in,
        "total_output_tokens": num_out,
        "requests_per_s": len(outs) / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
        "peak_kv_cache_usage": m["peak_kv_cache_usage"],
        "num_preemptions": m["num_preemptions"],
        "prefix_cache_hits": m["prefix_cache_hits"],
        "peak_rss_mib": peak_rss_bytes() / (1 << 20),
    }
    print(
        f"Throughput: {result['requests_per_s']:.2f} requests/s, "
        f"{result['output_tokens_per_s']:.1f} output tokens/s, "
        f"{result['total_tokens_per_s']:.1f} total tokens/s\n"
        f"{len(outs)} requests, {num_in} input + {num_out} output tokens in {elapsed:.2f} s; "
        f"peak KV usage {result['peak_kv_cache_usage']:.1%}, "
        f"preemptions {result['num_preemptions']}"
    )
    if args.save_result:
        _save_json(args.save_result, result)
    return result


# ---------------------------------------------------------------------------------------------
# foudre bench latency


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``foudre bench latency`` besides the engine flags."""
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--num-iters", type=int, default=3, help="timed repetitions")
    parser.add_argument(
        "--num-iters-warmup", type=int, default=1, help="untimed repetitions (8 output tokens)"
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        default=None,
        metavar="GB/S",
        help="memory bandwidth for the roofline (default: the fastest read of an fp32 matrix "
        "several times the last-level cache, 512 MiB at least, on the engine's device: a sum or "
        "a matrix-vector product)",
    )
    parser.add_argument("--save-result", default=None, metavar="FILE.json")


def timed_batch(
    engine: LLMEngine,
    prompts: Sequence[list[int]],
    output_len: int,
    after_decode_step: Callable[[], object] | None = None,
) -> tuple[list[float], list[float]]:
    """Submit ``prompts`` together and step until done. Returns each request's TTFT (seconds
    from submission) and the durations of the pure decode steps (after every request has its
    first token). ``after_decode_step``, if given, runs (untimed) after each of those steps.
    The weights are moved into 2 MiB pages first where that waits (``huge_pages.settle``): the
    steps are timed in the engine's steady state."""
    from foudre.native import huge_pages
    from foudre.sampling_params import SamplingParams

    huge_pages.settle()

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.monotonic()
    for p in prompts:
        engine.add_request(p, params, arrival_time=t0)
    first: dict[str, float] = {}
    decode: list[float] = []
    while engine.has_unfinished_requests():
        all_started = len(first) == len(prompts)
        s = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - s
        if all_started and outs:
            decode.append(dt)
            if after_decode_step is not None:
                after_decode_step()
        for out in outs:
            if out.request_id not in first and out.metrics and out.metrics.first_token_time:
                first[out.request_id] = out.metrics.first_token_time - t0
    return list(first.values()), decode


def run_latency(args: argparse.Namespace) -> dict[str, Any]:
    """Latency at a fixed batch: ``--batch-size`` requests of ``--input-len`` random tokens,
    submitted together, each generating ``--output-len`` tokens; repeated ``--num-iters`` times
    with fresh prompts (no prefix-cache hits between repetitions).

    Returns (and prints) mean and median TTFT (submission to first token), TPOT (median and mean
    decode-step time: one token per request per step), decode tokens/s, E2E latency per
    repetition, ``weight_bytes`` per step, the measured ``bandwidth_gb_s`` and
    ``roofline_fraction`` = weight bytes / median decode step / bandwidth.
    """
    from foudre.bench.roofline import machine, measure_bandwidth, weight_bytes

    if args.batch_size < 1 or args.input_len < 1 or args.output_len < 2:
        raise ValueError("need --batch-size >= 1, --input-len >= 1 and --output-len >= 2")
    llm = _build_llm(args, need_tokenizer=False)
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    for it in range(args.num_iters_warmup):
        prompts = random_prompts(args.batch_size, args.input_len, vocab, args.seed + 1000 + it)
        timed_batch(engine, prompts, min(8, args.output_len))
    ttfts: list[float] = []
    decode: list[float] = []
    e2e: list[float] = []
    for it in range(args.num_iters):
        prompts = random_prompts(args.batch_size, args.input_len, vocab, args.seed + it)
        t0 = time.perf_counter()
        first, steps = timed_batch(engine, prompts, args.output_len)
        e2e.append(time.perf_counter() - t0)
        ttfts += first
        decode += steps
    bandwidth = args.bandwidth * 1e9 if args.bandwidth else measure_bandwidth(device=engine.device)
    wbytes = weight_bytes(engine.model)
    median_step = float(np.median(decode)) if decode else math.nan
    result = {
        **_meta(args, "latency"),
        "machine": machine(engine.device),
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "mean_ttft_ms": float(np.mean(ttfts)) * 1e3,
        "median_ttft_ms": float(np.median(ttfts)) * 1e3,
        "median_tpot_ms": median_step * 1e3,
        "mean_tpot_ms": float(np.mean(decode)) * 1e3 if decode else math.nan,
        "p99_tpot_ms": float(np.percentile(decode, 99)) * 1e3 if decode else math.nan,
        "decode_tokens_per_s": args.batch_size / median_step,
        "mean_e2e_latency_s": float(np.mean(e2e)),
        "weight_bytes": wbytes,
        "bandwidth_gb_s": bandwidth / 1e9,
        "roofline_step_ms": wbytes / bandwidth * 1e3,
        "roofline_fraction": wbytes / median_step / bandwidth,
        "num_decode_steps": len(decode),
    }
    print(
        f"Latency (batch {args.batch_size}, {args.input_len} in / {args.output_len} out): "
        f"TTFT mean {result['mean_ttft_ms']:.1f} ms, median {result['median_ttft_ms']:.1f} ms; "
        f"TPOT median {result['median_tpot_ms']:.2f} ms, mean {result['mean_tpot_ms']:.2f} ms "
        f"({result['decode_tokens_per_s']:.1f} decode tokens/s)\n"
        f"Roofline: {wbytes / 1e9:.3f} GB of weights per step at "
        f"{result['bandwidth_gb_s']:.1f} GB/s = {result['roofline_step_ms']:.2f} ms/step; "
        f"decode runs at {result['roofline_fraction']:.1%} of the memory roofline"
    )
    if args.save_result:
        _save_json(args.save_result, result)
    return result
