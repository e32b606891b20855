"""State-space and hybrid models against llama.cpp (issue 49): batch-1 decode after a short and
a long context, 1k- and 8k-token prefill, foudre's 32-request throughput, and the memory a
request holds at 8k tokens beside a Llama of the same size; foudre and ``llama-bench`` in turns.

Three random-weight models of about 0.5B parameters, built once by ``transformers`` from a
config (no network; ``MODELS``) and cached under ``common.CACHE / "recurrent"``:

- ``mamba2``: ``Mamba2ForCausalLM``, hidden 1280, 40 layers, 40 heads of 64, d_state 128, one
  group (491M; between the shapes of mamba2-370m and mamba2-780m);
- ``hybrid``: a Granite-4.0-H-style ``GraniteMoeHybridForCausalLM`` with no experts (the dense
  shared MLP), 36 layers of which 6 attention (one in six, no positions as Granite 4.0 has
  them), the others Mamba-2 (hidden 1024, 32 heads of 64, d_state 128; 505M);
- ``llama``: the 494.7M Llama of ``common.MEDIUM`` with its context raised to 16k: the
  transformer of the same size, for the flat-decode and memory comparisons;
- ``falcon_h1`` (on request: ``--models falcon_h1``): ``FalconH1ForCausalLM`` of Falcon-H1-0.5B's
  shape (hidden 1024, 36 layers each with attention, 8 heads of 64, 2 KV heads, beside a Mamba-2
  mixer of 24 heads of 64, d_state 128, and a 2048-wide MLP; 519M), transformers' muP
  multipliers at their defaults.

llama.cpp converts each with its own converter (``common.gguf_of``: bf16, the Llama 2
sentencepiece vocabulary its 32,000 ids stand for; ``mamba2`` and ``granitehybrid`` GGUFs).
Each round, per model: foudre in a fresh process (``common.run_child``; bf16, prefix caching
off, as llama-bench has none), then ``llama-bench`` (``-fa 1``, every core). foudre:

- decode after ``DECODE_CONTEXT`` (128) tokens: ``bench.quant.decode_speed`` (a warm-up
  request, then one 128-token prompt and ``--decode-tokens`` greedy tokens, each step timed);
- prefill of ``--short`` (1024) tokens: ``short`` over the median TTFT of two prompts after a
  warm-up one;
- one prompt of ``--long`` (8192) tokens then ``--decode-tokens`` tokens: its TTFT gives the
  long prefill, its decode steps the decode after a long context;
- throughput: ``--batch`` (32) concurrent random prompts of ``--batch-input`` (512) tokens,
  ``--batch-output`` (128) tokens each (``bench.quant.batch_throughput``; foudre only);
- memory a request holds at ``--long`` tokens, from the engine's metrics:
  ``state_bytes_per_request`` + ``kv_bytes_per_token`` x ``long`` (the attention layers'
  K/V); beside what the config implies (``implied_memory``).

llama.cpp: ``-n <decode tokens> -d 128,<long> -r 2`` (decode at both depths; the depth's
prefill is not timed, and is cached between repetitions) and, for the state-space models,
``-p 128,<short>,<long> -r 1 --no-warmup`` (prefill; its own warm-up would run each prompt
twice: the first, 128-token test warms it up instead and is dropped). The Llama's prefill is
not measured (its long prefill is the TTFT of foudre's long-context decode, recorded).

Targets (issue 49): Mamba-2 and the hybrid >= 1.0x llama.cpp in decode (both contexts) and
prefill (both lengths); Mamba-2's decode after ``long`` within 10% of its decode after 128
tokens (>= 0.9), where the Llama's slows down (reported); memory per request at ``long``
reported beside the Llama's.

``--profile`` runs one more child on the Mamba-2 model: ``torch.profiler`` and ``cProfile``
over ``--profile-steps`` batch-1 decode steps after a 128-token prompt, the top operators and
Python functions by their own time (``profile.txt`` in ``--out``), on ``--profile-threads``
(1: on a shared host a thread that waits for a descheduled peer would charge the wait to
whichever small operator it was in).

    .venv/bin/python benchmarks/recurrent.py [--quick] [--rounds 2] [--models mamba2 hybrid llama]
        [--llama-cpp ~/.cache/foudre-bench/llama.cpp] [--out DIR] [--profile] [--note TEXT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from datetime import date
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
# this checkout's foudre, not whichever one the environment has installed
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
DECODE_CONTEXT = 128
PREFILL_PROMPTS = 2  # after a warm-up one
TARGET = 1.0
FLAT_TARGET = 0.9

_COMMON: dict[str, Any] = dict(
    vocab_size=32000, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False
)
_MAMBA: dict[str, Any] = dict(
    mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2, mamba_d_head=64
)
# name -> (model_type, config keys)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "mamba2": (
        "mamba2",
        dict(
            _COMMON,
            hidden_size=1280,
            num_hidden_layers=40,
            num_heads=40,
            head_dim=64,
            state_size=128,
            n_groups=1,
            expand=2,
            conv_kernel=4,
            chunk_size=256,
            # (the model has no limit; its config names one for the 8k measurements)
            max_position_embeddings=16384,
        ),
    ),
    "hybrid": (
        "granitemoehybrid",
        dict(
            _COMMON,
            **_MAMBA,
            hidden_size=1024,
            num_hidden_layers=36,
            layer_types=["attention" if i % 6 == 5 else "mamba" for i in range(36)],
            num_attention_heads=16,
            num_key_value_heads=4,
            num_local_experts=0,
            num_experts_per_tok=0,
            # the dense MLP's width, as Granite 4.0-H-Micro gives both (llama.cpp reads it)
            intermediate_size=2048,
            shared_intermediate_size=2048,
            mamba_n_heads=32,
            max_position_embeddings=16384,
            rms_norm_eps=1e-5,
        ),
    ),
    "llama": (
        "llama",
        dict(
            _COMMON,
            hidden_size=1536,
            intermediate_size=4096,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            max_position_embeddings=16384,
            rms_norm_eps=1e-5,
        ),
    ),
}
MODELS["falcon_h1"] = (
    "falcon_h1",
    dict(
        _COMMON,
        **_MAMBA,
        hidden_size=1024,
        num_hidden_layers=36,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=2048,
        mamba_d_ssm=1536,
        mamba_n_heads=24,
        max_position_embeddings=16384,
        rms_norm_eps=1e-5,
    ),
)
DEFAULT_MODELS = ["mamba2", "hybrid", "llama"]
# --quick: the same models, tiny (a vocabulary of 32,000 still, for the tokenizer)
_TINY: dict[str, dict[str, Any]] = {
    "mamba2": dict(hidden_size=128, num_hidden_layers=2, num_heads=4, state_size=16),
    "hybrid": dict(
        hidden_size=128,
        num_hidden_layers=3,
        layer_types=["mamba", "attention", "mamba"],
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        shared_intermediate_size=256,
        mamba_n_heads=4,
        mamba_d_state=16,
    ),
    "llama": dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "falcon_h1": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        head_dim=32,
        intermediate_size=256,
        mamba_d_ssm=256,
        mamba_n_heads=4,
        mamba_d_state=16,
    ),
}
QUICK = dict(long=2048, short=256, decode_tokens=8, batch=32, batch_input=64, batch_output=16)


def model_config(name: str, quick: bool) -> tuple[str, dict[str, Any]]:
    model_type, kw = MODELS[name]
    return model_type, ({**kw, **_TINY[name]} if quick else kw)


def implied_memory(name: str, quick: bool) -> dict[str, int]:
    """What one request holds by the config (bf16 model, float32 SSM state): the state of every
    Mamba layer (``(d_conv - 1) x conv_dim`` of the convolution window, ``heads x head_dim x
    d_state`` of SSM state), and the K/V bytes per token of every attention layer."""
    model_type, c = model_config(name, quick)
    if model_type == "mamba2":
        mamba, attention = c["num_hidden_layers"], 0
        heads, head_dim, state = c["num_heads"], c["head_dim"], c["state_size"]
        inner, groups, conv = heads * head_dim, c["n_groups"], c["conv_kernel"]
    elif model_type == "granitemoehybrid":
        attention = c["layer_types"].count("attention")
        mamba = c["num_hidden_layers"] - attention
        heads, head_dim, state = c["mamba_n_heads"], c["mamba_d_head"], c["mamba_d_state"]
        inner, groups, conv = heads * head_dim, c["mamba_n_groups"], c["mamba_d_conv"]
    elif model_type == "falcon_h1":  # attention and a Mamba-2 mixer in every layer
        attention = mamba = c["num_hidden_layers"]
        heads, head_dim, state = c["mamba_n_heads"], c["mamba_d_head"], c["mamba_d_state"]
        inner, groups, conv = c["mamba_d_ssm"], c["mamba_n_groups"], c["mamba_d_conv"]
    else:
        mamba, attention = 0, c["num_hidden_layers"]
        heads = head_dim = state = inner = groups = conv = 0
    conv_dim = inner + 2 * groups * state
    per_layer = (conv - 1) * conv_dim * 2 + heads * head_dim * state * 4
    kv_head = c["hidden_size"] // c.get("num_attention_heads", 1)
    if model_type == "falcon_h1":
        kv_head = c["head_dim"]
    per_token = attention * 2 * c.get("num_key_value_heads", 0) * kv_head * 2
    return {"state_bytes_per_request": mamba * per_layer, "kv_bytes_per_token": per_token}


def kv_cache_memory(name: str, quick: bool, args: argparse.Namespace) -> int:
    """A KV budget that holds ``batch`` requests' state slots (with ``state_plan``'s half of
    the budget for them) and the K/V of the larger of the runs' token counts."""
    mem = implied_memory(name, quick)
    states = 2 * (args.batch + 2) * mem["state_bytes_per_request"]
    tokens = max(args.batch * (args.batch_input + args.batch_output), args.long) + 64 * 16
    return states + 2 * tokens * mem["kv_bytes_per_token"] + (64 << 20)


def child(args: argparse.Namespace) -> None:
    """One model's foudre measurements in this process: prints one JSON line."""
    import time

    import torch
    from common import weight_bytes

    from foudre import LLM
    from foudre.bench.offline import peak_rss_bytes, random_prompts, timed_batch
    from foudre.bench.quant import batch_throughput, decode_speed

    torch.manual_seed(0)
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    n = args.decode_tokens
    t = time.perf_counter()
    llm = LLM(
        args.model,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=args.long + n + 16,
        max_num_seqs=args.batch,
        enable_prefix_caching=False,
        kv_cache_memory=args.kv_cache_memory,
    )
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    out: dict[str, Any] = {"load_s": time.perf_counter() - t}
    out["weight_bytes"] = weight_bytes(engine.runner.model)
    m = engine.metrics()
    for key in ("state_bytes_per_request", "kv_bytes_per_token", "num_state_slots"):
        out[key] = m[key]
    out["memory_at_long"] = m["state_bytes_per_request"] + m["kv_bytes_per_token"] * args.long
    speed = decode_speed(llm, DECODE_CONTEXT, n, seed=1)
    out["decode_tps"] = speed["decode_tps"]
    out["decode_median_tps"] = 1e3 / speed["tpot_median_ms"]
    if args.prefill:
        prompts = random_prompts(PREFILL_PROMPTS + 1, args.short, vocab, 7)
        ttfts = [timed_batch(engine, [p], 1)[0][0] for p in prompts]
        out["prefill_short_ttfts"] = ttfts[1:]
        out["prefill_short_tps"] = args.short / statistics.median(ttfts[1:])
    (ttft,), decode = timed_batch(engine, random_prompts(1, args.long, vocab, 11), n)
    out["prefill_long_tps"] = args.long / ttft
    out["decode_long_tps"] = len(decode) / sum(decode)
    out["decode_long_median_tps"] = 1 / statistics.median(decode)
    if args.batch > 1:
        r = batch_throughput(llm, args.batch, args.batch_input, args.batch_output, seed=3)
        out["throughput_tps"] = r["throughput_tps"]
    out["peak_rss_bytes"] = peak_rss_bytes()
    print(json.dumps(out), flush=True)


def child_args(args: argparse.Namespace, name: str, model: Path, quick: bool) -> tuple[str, ...]:
    """The child's command line for model ``name``."""
    keys = ("long", "short", "decode_tokens", "batch", "batch_input", "batch_output")
    out = ["--model", str(model), "--kv-cache-memory", str(kv_cache_memory(name, quick, args))]
    for key in keys:
        value = getattr(args, key)
        if key == "batch" and args.throughput_models is not None:
            value = value if name in args.throughput_models else 1  # 1: no throughput run
        out += [f"--{key.replace('_', '-')}", str(value)]
    if name != "llama":
        out.append("--prefill")
    if args.threads:
        out += ["--threads", str(args.threads)]
    return tuple(out)


def foudre_run(args: argparse.Namespace, name: str, model: Path, quick: bool) -> dict[str, Any]:
    from common import run_child

    return run_child(__file__, *child_args(args, name, model, quick), what=f"foudre {name}")


def llama_cpp_run(
    bench: Path, gguf: Path, args: argparse.Namespace, prefill: bool
) -> dict[str, Any]:
    """llama-bench's decode at depths 128 and ``long``, and (``prefill``) its prefill of
    ``short`` and ``long`` tokens; a run that dies of a signal runs again with ``--repack 0``
    (``common.llama_bench_retry``)."""
    from common import llama_bench_retry

    no_repack: list[str] = []
    rows = llama_bench_retry(
        bench,
        gguf,
        "decode",
        no_repack,
        generate=args.decode_tokens,
        depths=(DECODE_CONTEXT, args.long),
        repeats=3,
        threads=args.threads,
    )
    by_depth = {int(r["n_depth"]): r for r in rows}
    short, long = by_depth[DECODE_CONTEXT], by_depth[args.long]
    out: dict[str, Any] = {
        "decode_tps": float(short["avg_ts"]),
        "decode_long_tps": float(long["avg_ts"]),
        # its best repetition (llama-bench's threads wait on each other at every operation:
        # a repetition that another process interrupts can run several times slower)
        "decode_best_tps": max(map(float, short["samples_ts"])),
        "decode_long_best_tps": max(map(float, long["samples_ts"])),
        "no_repack": no_repack,
    }
    if prefill:
        rows = llama_bench_retry(
            bench,
            gguf,
            "prefill",
            no_repack,
            prompts=(128, args.short, args.long),
            repeats=1,
            warmup=False,
            threads=args.threads,
        )
        by_len = {int(r["n_prompt"]): float(r["avg_ts"]) for r in rows}
        out["prefill_short_tps"] = by_len[args.short]
        out["prefill_long_tps"] = by_len[args.long]
    return out


def profile_child(args: argparse.Namespace) -> None:
    """Where batch-1 decode's time goes: a 128-token prompt, then ``profile_steps`` decode
    steps under ``torch.profiler`` and as many under ``cProfile``; prints the two tables and
    a JSON line."""
    import cProfile
    import io
    import pstats

    import torch

    from foudre import LLM
    from foudre.bench.offline import random_prompts
    from foudre.sampling_params import SamplingParams

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    llm = LLM(
        args.model,
        dtype="bfloat16",
        skip_tokenizer_init=True,
        max_model_len=4096,
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    steps = args.profile_steps
    params = SamplingParams(temperature=0.0, max_tokens=3 * steps + 8, ignore_eos=True)
    engine.add_request(
        random_prompts(1, DECODE_CONTEXT, engine.model_config.vocab_size, 5)[0], params
    )
    for _ in range(steps + 2):  # the prefill, then warm decode steps
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            engine.step()
    ops = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        engine.step()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(30)
    text = (
        f"torch.profiler over {steps} decode steps (self CPU time):\n{ops}\n\n"
        f"cProfile over {steps} decode steps (own time):\n{buf.getvalue()}"
    )
    print(json.dumps({"profile": text}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, short contexts, 1 round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=DEFAULT_MODELS, choices=MODELS)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--long", type=int, default=8192, help="the long context and prefill")
    ap.add_argument("--short", type=int, default=1024, help="the short prefill")
    ap.add_argument("--batch", type=int, default=32, help="concurrent requests (throughput)")
    ap.add_argument("--batch-input", type=int, default=512)
    ap.add_argument("--batch-output", type=int, default=128)
    ap.add_argument(
        "--throughput-models", nargs="*", choices=MODELS, help="the throughput's (default: all)"
    )
    ap.add_argument("--threads", type=int, help="threads of both (default: every core)")
    ap.add_argument("--profile", action="store_true", help="also profile Mamba-2's decode")
    ap.add_argument("--profile-steps", type=int, default=16)
    ap.add_argument(
        "--profile-threads", type=int, default=1, help="1: no thread stalls another's time"
    )
    ap.add_argument("--prepare", action="store_true", help="build and convert only")
    ap.add_argument("--profile-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kv-cache-memory", type=float, help=argparse.SUPPRESS)
    ap.add_argument("--prefill", action="store_true", help=argparse.SUPPRESS)
    sys.path.insert(0, str(HERE))
    from common import peer_options

    peer_options(ap)
    args = ap.parse_args()
    if args.profile_child:
        return profile_child(args)
    if args.child:
        return child(args)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
        args.rounds = 1
    run(args)


def hub_layer_types(model: Path) -> None:
    """Write a hybrid's ``layer_types`` as its checkpoints on the hub spell them ("mamba",
    "attention"), which llama.cpp's converter reads, where transformers saved its own names
    ("linear_attention", "full_attention": the converter then sees no attention layer)."""
    path = model / "config.json"
    raw = json.loads(path.read_text())
    if "layer_types" in raw:
        names = {"linear_attention": "mamba", "full_attention": "attention"}
        raw["layer_types"] = [names.get(t, t) for t in raw["layer_types"]]
        path.write_text(json.dumps(raw, indent=2) + "\n")


def prepare(args: argparse.Namespace, errors: dict[str, str]) -> tuple[dict[str, Path], ...]:
    """Each model built and converted (cached); a failure recorded in ``errors``."""
    from common import CACHE, gguf_of, random_model

    store = CACHE / "recurrent"
    store.mkdir(parents=True, exist_ok=True)
    root = args.llama_cpp.expanduser()
    models: dict[str, Path] = {}
    ggufs: dict[str, Path] = {}
    for name in args.models:
        try:
            path = store / f"{name}{'-tiny' if args.quick else ''}"
            models[name] = random_model(*model_config(name, args.quick), path)
            hub_layer_types(models[name])
            ggufs[name] = gguf_of(models[name], root, out_dir=models[name].parent)
        except Exception as e:  # recorded, the run goes on
            errors[f"{name} build/convert"] = f"{type(e).__name__}: {e}"[-1500:]
            print(f"{name}: {errors[f'{name} build/convert']}", flush=True)
    return models, ggufs


def run(args: argparse.Namespace) -> None:
    import torch
    from common import machine, recorded, run_child

    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    bench = args.llama_cpp.expanduser() / "build" / "bin" / "llama-bench"
    if not bench.exists():
        raise SystemExit(f"no llama-bench in {bench.parent}")
    errors: dict[str, str] = {}
    models, ggufs = prepare(args, errors)
    if args.prepare:
        return
    print(machine(), flush=True)
    runs: list[dict[str, Any]] = []

    def attempt(rnd: int, name: str, who: str, fn: Any, *a: Any) -> None:
        key = f"round {rnd} {name} {who}"
        r = recorded(runs, errors, key, {"round": rnd, "model": name, "who": who}, fn, *a)
        if r is not None:
            figures = ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k.endswith("_tps"))
            print(f"{key:>26}: {figures}", flush=True)

    profile = ""
    for rnd in range(args.rounds):
        for name in args.models:
            if name not in ggufs:
                continue
            attempt(rnd, name, "foudre", foudre_run, args, name, models[name], args.quick)
            prefill = name != "llama"
            attempt(rnd, name, "llama.cpp", llama_cpp_run, bench, ggufs[name], args, prefill)
            # a record after each model: what finished stands if the run is cut short
            table, targets = report(runs, args)
            if args.out is not None:
                write_record(args, runs, targets, table, errors, profile, rnd + 1)
        if args.profile and rnd == 0 and "mamba2" in models:
            try:
                cmd: tuple[str, ...] = (
                    "--model",
                    str(models["mamba2"]),
                    "--profile-steps",
                    str(args.profile_steps),
                )
                cmd += ("--threads", str(args.profile_threads))
                profile = run_child(__file__, "--profile-child", *cmd, what="profile")["profile"]
            except (Exception, SystemExit) as e:
                errors["mamba2 profile"] = f"{type(e).__name__}: {e}"[-1500:]
        table, targets = report(runs, args)
        if args.out is not None:
            write_record(args, runs, targets, table, errors, profile, rnd + 1)
    print(table)
    if profile:
        print(profile)
    for key, err in errors.items():
        print(f"failed: {key}: {err.strip().splitlines()[-1] if err.strip() else ''}")


def med(runs: list[dict[str, Any]], name: str, who: str, key: str) -> float:
    """The median over rounds of ``key`` for ``name`` measured by ``who`` (nan if none)."""
    values = [r[key] for r in runs if (r["model"], r["who"]) == (name, who) and key in r]
    return statistics.median(values) if values else float("nan")


def report(
    runs: list[dict[str, Any]], args: argparse.Namespace
) -> tuple[str, list[dict[str, Any]]]:
    """Markdown tables of the rounds' medians, and the targets checked."""
    long, short = args.long, args.short
    cols = [
        ("decode_tps", f"decode @{DECODE_CONTEXT}"),
        ("decode_long_tps", f"decode @{long}"),
        ("prefill_short_tps", f"prefill {short}"),
        ("prefill_long_tps", f"prefill {long}"),
    ]

    def cell(value: float, ref: float, fmt: str = ".1f") -> str:
        if value != value:
            return "-"
        return f"{value:{fmt}}" + (f" ({value / ref:.2f}x)" if ref == ref else "")

    lines = [
        "| model | who | "
        + " | ".join(f"{c} tok/s (vs llama.cpp)" for _, c in cols)
        + f" | decode @{long} / @{DECODE_CONTEXT} | {args.batch} requests tok/s |",
        "| --- | --- |" + " ---: |" * (len(cols) + 2),
    ]
    targets: list[dict[str, Any]] = []
    for name in args.models:
        refs = {key: med(runs, name, "llama.cpp", key) for key, _ in cols}
        for who in ("foudre", "llama.cpp"):
            vals = {key: med(runs, name, who, key) for key, _ in cols}
            flat = vals["decode_long_tps"] / vals["decode_tps"]
            cells = [name, who] + [cell(vals[k], refs[k]) for k, _ in cols]
            cells += [
                cell(flat, float("nan"), ".2f"),
                cell(med(runs, name, who, "throughput_tps"), float("nan")),
            ]
            lines.append("| " + " | ".join(cells) + " |")
            if who == "foudre" and name == "mamba2":
                targets.append(
                    {
                        "target": f"mamba2 decode @{long} / @{DECODE_CONTEXT} (foudre)",
                        "value": flat,
                        "goal": FLAT_TARGET,
                        "met": flat >= FLAT_TARGET,
                    }
                )
        if name == "llama":
            continue
        for key, label in cols:
            value = med(runs, name, "foudre", key) / refs[key]
            targets.append(
                {
                    "target": f"{name} {label} / llama.cpp",
                    "value": value,
                    "goal": TARGET,
                    "met": value >= TARGET,
                }
            )
    lines += [
        "",
        *median_table(runs, args),
        "",
        *memory_table(runs, args),
        "",
        "| target | value | goal | met |",
        "| --- | ---: | ---: | --- |",
    ]
    for t in targets:
        shown = "failed" if t["value"] != t["value"] else f"{t['value']:.3f}"
        lines.append(
            f"| {t['target']} | {shown} | >= {t['goal']:.2f} | {'yes' if t['met'] else 'NO'} |"
        )
    return "\n".join(lines), targets


def median_table(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """Decode on a shared host, robust figures: foudre's from its median step, llama.cpp's
    from its best repetition (a step or repetition that another process stalls weighs on the
    means of the first table, not on these; the best of three flatters llama.cpp)."""
    lines = [
        f"| model | decode @{DECODE_CONTEXT}: foudre median step / llama.cpp best rep tok/s "
        f"| ratio | decode @{args.long}: foudre median step / llama.cpp best rep tok/s | ratio |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for name in args.models:
        cells = [name]
        for key in ("decode", "decode_long"):
            a = med(runs, name, "foudre", f"{key}_median_tps")
            b = med(runs, name, "llama.cpp", f"{key}_best_tps")
            cells += [f"{a:.1f} / {b:.1f}", f"{a / b:.2f}x"]
        if "nan" not in cells[1]:  # not measured (yet): no row
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def memory_table(runs: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    """What a request holds at ``long`` tokens per model (foudre's metrics, the config's
    figure beside), and its ratio to the Llama's."""
    lines = [
        f"| model | state bytes / request | KV bytes / token | memory / request @{args.long} "
        f"| vs the Llama | implied by the config (state, KV / token) |",
        "| --- | ---: | ---: | ---: | ---: | --- |",
    ]
    llama = med(runs, "llama", "foudre", "memory_at_long")
    for name in args.models:
        mem = med(runs, name, "foudre", "memory_at_long")
        if mem != mem:
            continue
        want = implied_memory(name, args.quick)
        state = med(runs, name, "foudre", "state_bytes_per_request")
        kv = med(runs, name, "foudre", "kv_bytes_per_token")
        lines.append(
            f"| {name} | {state:,.0f} | {kv:,.0f} | {mem / 2**20:,.1f} MiB | "
            + (f"{mem / llama:.2f}x" if llama == llama else "-")
            + f" | {want['state_bytes_per_request']:,}, {want['kv_bytes_per_token']:,} |"
        )
    return lines


def write_record(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    targets: list[dict[str, Any]],
    table: str,
    errors: dict[str, str],
    profile: str,
    rounds: int,
) -> None:
    from common import machine

    args.out.mkdir(parents=True, exist_ok=True)
    rec = {
        "date": date.today().isoformat(),
        "machine": machine(),
        "command": "python benchmarks/recurrent.py " + " ".join(sys.argv[1:]),
        "note": args.note,
        "peer": "llama.cpp (llama-cpp-python 0.3.36 vendored), llama-bench -fa 1, bf16 GGUF",
        "threads": args.threads or os.cpu_count(),
        "rounds": rounds,
        "lengths": {
            k: getattr(args, k)
            for k in ("long", "short", "decode_tokens", "batch", "batch_input", "batch_output")
        },
        "models": {name: model_config(name, args.quick) for name in args.models},
        "runs": runs,
        "targets": targets,
        "errors": errors,
    }
    (args.out / "results.json").write_text(json.dumps(rec, indent=1) + "\n")
    if profile:
        (args.out / "profile.txt").write_text(profile + "\n")
    head = f"# State-space and hybrid models against llama.cpp ({rec['date']})\n\n"
    head += f"{rec['machine']}\n\nCommand: `{rec['command']}`\n\n"
    head += f"{args.note}\n\n" if args.note else ""
    tail = (
        "\n\nThe host's 1-minute load average as each measurement started (2 cores): "
        + ", ".join(
            f"round {r['round'] + 1} {r['model']} {r['who']} {r['load_avg']:.1f}" for r in runs
        )
        + "."
    )
    died = sorted({f"{r['model']} {m}" for r in runs for m in r.get("no_repack", [])})
    if died:
        tail += (
            "\n\nllama.cpp died of a signal with its extra buffer types (AMX) on: "
            + ", ".join(died)
            + "; those ran with `--repack 0` (its AVX-512 kernels)."
        )
    if errors:
        tail += "\n\nFailures (recorded, not measured):\n\n" + "\n".join(
            f"- {k}: `{v.strip().splitlines()[-1] if v.strip() else v}`" for k, v in errors.items()
        )
    (args.out / "results.md").write_text(head + table + tail + "\n")


if __name__ == "__main__":
    main()
