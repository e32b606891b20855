"""Tensor parallelism on the CPU: T=2 (two processes, one thread each) against T=1 (one
process, two threads), same cores, same model, same run; with the share of each step that
rank 0 spends in collectives.

    .venv/bin/python benchmarks/parallel.py --model small --dtype bfloat16 --rounds 3 \\
        --out benchmarks/results/parallel-cpu-YYYY-MM-DD.md

The record takes tens of minutes on two cores (three layouts, three rounds, 8,662 tokens of
throughput workload each); ``--num-requests 16 --rounds 1`` gives a first look in a few.
Smoke test (about 20 s; proves the script runs, measures nothing): ``--model tiny --new-tokens 8
--num-requests 4 --rounds 1``. Take the record on a quiet host: two cores shared with another
session's work say nothing about either layout.

Layouts (``--layouts``, ``TxP`` or ``TxP-eager``; default ``1x1 1x1-eager 2x1``): one process
runs with ``torch.set_num_threads(2)``, a parallel layout with one thread per rank
(``OMP_NUM_THREADS=1`` in the environment the engine's workers inherit,
``torch.set_num_threads(1)`` in this process, which is rank 0). ``1x1`` is foudre's default
path, with the native CPU decode layers; shards never use those, so ``1x1-eager``
(``enforce_eager``) is the same forward as the shards' in one process, and the difference
between it and ``2x1`` is what splitting costs or buys. Every engine stays loaded (idle workers
wait in a blocking receive, using no CPU); each round runs every layout in turn, so a drift of
the host's speed hits them alike.

Workloads (``core_throughput.py``'s, fixed seed): batch 1, a 128-token prompt and
``--new-tokens`` greedy tokens (decode tokens/s, median of the rounds); ``--num-requests``
requests with 128-token prompts and outputs uniform in 16..256 (useful tokens/s, through
``LLM.generate``). The collective share: rank 0's seconds inside ``TensorParallel.all_reduce``
and ``all_gather`` (wrapped with a timer here, in the engine process; the workers are not
instrumented) divided by the step's time: the median over decode steps for batch 1, the whole
run for the throughput workload. Time inside a collective includes waiting for the slower rank.

Expectation on one CPU socket: decode is bound by memory bandwidth, which two processes share
as two threads do, so T=2 cannot beat T=1 and loses what its all-reduces cost
(``benchmarks/results/allreduce-cpu-2026-12-01.md``: about 0.27 ms each, two per layer).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import CACHE, SMALL, machine, random_llama
from core_throughput import PROMPT_LEN, _median, foudre_throughput, make_llm, workload

from foudre import LLM
from foudre.bench.offline import timed_batch
from foudre.layers.parallel import TensorParallel

# a model that loads in a second: for the smoke test
TINY: dict[str, Any] = dict(
    SMALL, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip


def model_path(name: str) -> Path:
    """The random Llama ``name`` (tiny, small or medium) as float32 safetensors, cached."""
    if name != "tiny":
        return random_llama(name, torch.float32)
    import transformers

    path = CACHE / "llama-tiny-float32"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).save_pretrained(
            path, safe_serialization=True
        )
    return path


class CollectiveTimer:
    """Seconds this process spends inside ``TensorParallel``'s collectives, while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def installed(self) -> Iterator[None]:
        originals = {name: getattr(TensorParallel, name) for name in ("all_reduce", "all_gather")}

        def timed(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
            def wrapper(tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
                t = time.perf_counter()
                try:
                    return fn(tp, x)
                finally:
                    self.seconds += time.perf_counter() - t

            return wrapper

        for name, fn in originals.items():
            setattr(TensorParallel, name, timed(fn))
        try:
            yield
        finally:
            for name, fn in originals.items():
                setattr(TensorParallel, name, fn)


@dataclass(frozen=True)
class Layout:
    """``T x P`` ranks; ``eager``: without the native CPU decode layers (``enforce_eager``),
    which a parallel engine never uses: the same forward path as the shards, one process."""

    t: int
    p: int
    eager: bool = False

    @classmethod
    def parse(cls, text: str) -> Layout:
        """``TxP``, or ``TxP-eager``."""
        sizes, _, mode = text.lower().partition("-")
        t, p = sizes.split("x")
        return cls(int(t), int(p), mode == "eager")

    @property
    def threads(self) -> int:
        """Threads per rank: the machine's two cores, one per rank when there are two."""
        return 2 if self.t * self.p == 1 else 1

    def __str__(self) -> str:
        return f"{self.t}x{self.p}{'-eager' if self.eager else ''}"

    def use_threads(self) -> None:
        os.environ["OMP_NUM_THREADS"] = str(self.threads)  # inherited by spawned workers
        torch.set_num_threads(self.threads)

    def load(self, path: Path, dtype: str) -> LLM:
        """The engine of this layout, its threads set as the module docstring says."""
        self.use_threads()
        options: dict[str, Any] = {"enforce_eager": self.eager}
        if self.t * self.p > 1:
            options.update(tensor_parallel_size=self.t, pipeline_parallel_size=self.p)
        return make_llm(path, dtype, "cpu", **options)


def batch1(llm: LLM, timer: CollectiveTimer, prompt: list[int], new: int) -> tuple[float, float]:
    """Decode tokens/s of one request and the median share of a decode step in collectives."""
    warm = [(t + 1) % 32000 for t in prompt]  # a different prompt: no prefix-cache hit below
    timed_batch(llm.engine, [warm], 2)
    marks: list[float] = []
    with timer.installed():
        _, decode = timed_batch(llm.engine, [prompt], new, lambda: marks.append(timer.seconds))
    # marks[i] - marks[i - 1]: collective seconds of decode step i (step 0 also holds prefill's)
    shares = [(b - a) / d for a, b, d in zip(marks, marks[1:], decode[1:], strict=False)]
    return len(decode) / sum(decode), _median(shares) if shares else 0.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small", choices=["tiny", "small", "medium"])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--layouts",
        nargs="+",
        type=Layout.parse,
        default=[Layout(1, 1), Layout(1, 1, True), Layout(2, 1)],
    )
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None, help="markdown record (and .json beside)")
    args = ap.parse_args()
    host = machine()  # before the layouts change torch's thread count
    path = model_path(args.model)
    prompts, lens = workload(args.num_requests)
    lens = [min(n, args.new_tokens) for n in lens] if args.model == "tiny" else lens
    engines = {layout: layout.load(path, args.dtype) for layout in args.layouts}
    runs: dict[Layout, dict[str, list[float]]] = {
        layout: {"tps": [], "share": [], "tput": [], "tput_share": []} for layout in engines
    }
    for layout, llm in engines.items():  # untimed: first-use costs (allocations, kernels)
        layout.use_threads()
        foudre_throughput(llm, prompts[:8], [8] * len(prompts[:8]))
    for r in range(args.rounds):
        for layout, llm in engines.items():
            layout.use_threads()
            timer = CollectiveTimer()
            llm.engine.reset_prefix_cache()
            tps, share = batch1(llm, timer, prompts[0], args.new_tokens)
            llm.engine.reset_prefix_cache()
            before, start = timer.seconds, time.perf_counter()
            with timer.installed():
                tput, _ = foudre_throughput(llm, prompts, lens)
            tput_share = (timer.seconds - before) / (time.perf_counter() - start)
            run = runs[layout]
            run["tps"].append(tps)
            run["share"].append(share)
            run["tput"].append(tput)
            run["tput_share"].append(tput_share)
            print(
                f"round {r + 1} {layout}: batch 1 {tps:.1f} tok/s ({share:.0%} in "
                f"collectives), {args.num_requests} requests {tput:.1f} tok/s "
                f"({tput_share:.0%})",
                flush=True,
            )
    for llm in engines.values():
        llm.shutdown()
    del engines
    gc.collect()

    base = runs[args.layouts[0]]
    lines = [
        f"| layout | threads per rank | batch-1 tok/s | in collectives | vs {args.layouts[0]} "
        f"| {args.num_requests}-req tok/s | in collectives | vs |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for layout, run in runs.items():
        tps, tput = _median(run["tps"]), _median(run["tput"])
        lines.append(
            f"| {layout} | {layout.threads} | {tps:.1f} | {_median(run['share']):.0%} "
            f"| {tps / _median(base['tps']):.2f}x | {tput:.1f} | "
            f"{_median(run['tput_share']):.0%} | {tput / _median(base['tput']):.2f}x |"
        )
    date = datetime.date.today().isoformat()
    command = "python benchmarks/parallel.py " + " ".join(sys.argv[1:])
    header = [
        f"# Tensor parallelism on the CPU ({args.model} random Llama, {args.dtype})",
        "",
        f"- date: {date}",
        f"- machine: {host}",
        f"- command: `{command.strip()}`",
        f"- batch 1: {PROMPT_LEN}-token prompt, {args.new_tokens} greedy tokens; throughput: "
        f"{args.num_requests} requests, {sum(lens)} useful tokens; medians of {args.rounds} "
        "rounds; 'in collectives': rank 0's share of step time inside all_reduce / all_gather",
        "",
    ]
    text = "\n".join(header + lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        meta = dict(date=date, machine=host, command=command, model=args.model)
        data = {str(layout): run for layout, run in runs.items()}
        args.out.with_suffix(".json").write_text(json.dumps(dict(meta, runs=data), indent=1))


if __name__ == "__main__":
    main()
