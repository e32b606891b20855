"""The engine's host overhead: throughput where Python dominates a step, and the time a step
spends outside the model's forward.

    .venv/bin/python benchmarks/engine_overhead.py [--requests 256] [--overhead-requests 64]

Workloads (fixed seed, the embedded default model, ``foudre.loading.loader.default_model()``,
whose forward is cheap so that the engine's own work shows):
- before both, every KV pool is written once (``fault_in_kv_pools``): the steady state of a
  server past its first pass through the pool;
- throughput: ``--requests`` concurrent requests (random 32-token prompts, ``--new-tokens``
  greedy tokens each, ``ignore_eos``) through ``LLM.generate``; output tokens/s, best of
  ``--rounds``;
- host overhead: ``--overhead-requests`` requests stepped by hand; for each pure decode step
  (every request has its first token), the step's wall time and the time spent inside
  ``runner.forward`` (the model's forward and its logits); the median of their difference is
  the host overhead per step (scheduling, input preparation, sampling, output processing).

Lines with ``tok/s`` are what ``benchmarks/ab_checkouts.py`` collects, so the overhead line
carries one too (the step's decode rate).
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from foudre import LLM, SamplingParams
from foudre.native import huge_pages

PROMPT_LEN = 32


def prompts_of(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(PROMPT_LEN)] for _ in range(n)]


def fault_in_kv_pools(llm: LLM) -> float:
    """Write every KV pool of the engine once (seconds taken), as a server has after its first
    pass through them: on the CPU a pool in 2 MiB pages is faulted in as its blocks are first
    written (``huge_pages.zeros``), and the block queue hands out every block once before it
    reuses one, so without this each measured round would pay for pages never touched before
    (a cost of the memory, once per page and server, not of the engine's steps). The weights
    too are moved into 2 MiB pages first, where that waits for a thread (``settle``: not in
    trees before it)."""
    t = time.perf_counter()
    getattr(huge_pages, "settle", lambda: None)()
    pools = {}  # (cache groups share their tensors: each once)
    for cache in llm.engine.runner.kv_caches:
        pool = cache if isinstance(cache, torch.Tensor) else getattr(cache, "codes", None)
        if pool is not None and pool.is_cpu:
            pools[pool.data_ptr()] = pool[0] if pool.stride(0) == 0 else pool  # (latent: K = V)
    for pool in pools.values():
        pool.zero_()
    return time.perf_counter() - t


def throughput(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    assert produced == len(prompts) * new_tokens
    return produced / elapsed


def host_overhead(llm: LLM, prompts: list[list[int]], new_tokens: int) -> tuple[float, float]:
    """Median decode step and median time outside ``runner.forward`` in it (seconds)."""
    engine: Any = llm.engine
    runner = engine.runner
    inside = [0.0]
    forward = runner.forward

    def timed_forward(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            inside[0] += time.perf_counter() - t

    runner.forward = timed_forward
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    try:
        for p in prompts:
            engine.add_request(p, params)
        started: set[str] = set()
        steps: list[float] = []
        overheads: list[float] = []
        while engine.has_unfinished_requests():
            all_started = len(started) == len(prompts)
            inside[0] = 0.0
            t = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t
            if all_started and len(outs) == len(prompts):
                steps.append(dt)
                overheads.append(dt - inside[0])
            started.update(o.request_id for o in outs)
    finally:
        del runner.forward
    steps.sort()
    overheads.sort()
    return steps[len(steps) // 2], overheads[len(overheads) // 2]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--overhead-requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: on a shared host, threads waiting on each other at every GEMM "
        "would swamp the engine's own time, which is what this measures)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(skip_tokenizer_init=True, max_num_seqs=max(args.requests, args.overhead_requests))
    vocab = llm.engine.model_config.vocab_size
    print(f"weights settled, KV pools faulted in: {fault_in_kv_pools(llm):.2f} s", flush=True)
    throughput(llm, prompts_of(16, vocab, seed=1), 8)  # warm up
    runs = [
        throughput(llm, prompts_of(args.requests, vocab, seed=2 + r), args.new_tokens)
        for r in range(args.rounds)
    ]
    print(
        f"embedded model, {args.requests} concurrent requests: {max(runs):.1f} tok/s "
        f"(runs: {', '.join(f'{r:.1f}' for r in runs)})",
        flush=True,
    )
    step, overhead = host_overhead(
        llm, prompts_of(args.overhead_requests, vocab, seed=99), args.new_tokens
    )
    print(
        f"embedded model, {args.overhead_requests} requests: decode step {step * 1e3:.2f} ms "
        f"({args.overhead_requests / step:.1f} tok/s), host overhead (outside runner.forward) "
        f"{overhead * 1e3:.2f} ms/step ({overhead / step:.0%})",
        flush=True,
    )


if __name__ == "__main__":
    main()
