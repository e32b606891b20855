"""The in-process ``foudre bench`` subcommands: throughput, latency, ablate, sweep, quant."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any


def _throughput(args: argparse.Namespace) -> int:
    from foudre.bench.offline import run_throughput

    run_throughput(args)
    return 0


def _latency(args: argparse.Namespace) -> int:
    from foudre.bench.offline import run_latency

    run_latency(args)
    return 0


def _ablate(args: argparse.Namespace) -> int:
    from foudre.bench.ablate import run_ablate

    run_ablate(args, getattr(args, "argv", None))
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from foudre.bench.sweep import run_sweep

    points = run_sweep(args, getattr(args, "argv", None))
    return 0 if any(p["completed"] for p in points) else 1


def _quant(args: argparse.Namespace) -> int:
    from foudre.bench.quant import run_quant

    run_quant(args, getattr(args, "argv", None))
    return 0


def add_bench_commands(
    bench_sub: Any, add_engine_args: Callable[[argparse.ArgumentParser], None]
) -> None:
    """Register ``throughput``, ``latency``, ``ablate``, ``sweep`` and ``quant`` on the ``bench``
    subparsers (each with every engine flag); each sets ``func`` to its runner, which returns the
    exit code.
    """
    from foudre.bench.ablate import add_ablate_args
    from foudre.bench.offline import add_latency_args, add_throughput_args
    from foudre.bench.quant import add_quant_args
    from foudre.bench.sweep import add_sweep_args

    commands: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Any]] = [
        ("throughput", "offline throughput: every request at once through LLM.generate",
         add_throughput_args, _throughput),
        ("latency", "TTFT, TPOT and the decode roofline fraction at a fixed batch size",
         add_latency_args, _latency),
        ("ablate", "switch paging, batching, prefix caching, chunked prefill off one at a time",
         add_ablate_args, _ablate),
        ("sweep", "TTFT, TPOT and throughput over request rates (in process or --base-url)",
         add_sweep_args, _sweep),
        ("quant", "size, speed and quality of each weight / KV-cache quantization scheme",
         add_quant_args, _quant),
    ]  # fmt: skip
    for name, help_text, add_args, func in commands:
        p = bench_sub.add_parser(name, help=help_text)
        add_engine_args(p)
        add_args(p)
        p.set_defaults(func=func)
