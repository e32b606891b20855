"""What laying out a decode step's inputs costs the runner: ``ModelRunner.flatten`` (token ids,
positions, slot mapping, with the backend's ``build_metadata`` inside it) and, on the native
CPU decode path, ``NativeDecode._inputs``, per pure decode step of ``--requests`` requests;
beside them the step's other host work: ``Scheduler.schedule``, ``Scheduler.update`` and
``ModelRunner.execute`` outside ``ModelRunner.forward`` (``execute - forward``).

    .venv/bin/python benchmarks/step_inputs.py [--requests 256] [--new-tokens 64] [--eager]

The embedded default model (``foudre.loading.loader.default_model()``), random 32-token
prompts, greedy, ``ignore_eos``. ``--eager`` turns the decode path off (``enforce_eager``), so
that every step goes through ``flatten``; without it, decode steps take the native path
(``_inputs``). Figures are CPU seconds (``time.process_time``) and wall seconds
(``time.perf_counter``), medians over the steps where every request decodes; lines carry
``tok/s`` so that ``benchmarks/ab_checkouts.py`` collects them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from engine_overhead import prompts_of

from foudre import LLM, SamplingParams
from foudre.runner.cpu_decode import NativeDecode


class Timer:
    """CPU and wall time spent in the wrapped calls since the last ``reset``."""

    def __init__(self) -> None:
        self.cpu = self.wall = 0.0
        self.calls = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            c, w = time.process_time(), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.cpu += time.process_time() - c
                self.wall += time.perf_counter() - w
                self.calls += 1

        return timed

    def reset(self) -> None:
        self.cpu = self.wall = 0.0
        self.calls = 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--eager", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(skip_tokenizer_init=True, max_num_seqs=args.requests, enforce_eager=args.eager)
    engine: Any = llm.engine
    runner = engine.runner
    names = ["flatten", "build_metadata", "_inputs", "schedule", "update", "execute", "forward"]
    timers = {name: Timer() for name in [*names, "step"]}
    runner.flatten = timers["flatten"].wrap(runner.flatten)
    runner.forward = timers["forward"].wrap(runner.forward)
    runner.execute = timers["execute"].wrap(runner.execute)
    scheduler = engine.scheduler
    scheduler.schedule = timers["schedule"].wrap(scheduler.schedule)
    scheduler.update = timers["update"].wrap(scheduler.update)
    runner.backend.build_metadata = timers["build_metadata"].wrap(runner.backend.build_metadata)
    if isinstance(runner.decode_path, NativeDecode):
        path = runner.decode_path
        path._inputs = timers["_inputs"].wrap(path._inputs)  # type: ignore[method-assign]
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    for prompt in prompts_of(args.requests, vocab, seed=0):
        engine.add_request(prompt, params)
    per_step: dict[str, list[tuple[float, float]]] = {name: [] for name in timers}
    started: set[str] = set()
    while engine.has_unfinished_requests():
        decoding = len(started) == args.requests
        for t in timers.values():
            t.reset()
        step = timers["step"].wrap(engine.step)
        outs = step()
        if decoding and len(outs) == args.requests:
            for name, t in timers.items():
                per_step[name].append((t.cpu, t.wall))
            inner, outer = timers["forward"], timers["execute"]
            host = (outer.cpu - inner.cpu, outer.wall - inner.wall)
            per_step.setdefault("execute - forward", []).append(host)
        started.update(o.request_id for o in outs)
    mode = "eager" if args.eager else "decode path"
    steps = per_step["step"]
    step_wall = statistics.median(w for _, w in steps)
    for name, values in per_step.items():
        if not values or not any(c or w for c, w in values):
            continue
        cpu = statistics.median(c for c, _ in values) * 1e3
        wall = statistics.median(w for _, w in values) * 1e3
        print(
            f"{mode}, {args.requests} decode rows: {name} {cpu:.3f} ms CPU, {wall:.3f} ms wall "
            f"per step ({len(values)} steps; step rate {args.requests / step_wall:.1f} tok/s)",
            flush=True,
        )


if __name__ == "__main__":
    main()
