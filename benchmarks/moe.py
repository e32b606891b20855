"""Mixture of experts against dense models: an MoE of about 1B total and 250M active parameters,
a dense model of the same active size and one of the same total size, foudre and Hugging Face
``transformers`` measured in the same run.

    .venv/bin/python benchmarks/moe.py [--dtype bfloat16] [--rounds 3] [--out results/moe.md]

Models (random weights, transformers' initialisation, cached under ``$FOUDRE_BENCH_CACHE``),
vocabulary 32,000, hidden 1,024, 16 layers, 16 heads, 4 KV heads:
- moe: Mixtral-style, 8 experts of intermediate 2,048, top-2 (renormalised): 912M total, a token
  reads 276M (attention, its two experts, the head);
- dense-active: Llama, intermediate 4,096 (two experts' worth): 309M, a token reads 276M;
- dense-total: Llama, intermediate 16,384 (all eight experts' worth): 912M, reads 879M.

Workloads (``core_throughput.py``'s): batch 1, a 128-token prompt and 128 greedy tokens
(decode tokens/s, median of ``--rounds``, each round every model in turn, HF then foudre); 64
requests with 128-token prompts and outputs uniform in 16..256 (useful tokens/s: foudre's
continuous batching, HF one padded static batch). The roofline fraction divides each batch-1
round's bytes per step by the faster of the fp32 matrix-vector bandwidths measured before and
after it; the bytes are the active ones (``bench/roofline.weight_bytes``: top_k / num_experts
of the routed experts). Targets (issue 19): MoE batch-1 decode within 1.3x of dense-active, and
70% of the active-bytes roofline.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
from pathlib import Path
from typing import Any

import torch
from common import CACHE, machine, measure_bandwidth, weight_bytes
from core_throughput import (
    _median,
    foudre_batch1,
    foudre_throughput,
    hf_batch1,
    hf_static,
    make_llm,
    workload,
)

from foudre.bench.roofline import matvec_probe

BASE: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=1024,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "moe": (
        "mixtral",
        dict(BASE, intermediate_size=2048, num_local_experts=8, num_experts_per_tok=2),
    ),
    "dense-active": ("llama", dict(BASE, intermediate_size=4096)),
    "dense-total": ("llama", dict(BASE, intermediate_size=16384)),
}


def build(name: str, dtype: torch.dtype) -> Path:
    """The model ``name`` saved as safetensors in ``dtype`` (built once, then cached)."""
    import transformers

    arch, cfg = MODELS[name]
    path = CACHE / f"moe-bench-{name}-{str(dtype).removeprefix('torch.')}"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    if arch == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(**cfg))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    model.to(dtype).save_pretrained(path, safe_serialization=True)
    return path


class Subject:
    """One model under test: foudre's engine, optionally the HF model, and its figures."""

    def __init__(self, name: str, dtype_name: str, hf_on: bool) -> None:
        import transformers

        dtype = getattr(torch, dtype_name)
        path = build(name, dtype)
        self.name = name
        self.hf = None
        if hf_on:
            self.hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            self.hf.generation_config.eos_token_id = None
            self.hf.generation_config.pad_token_id = 0
        # KV for 64 requests of 128 + 256 tokens, not the 2 GiB default: three engines coexist
        self.llm = make_llm(path, dtype_name, "cpu", num_kv_blocks=1600)
        model = self.llm.engine.model
        self.row: dict[str, Any] = {
            "model": name,
            "total_params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "active_bytes_gb": weight_bytes(model) / 1e9,
        }
        self.runs: dict[str, list[float]] = {k: [] for k in ("hf", "tps", "frac", "paired")}

    def batch1_round(self, prompt: list[int], probe: Any) -> None:
        """One batch-1 round: HF, then foudre against the bandwidth measured around it."""
        if self.hf is not None:
            with torch.inference_mode():
                self.runs["hf"].append(hf_batch1(self.hf, prompt, 128)[1])
        wbytes = self.row["active_bytes_gb"] * 1e9
        self.llm.engine.reset_prefix_cache()
        before = measure_bandwidth()
        _, tps, _, pairs = foudre_batch1(self.llm, prompt, 128, probe)
        bw = max(before, measure_bandwidth())
        self.runs["tps"].append(tps)
        self.runs["frac"].append(tps * wbytes / bw)
        self.runs["paired"].append(_median([wbytes / d / p for d, p in pairs]))
        print(
            f"[{self.name}] batch 1: foudre {tps:.1f} tok/s "
            f"(HF {self.runs['hf'][-1] if self.runs['hf'] else 0:.1f}); roofline "
            f"{self.runs['frac'][-1]:.0%} (paired {self.runs['paired'][-1]:.0%}) at "
            f"{bw / 1e9:.1f} GB/s",
            flush=True,
        )

    def throughput(self, prompts: list[list[int]], lens: list[int]) -> None:
        self.llm.engine.reset_prefix_cache()
        self.row["foudre_tps"], self.row["foudre_preemptions"] = foudre_throughput(
            self.llm, prompts, lens
        )
        if self.hf is not None:
            with torch.inference_mode():
                self.row["hf_static_tps"] = hf_static(self.hf, prompts, lens)
        print(
            f"[{self.name}] {len(prompts)} requests: foudre {self.row['foudre_tps']:.1f} tok/s "
            f"(HF static {self.row.get('hf_static_tps', 0):.1f})",
            flush=True,
        )

    def finish(self) -> dict[str, Any]:
        r, row = self.runs, self.row
        row.update(
            foudre_decode_tps=_median(r["tps"]),
            foudre_decode_tps_runs=r["tps"],
            roofline_frac=_median(r["frac"]),
            roofline_frac_runs=r["frac"],
            roofline_frac_paired=_median(r["paired"]),
        )
        if r["hf"]:
            row.update(hf_decode_tps=_median(r["hf"]), hf_decode_tps_runs=r["hf"])
        if self.name == "moe":
            row["moe_expert_tokens"] = self.llm.metrics()["moe_expert_tokens"]
        return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch's (and the kernels') thread count"
    )
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)  # the kernels share torch's OpenMP runtime
    prompts, lens = workload(args.num_requests)
    print(f"machine: {machine(torch.device('cpu'))}", flush=True)
    subjects = [Subject(name, args.dtype, not args.skip_hf) for name in args.models]
    probe = matvec_probe()
    # batch 1: the models in turns, round after round, so that the host's drift cancels
    for _ in range(args.rounds):
        for subject in subjects:
            subject.batch1_round(prompts[0], probe)
    if not args.skip_throughput:
        for subject in subjects:
            subject.throughput(prompts, lens)
    rows = [subject.finish() for subject in subjects]
    del subjects
    gc.collect()
    by = {r["model"]: r for r in rows}
    lines = [
        f"# Mixture of experts vs dense ({args.dtype}, random weights)",
        "",
        f"- date: {datetime.date.today()}",
        f"- machine: {machine(torch.device('cpu'))}",
        f"- command: `.venv/bin/python benchmarks/moe.py --dtype {args.dtype} "
        f"--rounds {args.rounds}{f' --threads {args.threads}' if args.threads else ''}`",
        "- batch 1: 128-token prompt, 128 greedy tokens, median of the rounds (each round every "
        "model in turn, HF then foudre); roofline: active bytes per token / step time / fp32 "
        "matvec bandwidth (faster of before/after each round), paired: each step against a "
        "matvec run right after it",
        f"- throughput: {args.num_requests} requests, 128-token prompts, outputs 16..256 "
        f"({sum(lens)} useful tokens); HF as one padded static batch",
        "",
        "| model | params | bytes / token | HF batch-1 tok/s | foudre batch-1 tok/s | "
        "roofline (paired) | HF 64-req tok/s | foudre 64-req tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['total_params_m']:.0f}M | {r['active_bytes_gb'] * 1e3:.0f} MB | "
            f"{_f(r.get('hf_decode_tps'))} | {r['foudre_decode_tps']:.1f} | "
            f"{r['roofline_frac']:.0%} ({r['roofline_frac_paired']:.0%}) | "
            f"{_f(r.get('hf_static_tps'))} | {_f(r.get('foudre_tps'))} |"
        )
    if "moe" in by and "dense-active" in by:
        ratio = by["dense-active"]["foudre_decode_tps"] / by["moe"]["foudre_decode_tps"]
        lines += ["", f"- batch-1 decode, dense-active / moe: {ratio:.2f}x (target <= 1.3x)"]
    if "moe" in by and "dense-total" in by:
        speedup = by["moe"]["foudre_decode_tps"] / by["dense-total"]["foudre_decode_tps"]
        lines.append(f"- batch-1 decode, moe / dense-total: {speedup:.2f}x")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=2) + "\n")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


if __name__ == "__main__":
    main()
