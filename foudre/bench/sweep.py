"""``foudre bench sweep``: TTFT, TPOT and throughput over a list of request rates.

For each offered rate, ``--num-prompts`` random requests arrive as a Poisson process (gamma with
``--burstiness``; ``datasets.arrival_times``) and are served either in process, by the replay
driver on one engine (``offline.replay``), or by a running server at ``--base-url``, through
the HTTP load generator of ``foudre bench serve``. Each rate draws fresh prompts (seed + its
index), so the prefix cache carries nothing from one rate to the next. Output: ``sweep.json``,
``sweep.md`` and ``sweep.png`` (latency-throughput curves) in ``--output``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import shlex
import sys
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from foudre.bench.datasets import DEFAULT_RANDOM_VOCAB, arrival_times, sample_random
from foudre.bench.metrics import compute_metrics
from foudre.bench.offline import WorkItem, replay, replay_summary
from foudre.bench.serve import parse_rate


def add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``foudre bench sweep`` besides the engine flags (used in process only)."""
    p = parser
    p.add_argument(
        "--rates",
        type=parse_rate,
        nargs="+",
        required=True,
        metavar="REQ/S",
        help="offered request rates, e.g. 0.5 1 2 4 (inf: all at once)",
    )
    p.add_argument("--num-prompts", type=int, default=32, help="requests per rate")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--burstiness", type=float, default=1.0, help="1 = Poisson")
    p.add_argument(
        "--base-url", default=None, help="sweep a running server instead of an in-process engine"
    )
    p.add_argument(
        "--random-vocab-size",
        type=int,
        default=DEFAULT_RANDOM_VOCAB,
        help="with --base-url: random token ids are drawn below this",
    )
    p.add_argument("--output", default="benchmarks/results/sweep", metavar="DIR")


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def _sweep_in_process(args: argparse.Namespace) -> list[dict[str, Any]]:
    from foudre.engine.llm import LLM
    from foudre.engine.options import engine_config_from
    from foudre.sampling_params import SamplingParams

    config = engine_config_from(args)
    config.skip_tokenizer_init = True
    llm = LLM.from_config(config)
    vocab = llm.engine.model_config.vocab_size
    llm.generate([[11, 12, 13, 14]], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    points = []
    for k, rate in enumerate(args.rates):
        reqs = sample_random(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.seed + k,
            vocab_size=vocab,
        )
        times = arrival_times(len(reqs), rate, args.burstiness, args.seed + k)
        items = [
            WorkItem(r.prompt, r.output_len, arrival=t) for r, t in zip(reqs, times, strict=True)
        ]
        point = replay_summary(replay(llm.engine, items))
        points.append({"request_rate": _rate_json(rate), **point})
        _log_point(rate, point)
    return points


def _sweep_http(args: argparse.Namespace) -> list[dict[str, Any]]:
    from foudre.bench.serve import BenchConfig, run_benchmark

    if not args.model:
        raise ValueError("--base-url needs --model (the served model name)")
    points = []
    for k, rate in enumerate(args.rates):
        reqs = sample_random(
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.range_ratio,
            args.seed + k,
            vocab_size=args.random_vocab_size,
        )
        config = BenchConfig(
            base_url=args.base_url,
            model=args.model,
            request_rate=rate,
            burstiness=args.burstiness,
            seed=args.seed + k,
            progress=False,
        )
        results, duration = asyncio.run(run_benchmark(reqs, config))
        point = compute_metrics(results, duration)
        points.append({"request_rate": _rate_json(rate), **point})
        _log_point(rate, point)
    return points


def _log_point(rate: float, p: dict[str, Any]) -> None:
    print(
        f"rate {rate} req/s: {p['request_throughput']:.2f} req/s, "
        f"{p['output_throughput']:.1f} out tok/s, TTFT mean {_f(p['mean_ttft_ms'])} ms, "
        f"TPOT mean {_f(p['mean_tpot_ms'])} ms, failed {p['failed']}",
        file=sys.stderr,
        flush=True,
    )


def _f(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def format_markdown(points: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The sweep as markdown: header (target, machine, command, date) and one row per rate."""
    lines = [
        f"# Request-rate sweep: {meta['model']}",
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- target: {meta['target']}",
        f"- command: `{meta['command']}`",
        f"- workload: {meta['workload']}",
        "",
        "| offered req/s | achieved req/s | out tok/s | mean TTFT (ms) | p99 TTFT (ms) "
        "| mean TPOT (ms) | p99 TPOT (ms) | p99 ITL (ms) | failed |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for p in points:
        lines.append(
            f"| {p['request_rate']} | {p['request_throughput']:.2f} | "
            f"{p['output_throughput']:.1f} | {_f(p['mean_ttft_ms'])} | {_f(p['p99_ttft_ms'])} | "
            f"{_f(p['mean_tpot_ms'])} | {_f(p['p99_tpot_ms'])} | {_f(p['p99_itl_ms'])} | "
            f"{p['failed']} |"
        )
    return "\n".join(lines) + "\n"


def run_sweep(args: argparse.Namespace, argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """``foudre bench sweep``: one point per rate; writes ``sweep.json``, ``sweep.md`` and
    ``sweep.png`` into ``--output`` and prints the markdown."""
    from foudre.bench.plots import plot_sweep
    from foudre.bench.roofline import machine

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        raise ValueError(f"--burstiness must be a positive number, got {args.burstiness}")
    points = _sweep_http(args) if args.base_url else _sweep_in_process(args)
    meta = {
        "model": args.model,
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "target": args.base_url or "in-process engine (replay driver)",
        "command": "foudre " + shlex.join(list(argv) if argv is not None else sys.argv[1:]),
        "workload": (
            f"{args.num_prompts} random prompts per rate, {args.input_len} in / "
            f"{args.output_len} out (range ratio {args.range_ratio}), burstiness "
            f"{args.burstiness}, seed {args.seed}"
        ),
    }
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    md = format_markdown(points, meta)
    (out / "sweep.md").write_text(md)
    (out / "sweep.json").write_text(json.dumps({**meta, "points": points}, indent=2) + "\n")
    plot_sweep(points, out / "sweep.png", title=f"foudre sweep: {args.model} ({meta['target']})")
    print(md)
    return points
