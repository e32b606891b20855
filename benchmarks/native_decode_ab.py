"""Native CPU decode steps against the Python forward, A/B step by step (medium random Llama,
or any model directory: ``--model``, e.g. benchmarks/recurrent.py's Mamba-2 and hybrid).

This host's memory bandwidth drifts by up to 2x within minutes, so two runs taken one after the
other can differ more than the change being measured. Here one decode run alternates the two
paths every step (``runner.decode_path`` on, then off, ...): each native step is compared with the
Python step beside it, and the median of those ratios is printed per round. Rows per step:
``--batch`` (1 by default); ``--threads`` (all cores by default; 1 on a shared host, where
threads waiting on each other measure the load more than the step). Both paths compute the
same bits, so the tokens do not change.

    .venv/bin/python benchmarks/native_decode_ab.py --dtype bfloat16 [--rounds 4] [--batch 1]
    .venv/bin/python benchmarks/native_decode_ab.py --model ~/.cache/foudre-bench/recurrent/mamba2
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from common import random_llama

from foudre import LLM
from foudre.bench.offline import timed_batch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--model", help="a model directory (default: the medium random Llama)")
    ap.add_argument("--quantization", help="e.g. int8, int4; mxfp4: as families.py (gpt-oss)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    if args.quantization == "mxfp4":  # the experts MXFP4, the other linears int8
        from families import _mxfp4_with_int8

        _mxfp4_with_int8("mxfp4")
    torch.set_num_threads(args.threads)
    path = args.model or random_llama("medium", getattr(torch, args.dtype))
    llm = LLM(
        str(path),
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_model_len=1024,
        quantization=args.quantization,
    )
    runner = llm.engine.runner
    native = runner.decode_path
    if native is None:
        raise SystemExit("no native decode step here (no C++ compiler or no AVX-512)")
    used: list[bool] = []

    def flip() -> None:  # after each decode step: record which path ran it, switch
        used.append(runner.decode_path is not None)
        runner.decode_path = None if runner.decode_path is not None else native

    prompts = [[(7 * t + r) % 32000 for t in range(1, 129)] for r in range(args.batch)]
    timed_batch(llm.engine, prompts, 4)  # warm-up
    ratios: list[float] = []
    for rnd in range(args.rounds):
        used.clear()
        runner.decode_path = native if rnd % 2 == 0 else None
        batch = [[(t + 11 * (rnd + 1)) % 32000 for t in p] for p in prompts]
        _, steps = timed_batch(llm.engine, batch, args.new_tokens, flip)
        pairs = [
            (steps[i], steps[i + 1]) if used[i] else (steps[i + 1], steps[i])
            for i in range(0, len(steps) - 1, 2)
        ]
        ratio = statistics.median(n / p for n, p in pairs)
        ratios.append(ratio)
        nat = statistics.median(n for n, _ in pairs) * 1e3
        py = statistics.median(p for _, p in pairs) * 1e3
        print(f"round {rnd}: native {nat:.2f} ms, Python {py:.2f} ms, native/Python {ratio:.4f}")
    runner.decode_path = native
    print(
        f"{args.dtype}, {args.batch} row(s): native step / Python step, median of "
        f"{args.rounds} rounds: {statistics.median(ratios):.4f}"
    )


if __name__ == "__main__":
    main()
