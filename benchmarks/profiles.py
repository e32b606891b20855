"""The serving profiles (``foudre serve --profile realtime | throughput | edge``) against the
default settings, each on its own target:

- realtime: the most concurrent users (closed loop, ``max_concurrency``) at which p90 TTFT <=
  150 ms and p90 TPOT <= 50 ms (the seeds' targets), doubling the users until it fails;
- throughput: output tokens/s with 64 concurrent users;
- edge: the server's resident memory (VmRSS after the runs) and batch-1 output tokens/s.

Every configuration is measured on every target, so each profile is compared with the default
on the same figure. Requests: random token prompts of ``--input-len`` tokens, ``--output-len``
tokens out (ignore_eos), through the completions endpoint, streamed.

    .venv/bin/python benchmarks/profiles.py --model embedded --out results/profiles-embedded.md
    .venv/bin/python benchmarks/profiles.py --model medium --out results/profiles-500m.md
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import torch
from common import machine, random_llama, with_llama2_tokenizer
from soak import start_server

from foudre.bench.datasets import sample_random
from foudre.bench.metrics import compute_metrics
from foudre.bench.serve import BenchConfig, run_benchmark

CONFIGS = ("default", "realtime", "throughput", "edge")
TTFT_MS, TPOT_MS = 150.0, 50.0


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run(url: str, args: argparse.Namespace, users: int, n: int, output_len: int) -> dict[str, Any]:
    requests = sample_random(n, args.input_len, output_len, seed=users, vocab_size=args.vocab)
    config = BenchConfig(url, args.served, max_concurrency=users, progress=False)
    results, duration = asyncio.run(run_benchmark(requests, config))
    return compute_metrics(results, duration, {"ttft_ms": TTFT_MS, "tpot_ms": TPOT_MS})


def measure(url: str, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    args.served = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    warm = run(url, args, 2, 4, 8)
    assert warm["completed"] == 4, warm
    best, tried = 0, []

    def within_slo(users: int) -> bool:
        m = run(url, args, users, max(2 * users, 8), args.output_len)
        ok = (
            m["failed"] == 0
            and m["p90_ttft_ms"] is not None
            and m["p90_ttft_ms"] <= TTFT_MS
            and (m["p90_tpot_ms"] or 0) <= TPOT_MS
        )
        tried.append((users, m["p90_ttft_ms"], m["p90_tpot_ms"]))
        print(f"  {users:4d} users: p90 TTFT {m['p90_ttft_ms']:.0f} ms, p90 TPOT "
              f"{m['p90_tpot_ms']:.1f} ms{'' if ok else '  (over)'}", flush=True)  # fmt: skip
        return ok

    # double until over, then halve the gap twice (16 ok, 32 over: 24, then 20 or 28)
    users = 1
    while users <= args.max_users and within_slo(users):
        best, users = users, users * 2
    over = users
    for _ in range(2):
        mid = (best + over) // 2
        if best == 0 or mid in (best, over) or over > args.max_users:
            break
        if within_slo(mid):
            best = mid
        else:
            over = mid
    out["max_users"], out["users_tried"] = best, tried
    m = run(url, args, 64, 128, args.output_len)
    out["tps_64"] = m["output_throughput"]
    out["failed_64"] = m["failed"]
    m = run(url, args, 1, 4, args.output_len)
    out["tps_1"] = m["output_throughput"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="embedded", help="embedded, medium (~500M random) or a path")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--max-users", type=int, default=128)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS))
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--server-args", default="", help="more flags for every server, e.g. '--max-num-seqs 64'"
    )
    args = ap.parse_args()
    args.vocab = 32000
    if args.model == "embedded":
        model_args: list[str] = []
        from foudre.loading.loader import default_model, load_tokenizer

        args.vocab = load_tokenizer(default_model()[0]).vocab_size  # ids past it are refused
    elif args.model == "medium":
        model = with_llama2_tokenizer(random_llama("medium", torch.bfloat16))
        model_args = ["--model", str(model), "--dtype", "bfloat16"]
    else:
        model_args = ["--model", args.model]
    rows: dict[str, dict[str, Any]] = {}
    for profile in args.configs:
        print(f"[{profile}]", flush=True)
        extra = model_args if profile == "default" else [*model_args, "--profile", profile]
        extra = [*extra, *args.server_args.split()]
        proc, url = start_server(extra, timeout=600)
        try:
            t0 = time.monotonic()
            rows[profile] = measure(url, args)
            rows[profile]["rss_mib"] = rss_mib(proc.pid)
            rows[profile]["wall_s"] = time.monotonic() - t0
        finally:
            proc.terminate()
            proc.wait(60)
        print(f"  {json.dumps(rows[profile])}", flush=True)
    lines = [
        f"# Serving profiles: {args.model}",
        "",
        f"- date: {datetime.date.today().isoformat()}; machine: {machine()}",
        f"- command: `benchmarks/profiles.py {' '.join(sys.argv[1:])}`",
        f"- requests: {args.input_len} random prompt tokens, {args.output_len} output tokens, "
        "streamed completions; users = concurrent clients in a closed loop",
        "- max users: the most users (1, 2, 4, ..., then two bisection steps) at which "
        f"p90 TTFT <= {TTFT_MS:.0f} ms and p90 TPOT <= {TPOT_MS:.0f} ms",
        "",
        "| settings | max users within SLO | output tok/s at 64 users | batch-1 tok/s "
        "| server RSS MiB |",
        "| --- | --- | --- | --- | --- |",
    ]
    for profile, r in rows.items():
        lines.append(
            f"| {profile} | {r['max_users']} | {r['tps_64']:.1f} | {r['tps_1']:.1f} | "
            f"{r['rss_mib']:.0f} |"
        )
    lines += ["", "Users tried (users, p90 TTFT ms, p90 TPOT ms):", ""]
    for profile, r in rows.items():
        tried = ", ".join(f"({u}, {t:.0f}, {p:.1f})" for u, t, p in r["users_tried"])
        lines.append(f"- {profile}: {tried}")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
