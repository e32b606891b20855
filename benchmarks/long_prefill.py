"""Long-prompt prefill: TTFT, prefill tokens/s and peak memory, old path against new, and
llama.cpp with flash attention, in turns in the same run.

The model is the medium random Llama (494.7M parameters) with its context raised to 32k tokens
by Llama-3.1 RoPE scaling (``common.MEDIUM_32K``), in bfloat16. Each measurement is a fresh
process that loads the engine, warms it up on a short prompt, then times one request of N
random tokens with ``max_tokens=1`` (the time to its first token):

- old: ``attention_backend="torch"``, the path every prefill took before: each chunk gathers
  its request's whole context out of the blocks and runs SDPA with a dense chunk x context mask;
- new: ``attention_backend="cpu"``, the paged FlashAttention kernel
  (``native/cpu_paged_prefill.cpp``): no gather, no mask;
- llama.cpp: ``llama-bench -p N -n 0 -fa 1 -t <cores>`` on the same weights converted to GGUF
  (bf16), when ``--llama-cpp DIR`` names a build (``DIR/build/bin/llama-bench``); with
  ``--build`` the script downloads llama-cpp-python's sdist and builds its vendored llama.cpp
  there first. Without ``--llama-cpp`` the peer is skipped and the report says so.

Both foudre paths chunk the prompt at ``max_num_batched_tokens`` (2048). Memory: the peak RSS
of the request over the process's RSS before it, plus the KV pool (allocated, and written once
so that it is resident, before the request; sized to the prompt): the KV of the prompt plus
whatever the prefill allocates on top. With ``--device cuda`` the new path is the Triton
varlen kernel (``attention_backend="triton"``), memory is torch's peak allocation on the GPU,
and the GEMM rate is the GPU's; llama.cpp is not run there.

The fraction of the machine's bf16 GEMM rate counts 2 FLOPs per weight and token of the decoder
layers' linears (the lm_head runs on the last token only) plus the causal attention once:
4 * head_dim * heads * layers per (query, visible key) pair.

    .venv/bin/python benchmarks/long_prefill.py [--lengths 2048 8192 16384 32768] \\
        [--rounds 1] [--llama-cpp ~/.cache/foudre-bench/llama.cpp --build] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.M)
    assert match is not None, key
    return int(match.group(1)) * 1024


def child(args: argparse.Namespace) -> None:
    """One measurement in this process: prints one JSON line."""
    import torch
    from engine_overhead import fault_in_kv_pools

    from foudre import LLM, SamplingParams

    n, bs = args.length, 16
    blocks = -(-(n + 1) // bs) + 1
    cuda = args.device == "cuda"
    backend = {"old": "torch", "new": "triton" if cuda else "cpu"}[args.path]
    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        skip_tokenizer_init=True,
        attention_backend=backend,
        max_model_len=min(n + 16, args.max_positions),
        num_kv_blocks=blocks,
        enable_prefix_caching=False,
        block_size=bs,
    )
    assert llm.engine.runner.backend.name == backend
    greedy = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(n)
    llm.generate([torch.randint(3, 32000, (300,), generator=g).tolist()], greedy)  # warm-up
    prompt = torch.randint(3, 32000, (n,), generator=g).tolist()
    pool = sum(c.numel() * c.element_size() for c in llm.engine.runner.kv_caches)
    fault_in_kv_pools(llm)  # (a CPU pool in 2 MiB pages is resident only once written)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = _status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    start = time.perf_counter()
    llm.generate([prompt], greedy)
    ttft = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else _status("VmHWM")
    cfg = llm.engine.runner.model.config
    kv = n * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    print(
        json.dumps(
            {
                "path": args.path,
                "length": n,
                "ttft_s": ttft,
                "tokens_per_s": n / ttft,
                "growth_mb": (peak - before + pool) / 2**20,
                "kv_mb": kv / 2**20,
            }
        )
    )


def gemm_rate(device: str = "cpu", seconds: float = 3.0) -> float:
    """The best bf16 GEMM rate (FLOP/s) of torch on ``device``, at a decoder layer's shapes."""
    import torch

    best = 0.0
    shapes = [(2048, 1536, 4096), (2048, 4096, 1536), (2048, 1536, 1536)]
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for m, k, n in shapes:
            a = torch.randn(m, k, dtype=torch.bfloat16, device=device)
            b = torch.randn(k, n, dtype=torch.bfloat16, device=device)
            a @ b
            sync()
            t = time.perf_counter()
            for _ in range(10 if device == "cuda" else 1):
                a @ b
            sync()
            reps = 10 if device == "cuda" else 1
            best = max(best, 2 * m * k * n * reps / (time.perf_counter() - t))
    return best


def prefill_flops(n: int, cfg: dict[str, Any]) -> float:
    """FLOPs of an n-token prefill: the decoder layers' linears, the causal attention once."""
    hidden, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    inter = cfg["intermediate_size"]
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden
    per_layer += 3 * hidden * inter
    linears = 2 * n * layers * per_layer + 2 * hidden * cfg["vocab_size"]
    attention = 4 * head_dim * heads * layers * n * (n + 1) / 2
    return float(linears + attention)


def llama_cpp_prefill(bench: Path, gguf: Path, n: int) -> dict[str, Any]:
    from common import llama_bench

    tps = llama_bench(bench, gguf, prompt=n)
    return {"path": "llama.cpp", "length": n, "ttft_s": n / tps, "tokens_per_s": tps}


def measure(path: str, n: int, model: Path, dtype: str, device: str) -> dict[str, Any]:
    from common import run_child

    args = ("--path", path, "--length", str(n), "--model", str(model), "--dtype", dtype)
    return run_child(__file__, *args, "--device", device, what=f"{path} at {n} tokens")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192, 16384, 32768])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--paths", nargs="+", default=["old", "new"], choices=["old", "new"])
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp build directory (the peer)")
    ap.add_argument("--build", action="store_true", help="build llama.cpp there if missing")
    ap.add_argument("--out", type=Path, help="write results.json and results.md here")
    ap.add_argument("--note", default="", help="a line for the record (e.g. a shared host)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--length", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--max-positions", type=int, default=32768, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args)
        return

    import torch
    from common import MEDIUM_32K, build_llama_cpp, gguf_of, machine, random_llama

    model = random_llama("medium-32k", getattr(torch, args.dtype))
    bench = gguf = None
    skipped = ""
    if args.device == "cuda":
        skipped = "llama.cpp skipped (run on the CPU only)"
    elif args.llama_cpp is not None:
        root = args.llama_cpp.expanduser()
        bench = root / "build" / "bin" / "llama-bench"
        if not bench.exists() and args.build:
            bench = build_llama_cpp(root) / "llama-bench"
        if bench.exists():
            gguf = gguf_of(model, root)
        else:
            skipped = f"llama.cpp skipped: no {bench} (build it with --build)"
            bench = None
    else:
        skipped = "llama.cpp skipped (no --llama-cpp DIR)"
    if skipped:
        print(skipped, flush=True)
    print(machine(args.device), flush=True)
    rates = [gemm_rate(args.device)]
    print(f"bf16 GEMM: {rates[0] / 1e9:.0f} GFLOP/s", flush=True)
    runs: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        for n in args.lengths:
            for path in [*args.paths, *(["llama.cpp"] if bench else [])]:
                if path == "llama.cpp":
                    assert bench is not None and gguf is not None
                    r = llama_cpp_prefill(bench, gguf, n)
                else:
                    r = measure(path, n, model, args.dtype, args.device)
                r["round"] = rnd
                r["flops"] = prefill_flops(n, MEDIUM_32K)
                runs.append(r)
                mem = (
                    f", memory +{r['growth_mb']:.0f} MB (KV {r['kv_mb']:.0f} MB)"
                    if "growth_mb" in r
                    else ""
                )
                print(
                    f"round {rnd} {n:>6} tokens {path:>9}: TTFT {r['ttft_s']:8.2f} s, "
                    f"{r['tokens_per_s']:7.1f} tok/s{mem}",
                    flush=True,
                )
    rates.append(gemm_rate(args.device))
    gemm = max(rates)
    print(f"bf16 GEMM at the end: {rates[1] / 1e9:.0f} GFLOP/s", flush=True)
    table = report(runs, gemm, args.lengths)
    print(table)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {
            "date": date.today().isoformat(),
            "machine": machine(args.device),
            "note": args.note,
            "peer": skipped or "llama.cpp (llama-cpp-python 0.3.36 vendored), llama-bench -fa 1",
            "model": "medium random Llama, 494.7M parameters, 32k context (llama3 RoPE x8)",
            "dtype": args.dtype,
            "gemm_flops": rates,
            "runs": runs,
        }
        (args.out / "results.json").write_text(json.dumps(record, indent=1) + "\n")
        header = f"# Long-prompt prefill ({record['date']})\n\n{record['machine']}\n\n"
        notes = "".join(f"{line}\n\n" for line in (args.note, skipped) if line)
        (args.out / "results.md").write_text(header + notes + table + "\n")


def report(runs: list[dict[str, Any]], gemm: float, lengths: list[int]) -> str:
    """A markdown table: per length and path, the best TTFT of the rounds and its figures."""
    lines = [
        f"bf16 GEMM rate (best of the start and end): {gemm / 1e9:.0f} GFLOP/s",
        "",
        "| prompt | path | TTFT (s) | prefill tok/s | vs old | vs llama.cpp | of GEMM rate "
        "| memory growth (KV) |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for n in lengths:
        best: dict[str, dict[str, Any]] = {}
        for r in runs:
            if r["length"] == n and (
                r["path"] not in best or r["ttft_s"] < best[r["path"]]["ttft_s"]
            ):
                best[r["path"]] = r
        for path, r in best.items():
            old = best.get("old")
            peer = best.get("llama.cpp")
            vs_old = f"{old['ttft_s'] / r['ttft_s']:.2f}x" if old else "-"
            vs_peer = f"{peer['ttft_s'] / r['ttft_s']:.2f}x" if peer else "-"
            frac = r["flops"] / r["ttft_s"] / gemm
            mem = f"{r['growth_mb']:.0f} MB ({r['kv_mb']:.0f} MB)" if "growth_mb" in r else "-"
            lines.append(
                f"| {n} | {path} | {r['ttft_s']:.2f} | {r['tokens_per_s']:.1f} | {vs_old} "
                f"| {vs_peer} | {frac:.0%} | {mem} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
