"""Micro-benchmark of the CPU quantized-linear kernels at decode sizes.

For each layer shape and batch size, in alternating turns (so that a shared host's load falls
on every kernel alike): bf16 ``F.linear``, the aten int8 / int4 packed kernels
(``quant.kernels``, bf16 activations) and ours (``quant.cpu_qmatmul``, bf16 and float32
activations). Reports the median time and the GB/s of weight bytes read (bf16: 2 bytes per
weight; int8: 1 plus the scales; int4: 0.5 plus the scales and zero points), and each kernel's
ratio to bf16 ``F.linear``. Each kernel rotates over copies of its weights (``COLD_BYTES`` in
all), so that each call reads them from memory.

    python benchmarks/quant_kernels_cpu.py [--rounds 5] [--group 128] [--threads N] [--json F]

On a host shared with other work, ``--threads 1`` keeps an OpenMP barrier from waiting on a
descheduled thread (two threads on a busy 2-core host time the scheduler, not the kernels).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from foudre.bench.roofline import last_level_cache_bytes
from foudre.quant import cpu_qmatmul, kernels
from foudre.quant.qlinear import QuantLinear

SHAPES = [(4096, 4096), (1024, 2816)]  # (out, in)
BATCHES = [1, 16]
# each kernel's weights rotate over this much: three times the L3 (96 MiB at least)
COLD_BYTES = max(96 << 20, 3 * last_level_cache_bytes())


def timed(fn: Callable[[], object], min_s: float = 0.2) -> float:
    """Seconds per call: the median of single calls repeated until ``min_s`` has passed (a
    median, not a mean, so that a thread descheduled on a shared host weighs little)."""
    fn()
    times: list[float] = []
    while sum(times) < min_s:
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _clone(weights: Any) -> Any:
    if isinstance(weights, cpu_qmatmul.Packed):
        z = None if weights.z is None else weights.z.clone()
        return dataclasses.replace(weights, w=weights.w.clone(), s=weights.s.clone(), z=z)
    return tuple(t.clone() for t in weights)


def rotating(
    call: Callable[[Any], object], weights: Any, nbytes: int
) -> tuple[Callable[[], object], int]:
    """``call`` over copies of ``weights`` (aten's tuple or our ``Packed``) in turn, enough
    copies to fill ``COLD_BYTES``: each call reads its weight from memory, not from a
    last-level cache that holds a small layer."""
    copies = [weights] + [_clone(weights) for _ in range(max(0, -(-COLD_BYTES // nbytes) - 1))]
    turn = itertools.cycle(copies)
    return (lambda: call(next(turn))), nbytes


def candidates(n: int, k: int, m: int, group: int) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (call, weight bytes read per call)."""
    torch.manual_seed(0)
    w = torch.randn(n, k) * 0.05
    x32 = torch.randn(m, k)
    x16 = x32.bfloat16()
    q8 = QuantLinear.from_float(w, None, 8)
    q4 = QuantLinear.from_float(w, None, 4, group)
    assert q4.zeros is not None
    a8 = kernels.cpu_layout(q8.qweight, q8.scales, None, torch.bfloat16)
    a4 = kernels.cpu_layout(q4.qweight, q4.scales, q4.zeros, torch.bfloat16)
    n8 = cpu_qmatmul.layout(q8.qweight, q8.scales, None, None)
    n4 = cpu_qmatmul.layout(q4.qweight, q4.scales, q4.zeros, group)
    bytes8 = n * k + 4 * n
    bytes4 = n * k // 2 + 8 * n * (k // group)
    return {
        "bf16 F.linear": rotating(lambda p: F.linear(x16, p[0]), (w.bfloat16(),), 2 * n * k),
        "aten int8": rotating(lambda p: kernels.cpu_matmul(x16, p, None, n), a8, bytes8),
        "ours int8 bf16": rotating(lambda p: cpu_qmatmul.matmul(x16, p), n8, bytes8),
        "ours int8 f32": rotating(lambda p: cpu_qmatmul.matmul(x32, p), n8, bytes8),
        "aten int4": rotating(lambda p: kernels.cpu_matmul(x16, p, group, n), a4, bytes4),
        "ours int4 bf16": rotating(lambda p: cpu_qmatmul.matmul(x16, p), n4, bytes4),
        "ours int4 f32": rotating(lambda p: cpu_qmatmul.matmul(x32, p), n4, bytes4),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch's threads (ours too)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"kernel path: {cpu_qmatmul.path()}, threads: {torch.get_num_threads()}")
    results = []
    for n, k in SHAPES:
        for m in BATCHES:
            cands = candidates(n, k, m, args.group)
            times: dict[str, list[float]] = {name: [] for name in cands}
            for _ in range(args.rounds):  # alternating turns
                for name, (fn, _) in cands.items():
                    times[name].append(timed(fn))
            base = statistics.median(times["bf16 F.linear"])
            print(f"\n[{n} x {k}] batch {m}")
            for name, (_, nbytes) in cands.items():
                t = statistics.median(times[name])
                gbs = nbytes / t / 1e9
                print(f"  {name:16s} {t * 1e3:8.3f} ms  {gbs:6.1f} GB/s  {base / t:5.2f}x bf16")
                results.append(
                    {
                        "n": n,
                        "k": k,
                        "m": m,
                        "kernel": name,
                        "ms": t * 1e3,
                        "gb_s": gbs,
                        "speedup_vs_bf16": base / t,
                    }
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"path": cpu_qmatmul.path(), "group": args.group, "results": results}, f, indent=1
            )


if __name__ == "__main__":
    main()
