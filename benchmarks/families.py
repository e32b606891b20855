"""The model families against llama.cpp: batch-1 decode and 512-token prefill of random-weight
models of each family, foudre and ``llama-bench`` in turns, at bf16, 8 bits and (gpt-oss) MXFP4.

Each family is a random-weight model of about 0.5B parameters built by ``transformers`` from a
config (no network; ``FAMILIES``): Llama (the reference, ``common.MEDIUM``), Gemma 3, Phi-3
(its padded vocabulary of 32,064), Qwen3, and gpt-oss and DeepSeek-V3 as small mixtures of
experts of a similar active size (16 experts, 4 a token). llama.cpp converts each with its own
converter (``convert_hf_to_gguf.py``, bf16; the vocabulary is the Llama 2 sentencepiece one
its 32,000 ids stand for, which the converter's BPE families (Qwen3, gpt-oss, DeepSeek) are
made to write as sentencepiece: the tokenizer does not enter a measurement), then quantizes
that with ``llama-quantize`` to Q8_0, and for gpt-oss to MXFP4_MOE (experts MXFP4, the rest
Q8_0). Precisions, foudre's configuration against llama.cpp's file:

- bf16: the safetensors checkpoint, ``dtype="bfloat16"``, against the bf16 GGUF;
- int8: ``quantization="int8"`` (per channel, gpt-oss's experts included) against Q8_0; and
  foudre on the Q8_0 GGUF file itself;
- mxfp4 (gpt-oss): the experts MXFP4 (``quant.MXFP4``) and the other linears int8, as the
  MXFP4_MOE file keeps them, against that file; and foudre on the file itself.

Each foudre configuration runs in a fresh process (``common.run_child``): batch-1 decode (a
128-token prompt then ``--decode-tokens`` greedy tokens, each step timed, after a warm-up
request; the median of two passes) and prefill (512 over the median TTFT of two 512-token
prompts after a warm-up one); foudre on a GGUF file runs in the first ``--gguf-rounds`` rounds
only (1: time). llama.cpp: ``llama-bench -fa 1 -t <cores>``, ``-n <decode tokens> -r 2`` (tg,
from an empty context, where foudre's decode follows a 128-token prompt) and ``-p 512 -r 2``
(pp). A family that fails to build, convert, load or run on one side is recorded with its
error, and the run goes on; the record is written after each round.

Also (no model): DeepSeek's latent cache against plain KV, in bytes per token at DeepSeek-V3's
real dimensions, from foudre's cache spec (``LatentAttentionSpec``) and what full attention
would keep per head (K of ``qk_nope + qk_rope`` values, V of ``v_head_dim``).

Targets (issue 50): every family >= 1.0x llama.cpp in decode and prefill at each precision;
the latent cache <= 1/8 of plain KV's bytes per token.

    .venv/bin/python benchmarks/families.py [--quick] [--rounds 2] [--families llama gemma3 ...]
        [--llama-cpp ~/.cache/foudre-bench/llama.cpp] [--out DIR]
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
PREFILL_LEN = 512
PREFILL_PROMPTS = 2  # after a warm-up one
DECODE_PROMPT = 128
DECODE_PASSES = 2
PEER = {"bf16": "bf16", "int8": "Q8_0", "mxfp4": "MXFP4_MOE"}  # ours -> llama.cpp's file
TARGET = 1.0
LATENT_TARGET = 1 / 8
# DeepSeek-V3's (and R1's) attention, from its config.json
DEEPSEEK_V3_REAL = dict(
    num_attention_heads=128,
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    num_hidden_layers=61,
)

_COMMON: dict[str, Any] = dict(
    vocab_size=32000,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
_DENSE: dict[str, Any] = dict(
    _COMMON,
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
# model_type -> config keys (about 0.5B parameters; the MoE ones about 0.4B active)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", _DENSE),
    "gemma3": (
        "gemma3_text",
        dict(_DENSE, head_dim=96, sliding_window=512, tie_word_embeddings=True),
    ),
    "phi3": ("phi3", dict(_DENSE, vocab_size=32064, original_max_position_embeddings=4096)),
    "qwen3": ("qwen3", dict(_DENSE, head_dim=96)),
    "gpt_oss": (
        "gpt_oss",
        dict(
            _COMMON,
            hidden_size=1024,
            intermediate_size=1536,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            num_local_experts=16,
            num_experts_per_tok=4,
            sliding_window=128,
            tie_word_embeddings=False,
        ),
    ),
    "deepseek_v3": (
        "deepseek_v3",
        dict(
            _COMMON,
            hidden_size=1024,
            intermediate_size=2816,
            moe_intermediate_size=1024,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=16,
            q_lora_rank=384,
            kv_lora_rank=256,
            qk_nope_head_dim=64,
            qk_rope_head_dim=32,
            v_head_dim=64,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_shared_experts=1,
            first_k_dense_replace=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_scaling=None,
            tie_word_embeddings=False,
        ),
    ),
}
# --quick: the same families, tiny (a vocabulary of 32,000 still, for the tokenizer)
_TINY: dict[str, Any] = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
_TINY_EXTRA: dict[str, dict[str, Any]] = {
    "gemma3": dict(head_dim=32, sliding_window=64),
    "qwen3": dict(head_dim=32),
    "gpt_oss": dict(head_dim=32, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": dict(
        num_key_value_heads=4,
        moe_intermediate_size=128,
        q_lora_rank=64,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
    ),
}


def family_config(family: str, quick: bool) -> tuple[str, dict[str, Any]]:
    model_type, kw = FAMILIES[family]
    if quick:
        kw = {**kw, **_TINY, **_TINY_EXTRA.get(family, {})}
    return model_type, kw


def random_family(family: str, quick: bool, root: Path) -> Path:
    """A random-weight model of ``family`` saved as bf16 safetensors under ``root`` (built once
    by ``transformers`` from its config, then cached)."""
    sys.path.insert(0, str(HERE))
    from common import random_model

    return random_model(*family_config(family, quick), root / f"{family}{'-tiny' if quick else ''}")


def convert(model: Path, llama_cpp: Path, quant: str) -> Path:
    """``model`` as GGUF beside it (``common.gguf_of``: bf16 by llama.cpp's converter with
    the Llama 2 sentencepiece vocabulary, then ``llama-quantize`` to ``quant``); cached."""
    sys.path.insert(0, str(HERE))
    from common import gguf_of

    return gguf_of(model, llama_cpp, quant, out_dir=model.parent)


def _mxfp4_with_int8(method: str) -> None:
    """``quantization="mxfp4"`` as the MXFP4_MOE file has it: the routed experts MXFP4 and the
    other linears (the head included) int8 per channel, in place of the experts alone."""
    import foudre.loading.loader as loader
    from foudre.quant import MXFP4, Int8WeightOnly
    from foudre.quant.api import SKIP, quantize_

    def quantize_model(model: Any, method: str, calibration: Any = None) -> None:
        plan = {"*experts": MXFP4(), "lm_head": Int8WeightOnly(), "*": Int8WeightOnly()}
        quantize_(model, plan, skip=[p for p in SKIP if p != "lm_head"])

    if method == "mxfp4":
        loader.quantize_model = quantize_model  # type: ignore[assignment]


def child(args: argparse.Namespace) -> None:
    """One foudre configuration in this process: prints one JSON line."""
    import time

    import torch

    sys.path.insert(0, str(HERE))
    from common import weight_bytes

    from foudre import LLM
    from foudre.bench.offline import random_prompts, timed_batch
    from foudre.bench.quant import decode_speed

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    quantization = None if args.quantization == "none" else args.quantization
    _mxfp4_with_int8(args.quantization)
    t = time.perf_counter()
    llm = LLM(
        args.model,
        dtype="bfloat16",
        quantization=quantization,
        skip_tokenizer_init=True,
        max_model_len=4096,
    )
    out: dict[str, Any] = {"load_s": time.perf_counter() - t}
    engine = llm.engine
    out["weight_bytes"] = weight_bytes(engine.runner.model)
    passes = [
        decode_speed(llm, DECODE_PROMPT, args.decode_tokens, seed=1 + i)["decode_tps"]
        for i in range(DECODE_PASSES)
    ]
    out["decode_passes"] = passes
    out["decode_tps"] = statistics.median(passes)
    prompts = random_prompts(PREFILL_PROMPTS + 1, PREFILL_LEN, engine.model_config.vocab_size, 7)
    ttfts = [timed_batch(engine, [prompt], 1)[0][0] for prompt in prompts]
    out["prefill_ttfts"] = ttfts[1:]
    out["prefill_tps"] = PREFILL_LEN / statistics.median(ttfts[1:])
    print(json.dumps(out), flush=True)


def foudre_run(model: Path, quantization: str, decode_tokens: int) -> dict[str, Any]:
    from common import run_child

    args = ("--model", str(model), "--quantization", quantization)
    args += ("--decode-tokens", str(decode_tokens))
    return run_child(__file__, *args, what=f"foudre {model.name} {quantization}")


def llama_cpp_run(bench: Path, gguf: Path, decode_tokens: int) -> dict[str, Any]:
    """llama-bench's decode and prefill on ``gguf``; a measurement that dies of a signal (its
    AMX kernels on a prompt of a Q8_0 file, on this Intel Xeon: ``common.NO_AMX``) runs again
    with ``--repack 0`` (no extra buffer types: its AVX-512 kernels), listed in ``no_repack``."""
    from common import llama_bench_retry

    no_repack: list[str] = []

    def tps(name: str, **kw: Any) -> float:
        return float(llama_bench_retry(bench, gguf, name, no_repack, **kw)[0]["avg_ts"])

    return {
        "decode_tps": tps("decode", generate=decode_tokens, repeats=DECODE_PASSES),
        "prefill_tps": tps("prefill", prompts=(PREFILL_LEN,), repeats=PREFILL_PROMPTS),
        "no_repack": no_repack,
    }


def latent_cache() -> dict[str, Any]:
    """DeepSeek-V3's latent cache against plain KV, bytes per token (bf16, all layers), from
    foudre's cache spec at the real dimensions."""
    import torch

    from foudre.attention.cache_spec import LatentAttentionSpec

    d = DEEPSEEK_V3_REAL
    spec = LatentAttentionSpec(d["kv_lora_rank"], d["qk_rope_head_dim"])
    latent = spec.bytes_per_token(torch.bfloat16) * d["num_hidden_layers"]
    per_head = d["qk_nope_head_dim"] + d["qk_rope_head_dim"] + d["v_head_dim"]
    plain = d["num_attention_heads"] * per_head * 2 * d["num_hidden_layers"]
    return {"latent_bytes": latent, "plain_bytes": plain, "ratio": latent / plain, "dims": d}


def plan(families: list[str]) -> list[tuple[str, str]]:
    """(family, precision) pairs measured each round."""
    pairs = []
    for family in families:
        for precision in ("bf16", "int8", "mxfp4"):
            if precision == "mxfp4" and family != "gpt_oss":
                continue
            pairs.append((family, precision))
    return pairs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny models, one round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    ap.add_argument("--decode-tokens", type=int, default=48)
    ap.add_argument(
        "--gguf-rounds", type=int, default=1, help="rounds that also run foudre on the GGUF files"
    )
    ap.add_argument("--prepare", action="store_true", help="build and convert only")
    ap.add_argument("--quantization", help=argparse.SUPPRESS)
    sys.path.insert(0, str(HERE))
    from common import peer_options

    peer_options(ap)
    args = ap.parse_args()
    if args.child:
        child(args)
        return
    import torch

    sys.path.insert(0, str(HERE))
    from common import CACHE, machine, recorded

    torch.set_num_threads(os.cpu_count() or 1)
    root = args.llama_cpp.expanduser()
    bench = root / "build" / "bin" / "llama-bench"
    if not bench.exists() or not (bench.parent / "llama-quantize").exists():
        raise SystemExit(f"no llama-bench / llama-quantize in {bench.parent}")
    rounds = 1 if args.quick else args.rounds
    n = 16 if args.quick else args.decode_tokens  # decode tokens
    store = CACHE / "families"
    store.mkdir(parents=True, exist_ok=True)
    errors: dict[str, str] = {}
    models: dict[str, Path] = {}
    ggufs: dict[tuple[str, str], Path] = {}
    pairs = plan(args.families)
    for family, precision in pairs:
        try:
            if family not in models:
                models[family] = random_family(family, args.quick, store)
            ggufs[family, precision] = convert(models[family], root, PEER[precision])
        except Exception as e:  # recorded, the run goes on
            errors[f"{family} {precision} build/convert"] = f"{type(e).__name__}: {e}"[-1500:]
            print(f"{family} {precision}: {errors[f'{family} {precision} build/convert']}")
    latent = latent_cache()
    if args.prepare:
        return
    print(machine(), flush=True)
    runs: list[dict[str, Any]] = []

    def attempt(rnd: int, family: str, precision: str, who: str, fn: Any, *a: Any) -> None:
        key = f"round {rnd} {family} {precision} {who}"
        tags = {"round": rnd, "family": family, "precision": precision, "who": who}
        r = recorded(runs, errors, key, tags, fn, *a)
        if r is not None:
            print(
                f"{key:>40}: decode {r['decode_tps']:7.1f} tok/s, "
                f"prefill {PREFILL_LEN} {r['prefill_tps']:7.0f} tok/s",
                flush=True,
            )

    for rnd in range(rounds):
        for family, precision in pairs:
            if (family, precision) not in ggufs:
                continue
            gguf = ggufs[family, precision]
            ours = "none" if precision == "bf16" else precision
            attempt(rnd, family, precision, "foudre", foudre_run, models[family], ours, n)
            if precision != "bf16" and rnd < args.gguf_rounds:
                attempt(rnd, family, precision, "foudre-gguf", foudre_run, gguf, "none", n)
            attempt(rnd, family, precision, "llama.cpp", llama_cpp_run, bench, gguf, n)
        # a record after each round: what finished stands if a later round cannot
        table, targets = report(runs, pairs, latent)
        if args.out is not None:
            write_record(args, runs, targets, table, errors, latent, rnd + 1)
    print(table)
    for key, err in errors.items():
        print(f"failed: {key}: {err.strip().splitlines()[-1] if err.strip() else ''}")


def cpu_flags() -> list[str]:
    """The CPU's flags (``/proc/cpuinfo``), as ``lscpu`` lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


def write_record(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    targets: list[dict[str, Any]],
    table: str,
    errors: dict[str, str],
    latent: dict[str, Any],
    rounds: int,
) -> None:
    from common import machine

    args.out.mkdir(parents=True, exist_ok=True)
    flags = cpu_flags()
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c"))]
    rec = {
        "date": date.today().isoformat(),
        "machine": machine() + "; SIMD flags: " + " ".join(simd),
        "cpu_flags": flags,
        "command": "python benchmarks/families.py " + " ".join(sys.argv[1:]),
        "note": args.note,
        "peer": "llama.cpp (llama-cpp-python 0.3.36 vendored), llama-bench -fa 1",
        "threads": os.cpu_count(),
        "rounds": rounds,
        "gguf_rounds": min(rounds, args.gguf_rounds),
        "models": {f: family_config(f, args.quick) for f in args.families},
        "runs": runs,
        "targets": targets,
        "latent_cache": latent,
        "errors": errors,
    }
    (args.out / "results.json").write_text(json.dumps(rec, indent=1) + "\n")
    head = f"# Model families against llama.cpp ({rec['date']})\n\n{rec['machine']}\n\n"
    head += f"Command: `{rec['command']}`\n\n" + (f"{args.note}\n\n" if args.note else "")
    tail = ""
    died = sorted(
        {f"{r['family']} {r['precision']} {m}" for r in runs for m in r.get("no_repack", [])}
    )
    if died:
        tail += (
            "\n\nllama.cpp died of a signal with its extra buffer types (AMX) on: "
            + ", ".join(died) + "; those ran with `--repack 0` (its AVX-512 kernels)."
        )  # fmt: skip
    if errors:
        tail += "\n\nFailures (recorded, not measured):\n\n" + "\n".join(
            f"- {k}: `{v.strip().splitlines()[-1] if v.strip() else v}`" for k, v in errors.items()
        )
    (args.out / "results.md").write_text(head + table + tail + "\n")


def report(
    runs: list[dict[str, Any]], pairs: list[tuple[str, str]], latent: dict[str, Any]
) -> tuple[str, list[dict[str, Any]]]:
    """A markdown table of the rounds' medians, and the targets checked."""

    def med(family: str, precision: str, who: str, key: str) -> float:
        values = [
            r[key]
            for r in runs
            if (r["family"], r["precision"], r["who"]) == (family, precision, who) and key in r
        ]
        return statistics.median(values) if values else float("nan")

    def cell(value: float, ref: float, fmt: str) -> str:
        if value != value:
            return "failed"
        ratio = f" ({value / ref:.2f}x)" if ref == ref else ""
        return f"{value:{fmt}}{ratio}"

    lines = [
        f"| family | precision | who | decode tok/s (vs llama.cpp) "
        f"| prefill {PREFILL_LEN} tok/s (vs llama.cpp) | weight MB |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    targets: list[dict[str, Any]] = []
    for family, precision in pairs:
        ref_d = med(family, precision, "llama.cpp", "decode_tps")
        ref_p = med(family, precision, "llama.cpp", "prefill_tps")
        for who in ("foudre", "foudre-gguf", "llama.cpp"):
            if who == "foudre-gguf" and precision == "bf16":
                continue
            label = {"foudre-gguf": f"foudre on the {PEER[precision]} GGUF"}.get(who, who)
            if who == "llama.cpp":
                label = f"llama.cpp {PEER[precision]}"
            wb = med(family, precision, who, "weight_bytes")
            cells = [
                family, precision, label,
                cell(med(family, precision, who, "decode_tps"), ref_d, ".1f"),
                cell(med(family, precision, who, "prefill_tps"), ref_p, ".0f"),
                "" if wb != wb else f"{wb / 2**20:.0f}",
            ]  # fmt: skip
            lines.append("| " + " | ".join(cells) + " |")
        for what, key, ref in (("decode", "decode_tps", ref_d), ("prefill", "prefill_tps", ref_p)):
            value = med(family, precision, "foudre", key) / ref
            name = f"{family} {precision} {what} / llama.cpp {PEER[precision]}"
            targets.append({"target": name, "value": value, "goal": TARGET,
                            "met": value >= TARGET})  # fmt: skip
    targets.append({
        "target": "DeepSeek-V3 latent cache / plain KV bytes per token",
        "value": latent["ratio"], "goal": LATENT_TARGET, "met": latent["ratio"] <= LATENT_TARGET,
    })  # fmt: skip
    lines += [
        "",
        f"DeepSeek-V3's latent cache at its real dimensions ({latent['dims']}): "
        f"{latent['latent_bytes']:,} bytes per token (bf16, all layers) against "
        f"{latent['plain_bytes']:,} for plain KV: {latent['ratio']:.4f} "
        f"(1/{1 / latent['ratio']:.0f}; target <= 1/8).",
        "",
        "| target | value | goal | met |",
        "| --- | ---: | ---: | --- |",
    ]
    for t in targets:
        value = "failed" if t["value"] != t["value"] else f"{t['value']:.3f}"
        goal = ("<= " if "latent" in t["target"] else ">= ") + f"{t['goal']:.3f}"
        lines.append(f"| {t['target']} | {value} | {goal} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines), targets


if __name__ == "__main__":
    main()
