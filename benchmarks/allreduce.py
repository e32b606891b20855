"""All-reduce cost on this machine: ``--world-size`` gloo processes on loopback time
``torch.distributed.all_reduce`` (sum) of the tensors a tensor-parallel decode step reduces.

    .venv/bin/python benchmarks/allreduce.py [--world-size 2] [--iters 200] \\
        [--out benchmarks/results/allreduce-cpu-YYYY-MM-DD.md]

A tensor-parallel Llama layer all-reduces its attention output and its MLP output, each a
``rows x hidden`` activation (rows = tokens in the step: the batch, in decode), so the cases are
hidden 896 (Qwen2.5-0.5B), 2048, 4096 (Llama 8B) and 8192 (Llama 70B) by 1, 4, 16 and 64 rows,
in float32 and bfloat16. Each rank runs one thread (``torch.set_num_threads(1)``), as a
tensor-parallel worker on CPU does. Per case: ``--warmup`` untimed calls, a barrier, then
``--iters`` calls back to back, each timed on every rank; the latency is the median over calls
of the slowest rank's time (min and p90 beside it: on a shared host the tail is the scheduler's
time slice, not the network). Bandwidths follow nccl-tests: algorithm bandwidth = bytes / time, bus
bandwidth = algbw x 2 (T - 1) / T, the per-link rate a ring all-reduce needs, comparable across
world sizes and with published NCCL figures. Runs in well under a minute.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import machine

HIDDEN = (896, 2048, 4096, 8192)
ROWS = (1, 4, 16, 64)
DTYPES = ("float32", "bfloat16")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    """One gloo rank: time every case; rank 0 puts the results (a list of dicts) on ``queue``."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    results = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for hidden in args.hidden:
            for rows in args.rows:
                x = torch.randn(rows, hidden).to(dtype)
                for _ in range(args.warmup):
                    dist.all_reduce(x)
                times = torch.empty(args.iters, dtype=torch.float64)
                dist.barrier()
                for i in range(args.iters):
                    t0 = time.perf_counter()
                    dist.all_reduce(x)
                    times[i] = time.perf_counter() - t0
                dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank, per call
                seconds = statistics.median(times.tolist())
                nbytes = x.numel() * x.element_size()
                algbw = nbytes / seconds
                results.append(
                    dict(
                        dtype=dtype_name,
                        hidden=hidden,
                        rows=rows,
                        bytes=nbytes,
                        latency_us=seconds * 1e6,
                        min_us=float(times.min()) * 1e6,
                        p90_us=float(torch.quantile(times, 0.9)) * 1e6,
                        algbw_gbs=algbw / 1e9,
                        busbw_gbs=algbw * 2 * (world - 1) / world / 1e9,
                    )
                )
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Start ``args.world_size`` ranks, wait for them, return rank 0's results."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, args.world_size, port, args, queue))
        for r in range(args.world_size)
    ]
    for p in procs:
        p.start()
    results: list[dict[str, Any]] = queue.get(timeout=300)
    for p in procs:
        p.join(30)
        if p.exitcode != 0:
            sys.exit(f"rank process exited with {p.exitcode}")
    return results


def table(results: list[dict[str, Any]]) -> str:
    """The results as a markdown table."""
    lines = [
        "| dtype | hidden | rows | bytes | latency (us, median) | min (us) | p90 (us) "
        "| algbw (GB/s) | busbw (GB/s) |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results:
        lines.append(
            f"| {r['dtype']} | {r['hidden']} | {r['rows']} | {r['bytes']} | "
            f"{r['latency_us']:.0f} | {r['min_us']:.0f} | {r['p90_us']:.0f} | "
            f"{r['algbw_gbs']:.3f} | {r['busbw_gbs']:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--hidden", type=int, nargs="+", default=list(HIDDEN))
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="markdown record (and .json beside)")
    args = ap.parse_args()
    if args.world_size < 2:
        ap.error("--world-size must be at least 2")
    torch.set_num_threads(1)
    start = time.perf_counter()
    results = run(args)
    elapsed = time.perf_counter() - start
    date = datetime.date.today().isoformat()
    command = "python benchmarks/allreduce.py " + " ".join(sys.argv[1:])
    header = [
        f"# All-reduce on CPU, gloo over loopback, {args.world_size} ranks",
        "",
        f"- date: {date}",
        f"- machine: {machine()} (per rank)",
        f"- command: `{command.strip()}`",
        f"- {args.iters} timed calls per case after {args.warmup} warm-up calls; latency: median "
        "over calls of the slowest rank; busbw = bytes / latency x 2(T-1)/T (nccl-tests)",
        f"- wall time: {elapsed:.1f} s",
        "",
        "",
    ]
    text = "\n".join(header) + table(results) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        meta = dict(date=date, machine=machine(), command=command, world_size=args.world_size)
        args.out.with_suffix(".json").write_text(json.dumps(dict(meta, results=results), indent=1))


if __name__ == "__main__":
    main()
