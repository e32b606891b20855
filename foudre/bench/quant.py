"""``foudre bench quant``: size, speed and quality of every weight / KV quantization scheme.

Each scheme loads the model once, quantized at load exactly as the engine serves it
(``LLM(model, dtype=..., quantization=..., kv_cache_dtype=...)``), and measures on that model:

- **size**: bytes of the weights as loaded: parameters (a tied head once) plus persistent
  buffers, so packed int8 / int4 codes, scales and zero points count as stored;
- **batch-1 decode**: tokens/s of the decode steps of one ``--input-len`` prompt generating
  ``--output-len`` tokens (greedy, ignore_eos), after a warm-up request;
- **throughput**: output tokens/s of ``--batch-size`` concurrent requests (same lengths, random
  prompts, ignore_eos) through ``LLM.generate``, prefill included;
- **quality**: bits per byte (``foudre.compress.eval.perplexity``) on the held-out split of
  ``--data`` when the model has a tokenizer, and with ``--kl`` the KL divergence of the
  next-token distribution from the fp32 model's (and top-1 agreement) on random token sequences,
  the measure for random-weight models, whose bits per byte mean nothing.

========  ===========================================================================
scheme    weights / KV cache
========  ===========================================================================
fp32      float32 weights
bf16      bfloat16 weights
int8      int8 per output channel (RTN), float parts in ``--dtype`` (bfloat16 by default)
int4      int4, asymmetric, group 128 (RTN)
gptq      GPTQ 4-bit g128, calibrated at load
awq       AWQ 4-bit g128, calibrated at load
mixed     4 or 8 bits per linear by sensitivity, 4.5 bits on average, calibrated at load
int8-kv   bfloat16 weights, int8 KV cache (``kv_cache_dtype="int8"``)
========  ===========================================================================

The calibrated schemes calibrate at load on the engine's default calibration set: 8 sequences
of 64 random token ids (``foudre.quant.calib.default_calibration``). ``--calibration-docs N``
instead quantizes the float model in place with the first N documents of the *train* split of
``--data`` (never the held-out documents that are scored). The ``lm_head`` is int8 per channel
under int8, 6-bit (Q6_K's form) under int4 where our CPU kernels run it, else int8 (as llama.cpp
keeps its output layer at higher precision), and stays in float in the other schemes
(``foudre.quant.api.quantize_model``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from foudre.config import EngineConfig


@dataclass(frozen=True, slots=True)
class Scheme:
    """One row: the float dtype (None: ``--dtype``), the weight quantization at load and the KV
    cache dtype; ``bits`` is the nominal bits per linear weight."""

    name: str
    label: str
    dtype: str | None
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    bits: float = 16.0


SCHEMES: dict[str, Scheme] = {
    s.name: s
    for s in (
        Scheme("fp32", "fp32", "float32", bits=32.0),
        Scheme("bf16", "bf16", "bfloat16", bits=16.0),
        Scheme("int8", "int8 (per channel)", None, "int8", bits=8.0),
        Scheme("int4", "int4 (g128)", None, "int4", bits=4.0),
        Scheme("gptq", "GPTQ 4-bit (g128)", None, "gptq", bits=4.0),
        Scheme("awq", "AWQ 4-bit (g128)", None, "awq", bits=4.0),
        Scheme("mixed", "mixed 4/8-bit (4.5 avg)", None, "mixed", bits=4.5),
        Scheme("int8-kv", "bf16 + int8 KV", "bfloat16", kv_cache_dtype="int8", bits=16.0),
    )
}
CALIBRATED = ("gptq", "awq", "mixed")

TARGETS = (
    ("int8", "bits_per_byte", 0.01, "int8 bits/byte within 1% of bf16"),
    ("gptq", "bits_per_byte", 0.05, "GPTQ-4 bits/byte within 5% of bf16"),
    ("awq", "bits_per_byte", 0.05, "AWQ-4 bits/byte within 5% of bf16"),
    ("int4", "decode_tps", 2.0, "int4 batch-1 decode >= 2x bf16 tok/s"),
)
"""The issue's targets: (scheme, metric, bound, text). Bits per byte: relative excess over the
bf16 row at most ``bound``; decode: at least ``bound`` times the bf16 row."""


# ---------------------------------------------------------------------------------------------
# measurements


def model_bytes(model: torch.nn.Module) -> int:
    """Bytes of the weights as loaded: every parameter once (tied tensors deduplicated) plus
    every persistent buffer (packed quantized codes, scales, zero points); the rotary tables
    (non-persistent, recomputed) and kernel-side caches are not counted."""
    seen: set[int] = set()
    total = 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel() * p.element_size()
    for mod in model.modules():
        skip = mod._non_persistent_buffers_set
        for name, b in mod.named_buffers(recurse=False):
            if b is not None and name not in skip and id(b) not in seen:
                seen.add(id(b))
                total += b.numel() * b.element_size()
    return total


def num_weights(model: torch.nn.Module) -> int:
    """Weights of the float model: parameters (deduplicated) plus the in x out weights (and
    biases) each quantized linear stands for."""
    from foudre.quant.qlinear import QuantLinear

    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    for m in model.modules():
        if isinstance(m, QuantLinear):
            total += m.in_features * m.out_features
            total += m.out_features if getattr(m, "bias", None) is not None else 0
    return total


def decode_speed(llm: Any, input_len: int, output_len: int, seed: int) -> dict[str, float]:
    """Batch-1 decode tokens/s: one prompt, ``output_len`` greedy tokens, each engine step
    timed (``offline.timed_batch``) after a warm-up request on another prompt."""
    from foudre.bench.offline import random_prompts, timed_batch

    engine = llm.engine
    warm, prompt = random_prompts(2, input_len, engine.model_config.vocab_size, seed)
    timed_batch(engine, [warm], 4)
    ttfts, decode = timed_batch(engine, [prompt], output_len)
    return {
        "decode_tps": len(decode) / sum(decode) if decode else float("nan"),
        "ttft_ms": ttfts[0] * 1e3,
        "tpot_median_ms": float(np.median(decode)) * 1e3 if decode else float("nan"),
    }


def batch_throughput(
    llm: Any, batch: int, input_len: int, output_len: int, seed: int
) -> dict[str, float]:
    """Output tokens/s of ``batch`` concurrent random prompts (fixed lengths, ignore_eos)."""
    from foudre.bench.offline import random_prompts
    from foudre.sampling_params import SamplingParams

    prompts = random_prompts(batch, input_len, llm.engine.model_config.vocab_size, seed + 1)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"throughput_tps": produced / elapsed, "throughput_s": elapsed, "batch_size": batch}


@torch.no_grad()
def log_probs(model: Any, ids: torch.Tensor, kv_cache_dtype: str = "auto") -> torch.Tensor:
    """Float32 next-token log-probabilities ``[N, T, vocab]`` of ``ids`` ``[N, T]``, one
    sequence per forward (each from position 0, no KV cache)."""
    from foudre.compress.model import causal_logits

    device = model.model.embed_tokens.weight.device  # lm_head may be quantized
    rows = [
        torch.log_softmax(causal_logits(model, row.view(1, -1).to(device), kv_cache_dtype)[0], -1)
        for row in ids
    ]
    return torch.stack(rows).cpu()


def kl_to_reference(ref: torch.Tensor, q: torch.Tensor) -> dict[str, float]:
    """Mean over positions of KL(ref || q) (nats) and the top-1 agreement of two log-prob sets."""
    kl = (ref.exp() * (ref - q)).sum(-1)
    agree = (ref.argmax(-1) == q.argmax(-1)).float().mean()
    return {"kl": float(kl.mean()), "kl_max": float(kl.max()), "top1_agree": float(agree)}


# ---------------------------------------------------------------------------------------------
# running


@dataclass(slots=True)
class Options:
    schemes: list[str]
    input_len: int = 64
    output_len: int = 64
    batch_size: int = 32
    speed: bool = True
    quality: bool = True
    kl: bool = False
    kl_seqs: int = 4
    kl_len: int = 128
    max_length: int | None = None
    calibration_docs: int = 0
    seed: int = 0


def _float_dtype(base: EngineConfig) -> str:
    return "bfloat16" if base.dtype in ("auto", "bf16") else base.dtype


def scheme_config(base: EngineConfig, scheme: Scheme, calibrate_in_place: bool) -> EngineConfig:
    """``base`` with ``scheme``'s dtype, quantization (None when the caller quantizes in place
    with real calibration text) and KV cache dtype."""
    quant = None if calibrate_in_place else scheme.quantization
    return dataclasses.replace(
        base,
        dtype=scheme.dtype or _float_dtype(base),
        quantization=quant,
        kv_cache_dtype=scheme.kv_cache_dtype,
        skip_tokenizer_init=True,
    )


def quantize_in_place(model: Any, method: str, calibration: list[list[int]]) -> None:
    """Quantize the engine's float model with ``method`` on ``calibration`` token ids, as the
    loader would at load (compute dtype bfloat16 for a float32 model on a CPU where torch's
    packed kernels serve it)."""
    from foudre.quant.api import quantize_model
    from foudre.quant.qlinear import prepare_for_cpu

    quantize_model(model, method, calibration)
    prepare_for_cpu(model)


def run_scheme(
    scheme: Scheme,
    base: EngineConfig,
    opts: Options,
    *,
    tokenizer: Any | None = None,
    docs: Sequence[str] = (),
    calibration: list[list[int]] | None = None,
    reference: torch.Tensor | None = None,
    kl_ids: torch.Tensor | None = None,
    keep_log_probs: bool = False,
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Load ``scheme``, measure it, release it. Returns its row and, with ``keep_log_probs``,
    its log-probabilities on ``kl_ids`` (the reference of the others when it is fp32)."""
    from foudre.compress.eval import perplexity
    from foudre.engine.llm import LLM
    from foudre.runner.model_runner import ModelRunner

    in_place = calibration is not None and scheme.quantization in CALIBRATED
    config = scheme_config(base, scheme, in_place)
    wall = time.perf_counter()
    llm = LLM.from_config(config)
    try:
        model = llm.engine.model
        if in_place:
            assert scheme.quantization is not None and calibration is not None
            quantize_in_place(model, scheme.quantization, calibration)
            runner = llm.engine.runner
            if isinstance(runner, ModelRunner):  # the native decode step on the quantized model
                runner.model_changed()
        load_s = time.perf_counter() - wall
        size = model_bytes(model)
        row: dict[str, Any] = {
            "scheme": scheme.name,
            "label": scheme.label,
            "dtype": config.dtype,
            "quantization": scheme.quantization,
            "kv_cache_dtype": scheme.kv_cache_dtype,
            "nominal_bits": scheme.bits,
            "calibration": (
                None
                if scheme.quantization not in CALIBRATED
                else f"{len(calibration)} train documents"
                if in_place and calibration is not None
                else "at load: 8 x 64 random token ids"
            ),
            "load_s": load_s,
            "size_bytes": size,
            "bits_per_weight": 8.0 * size / num_weights(model),
        }
        lp = None
        if opts.quality:
            t = time.perf_counter()
            if tokenizer is not None and docs:
                res = perplexity(model, tokenizer, docs, opts.max_length, scheme.kv_cache_dtype)
                row.update(
                    bits_per_byte=res.bits_per_byte,
                    perplexity=res.perplexity,
                    eval_tokens=res.tokens,
                    eval_bytes=res.bytes,
                )
            if kl_ids is not None:
                lp = log_probs(model, kl_ids, scheme.kv_cache_dtype)
                if reference is not None:
                    row.update(kl_to_reference(reference, lp))
                elif scheme.name == "fp32":
                    row.update(kl=0.0, kl_max=0.0, top1_agree=1.0)
            row["quality_s"] = time.perf_counter() - t
        if opts.speed:
            t = time.perf_counter()
            row.update(decode_speed(llm, opts.input_len, opts.output_len, opts.seed))
            row.update(
                batch_throughput(llm, opts.batch_size, opts.input_len, opts.output_len, opts.seed)
            )
            row["speed_s"] = time.perf_counter() - t
        row["wall_s"] = time.perf_counter() - wall
        return row, lp if keep_log_probs else None
    finally:
        del llm
        gc.collect()


def fp32_reference(base: EngineConfig, kl_ids: torch.Tensor) -> torch.Tensor:
    """Log-probabilities of the float32 model on ``kl_ids`` (loaded without an engine)."""
    from foudre.loading.loader import default_model, load_model

    name, tok = (base.model, base.tokenizer) if base.model else default_model()
    loaded = load_model(
        name, tok, "float32", torch.device("cpu"), None, base.revision, gguf_dequantize=True
    )
    try:
        return log_probs(loaded.model, kl_ids)
    finally:
        del loaded
        gc.collect()


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Give each row its ratios to the fp32 size, to the bf16 speeds and bits per byte."""
    by = {r["scheme"]: r for r in rows}
    fp32, bf16 = by.get("fp32"), by.get("bf16")
    for r in rows:
        r["size_vs_fp32"] = r["size_bytes"] / fp32["size_bytes"] if fp32 else None
        for key in ("decode_tps", "throughput_tps"):
            a, b = r.get(key), bf16.get(key) if bf16 else None
            r[f"{key}_vs_bf16"] = a / b if a is not None and b else None
        a, b = r.get("bits_per_byte"), bf16.get("bits_per_byte") if bf16 else None
        r["bpb_excess_vs_bf16"] = (a - b) / b if a is not None and b else None


def check_targets(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each of ``TARGETS`` with its measured value and ``passed`` (None: not measurable here,
    e.g. no bits per byte for a random-weight model, or the scheme or bf16 not run)."""
    by = {r["scheme"]: r for r in rows}
    out = []
    for scheme, metric, bound, text in TARGETS:
        row, ref = by.get(scheme), by.get("bf16")
        value: float | None = None
        if row is not None and ref is not None:
            if metric == "bits_per_byte":
                value = row.get("bpb_excess_vs_bf16")
            else:
                value = row.get("decode_tps_vs_bf16")
        if value is None:
            passed = None
            shown = "n/a"
        elif metric == "bits_per_byte":
            passed = value <= bound
            shown = f"{value * 100:+.2f}%"
        else:
            passed = value >= bound
            shown = f"{value:.2f}x"
        out.append(
            {"target": text, "scheme": scheme, "value": value, "shown": shown, "passed": passed}
        )
    return out


def run_quant_bench(
    base: EngineConfig,
    opts: Options,
    *,
    tokenizer: Any | None = None,
    docs: Sequence[str] = (),
    calibration: list[list[int]] | None = None,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Measure every scheme of ``opts.schemes`` (fp32 first, as the KL reference) and return
    their rows with ratios."""
    order = sorted(opts.schemes, key=lambda s: list(SCHEMES).index(s))
    kl_ids = None
    reference = None
    if opts.quality and opts.kl:
        gen = torch.Generator().manual_seed(opts.seed + 7)
        vocab = _vocab_size(base)
        kl_ids = torch.randint(0, vocab, (opts.kl_seqs, opts.kl_len), generator=gen)
        if "fp32" not in order:
            t = time.perf_counter()
            reference = fp32_reference(base, kl_ids)
            if log:
                log(f"fp32 reference log-probs ({time.perf_counter() - t:.1f} s)")
    rows = []
    for k, name in enumerate(order, 1):
        row, lp = run_scheme(
            SCHEMES[name],
            base,
            opts,
            tokenizer=tokenizer,
            docs=docs,
            calibration=calibration,
            reference=reference,
            kl_ids=kl_ids,
            keep_log_probs=name == "fp32",
        )
        if name == "fp32" and lp is not None:
            reference = lp
        rows.append(row)
        if log:
            log(f"[{k}/{len(order)}] {name}: " + _summary(row))
    add_ratios(rows)
    return rows


def _vocab_size(base: EngineConfig) -> int:
    from foudre.loading.hf import load_hf_config, resolve_model_path
    from foudre.loading.llama2c import load_llama2c
    from foudre.loading.loader import default_model

    name = base.model or default_model()[0]
    path = resolve_model_path(name, base.revision)
    if path.is_file():
        return load_llama2c(path)[0].vocab_size
    return load_hf_config(path).vocab_size


# ---------------------------------------------------------------------------------------------
# reporting


def _f(value: Any, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _summary(row: dict[str, Any]) -> str:
    parts = [f"{row['size_bytes'] / 1e6:.1f} MB", f"load {row['load_s']:.1f} s"]
    if "bits_per_byte" in row:
        parts.append(f"{row['bits_per_byte']:.4f} bits/byte")
    if "kl" in row:
        parts.append(f"KL {row['kl']:.5f} nats, top-1 {row['top1_agree']:.1%}")
    if "decode_tps" in row:
        parts.append(f"batch-1 {row['decode_tps']:.1f} tok/s")
        parts.append(f"batch-{row['batch_size']} {row['throughput_tps']:.1f} tok/s")
    parts.append(f"{row['wall_s']:.1f} s")
    return ", ".join(parts)


def _x(value: float | None) -> str:
    return "" if value is None else f" ({value:.2f}x)"


def format_markdown(
    rows: Sequence[dict[str, Any]], targets: Sequence[dict[str, Any]], meta: dict[str, Any]
) -> str:
    """The report: header (model, date, machine, command, workload), targets, one table."""
    bpb = any("bits_per_byte" in r for r in rows)
    kl = any("kl" in r for r in rows)
    speed = any("decode_tps" in r for r in rows)
    head = ["scheme", "weights / KV", "load (s)", "size (MB)", "bits/weight"]
    if speed:
        head += ["batch-1 decode tok/s", f"batch-{meta['batch_size']} out tok/s"]
    if bpb:
        head += ["bits/byte", "vs bf16"]
    if kl:
        head += ["KL to fp32 (nats)", "top-1 agree"]
    lines = [
        f"# Quantization: size, speed and quality of {meta['model']}",
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- load average at start: {meta['load_average']}",
        f"- command: `{meta['command']}`",
        f"- {meta['workload']}",
        f"- quality: {meta['quality']}",
        f"- calibration (gptq, awq, mixed): {meta['calibration']}",
        f"- total wall time: {meta['total_s']:.0f} s",
        "",
        "Targets:",
        "",
        *[
            f"- {t['target']}: {t['shown']} "
            f"**{'PASS' if t['passed'] else 'n/a' if t['passed'] is None else 'FAIL'}**"
            for t in targets
        ],
        "",
        "| " + " | ".join(head) + " |",
        "| --- | --- | " + " | ".join("---:" for _ in head[2:]) + " |",
    ]
    for r in rows:
        kv = "" if r["kv_cache_dtype"] == "auto" else f", KV {r['kv_cache_dtype']}"
        cells = [
            r["scheme"],
            f"{r['label']} ({r['dtype']}{kv})",
            _f(r["load_s"]),
            f"{r['size_bytes'] / 1e6:.1f}{_x(r.get('size_vs_fp32'))}",
            _f(r["bits_per_weight"], 2),
        ]
        if speed:
            cells += [
                _f(r.get("decode_tps")) + _x(r.get("decode_tps_vs_bf16")),
                _f(r.get("throughput_tps")) + _x(r.get("throughput_tps_vs_bf16")),
            ]
        if bpb:
            excess = r.get("bpb_excess_vs_bf16")
            cells += [
                _f(r.get("bits_per_byte"), 4),
                "-" if excess is None else f"{excess * 100:+.2f}%",
            ]
        if kl:
            agree = r.get("top1_agree")
            cells += [_f(r.get("kl"), 5), "-" if agree is None else f"{agree:.1%}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "Size: parameters plus persistent buffers as loaded (packed codes, scales and zero points "
        "as stored); ratios in parentheses: size vs fp32, speeds vs bf16. The embedding stays "
        "in float in every scheme, the lm_head too except under int8 (int8 per channel) and "
        "int4 (6 bits on our CPU kernels, else int8). bits/weight: size in bits over the float "
        "model's weight count.",
    ]
    return "\n".join(lines) + "\n"


def plot_quant(rows: Sequence[dict[str, Any]], path: str | Path, *, title: str) -> Path:
    """Bar panels (size, batch-1 decode, batch throughput, bits per byte, KL) and a scatter of
    quality against batch-1 decode speed with bubble area proportional to size."""
    from foudre.bench.plots import pyplot, save_figure

    plt = pyplot()
    panels = [
        ("size_bytes", "weights (MB)", 1e-6),
        ("decode_tps", "batch-1 decode (tok/s)", 1.0),
        ("throughput_tps", "batch throughput (out tok/s)", 1.0),
        ("bits_per_byte", "bits per byte (held-out)", 1.0),
        ("kl", "KL to fp32 (nats/token)", 1.0),
    ]
    panels = [p for p in panels if any(r.get(p[0]) is not None for r in rows)]
    quality = "bits_per_byte" if any("bits_per_byte" in r for r in rows) else "kl"
    scatter = any(r.get(quality) is not None and r.get("decode_tps") for r in rows)
    n = len(panels) + int(scatter)
    ncols = min(3, n)
    nrows = -(-n // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5.2 * ncols, 3.8 * nrows), squeeze=False)
    palette = plt.get_cmap("tab10")
    colors = {r["scheme"]: palette(i % 10) for i, r in enumerate(rows)}
    names = [r["scheme"] for r in rows]
    ypos = np.arange(len(rows))[::-1]
    try:
        flat = list(axes.flat)
        for ax, (key, label, mult) in zip(flat, panels, strict=False):
            values = [r.get(key) for r in rows]
            finite = [float(v) * mult for v in values if v is not None]
            top = max(finite, default=1.0) or 1.0
            for y, r, v in zip(ypos, rows, values, strict=True):
                if v is None:
                    ax.text(ax.get_xlim()[0], y, " n/a", va="center", fontsize=7)
                    continue
                value = float(v) * mult
                ax.barh(y, value, color=colors[r["scheme"]])
                text = f" {value:,.0f}" if abs(value) >= 100 else f" {value:.4g}"
                ax.text(value, y, text, va="center", fontsize=7)
            left = 0.0
            if key == "bits_per_byte":  # differences of a few percent: zoom on them
                left = min(finite, default=0.0) * 0.97
            ax.set_xlim(left, left + (top - left) * 1.35)
            ax.set_yticks(ypos)
            ax.set_yticklabels(names, fontsize=8)
            ax.set_title(label, fontsize=10)
            ax.grid(axis="x", alpha=0.3)
        if scatter:
            ax = flat[len(panels)]
            pts = [r for r in rows if r.get(quality) is not None and r.get("decode_tps")]
            biggest = max(r["size_bytes"] for r in pts)
            for r in pts:
                ax.scatter(
                    r["decode_tps"],
                    r[quality],
                    s=40 + 900 * r["size_bytes"] / biggest,
                    color=colors[r["scheme"]],
                    alpha=0.6,
                    edgecolors="k",
                )
                ax.annotate(
                    r["scheme"],
                    (r["decode_tps"], r[quality]),
                    fontsize=8,
                    xytext=(4, 4),
                    textcoords="offset points",
                )
            ax.set_xlabel("batch-1 decode tok/s")
            ax.set_ylabel("bits per byte" if quality == "bits_per_byte" else "KL to fp32")
            ax.set_title("quality vs speed (bubble area: size)", fontsize=10)
            ax.grid(alpha=0.3)
        for ax in flat[n:]:
            ax.axis("off")
        out = save_figure(fig, path, title)
    finally:
        plt.close(fig)
    return out


# ---------------------------------------------------------------------------------------------
# CLI


def add_quant_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``foudre bench quant`` (the engine flags are added by the caller; ``--dtype``
    is the float dtype of the quantized schemes, bfloat16 when auto)."""
    p = parser
    p.add_argument(
        "--schemes",
        default=",".join(SCHEMES),
        help=f"comma-separated subset of {','.join(SCHEMES)}",
    )
    p.add_argument("--output", default="benchmarks/results/quant", metavar="DIR")
    p.add_argument(
        "--data",
        default=None,
        help="text file whose held-out split is scored in bits per byte (default: "
        "shared/data/tinystories_v2_train_first2MiB.txt)",
    )
    p.add_argument("--max-docs", type=int, default=None, help="score at most N held-out docs")
    p.add_argument("--max-length", type=int, default=None, help="perplexity window (tokens)")
    p.add_argument(
        "--kl",
        action="store_true",
        help="KL divergence of the next-token distribution to the fp32 model on random tokens",
    )
    p.add_argument("--kl-seqs", type=int, default=4, help="random sequences for --kl")
    p.add_argument("--kl-len", type=int, default=128, help="tokens per --kl sequence")
    p.add_argument("--input-len", type=int, default=64, help="prompt tokens (speed runs)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens (speed runs)")
    p.add_argument("--batch-size", type=int, default=32, help="concurrent requests (throughput)")
    p.add_argument(
        "--calibration-docs",
        type=int,
        default=0,
        help="calibrate gptq/awq/mixed on the first N train documents of --data instead of "
        "the engine's at-load random tokens (needs a tokenizer)",
    )
    p.add_argument("--skip-speed", action="store_true", help="no batch-1 / batch-N runs")
    p.add_argument("--skip-quality", action="store_true", help="no bits per byte, no KL")


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def find_tokenizer(model: str | None, tokenizer: str | None) -> Any | None:
    """The model's tokenizer, or None when it has none (a random-weight model, say)."""
    from foudre.loading.loader import _find_llama2c_tokenizer, default_model, load_tokenizer

    name, default_tok = (model, None) if model else default_model()
    source = tokenizer or default_tok
    if source is None:
        path = Path(name).expanduser()
        source = _find_llama2c_tokenizer(path) if path.is_file() else name
    if source is None:
        return None
    try:
        return load_tokenizer(source)
    except Exception:
        return None


def _check_schemes(args: argparse.Namespace) -> list[str]:
    """The schemes of ``--schemes``, once the flags are checked."""
    schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    unknown = [s for s in schemes if s not in SCHEMES]
    if unknown or not schemes:
        raise ValueError(f"unknown scheme(s) {unknown}; choose from {','.join(SCHEMES)}")
    if min(args.input_len, args.output_len, args.batch_size) < 1:
        raise ValueError("--input-len, --output-len and --batch-size must be positive")
    if args.quantization is not None or args.kv_cache_dtype != "auto":
        raise ValueError("the schemes set --quantization and --kv-cache-dtype; do not pass them")
    return schemes


def _size_engine(args: argparse.Namespace) -> None:
    """Size the engine flags left unset for the speed runs' requests."""
    if args.max_model_len is None:
        args.max_model_len = args.input_len + args.output_len
    if args.num_kv_blocks is None:  # every concurrent request's KV, plus one spare sequence
        per_seq = -(-args.max_model_len // args.block_size)
        args.num_kv_blocks = (args.batch_size + 1) * per_seq
    args.max_num_seqs = max(args.max_num_seqs, args.batch_size)


def _quality_docs(args: argparse.Namespace, data: Path) -> tuple[Any | None, list[str]]:
    """``(tokenizer, held-out documents)`` for bits per byte; none with ``--skip-quality``, or
    without a tokenizer or data (said on stderr)."""
    from foudre.compress.data import read_documents

    tokenizer = None
    docs: list[str] = []
    if not args.skip_quality:
        tokenizer = find_tokenizer(args.model, args.tokenizer)
        if tokenizer is not None and data.is_file():
            docs = read_documents(data, "heldout")[: args.max_docs]
        elif tokenizer is None:
            _log("no tokenizer: bits per byte skipped (use --kl)")
        else:
            _log(f"{data}: not found; bits per byte skipped")
    return tokenizer, docs


def _calibration_ids(
    args: argparse.Namespace, schemes: list[str], tokenizer: Any | None, data: Path
) -> tuple[Any | None, list[list[int]] | None]:
    """``(tokenizer, calibration)``: with ``--calibration-docs`` and a calibrated scheme, the
    first train documents of ``data`` as token ids (the tokenizer found for them if need be)."""
    from foudre.compress.data import document_ids, read_split

    calibration = None
    if args.calibration_docs > 0 and any(s in CALIBRATED for s in schemes):
        if tokenizer is None:
            tokenizer = find_tokenizer(args.model, args.tokenizer)
        if tokenizer is None or not data.is_file():
            raise ValueError("--calibration-docs needs a tokenizer and --data")
        train = read_split([data]).train[: args.calibration_docs]
        calibration = [document_ids(tokenizer, d)[:256] for d in train]
    return tokenizer, calibration


def _options(args: argparse.Namespace, schemes: list[str]) -> Options:
    return Options(
        schemes=schemes,
        input_len=args.input_len,
        output_len=args.output_len,
        batch_size=args.batch_size,
        speed=not args.skip_speed,
        quality=not args.skip_quality,
        kl=args.kl,
        kl_seqs=args.kl_seqs,
        kl_len=args.kl_len,
        max_length=args.max_length,
        calibration_docs=args.calibration_docs,
        seed=args.seed,
    )


def _report_meta(
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    opts: Options,
    rows: list[dict[str, Any]],
    docs: list[str],
    data: Path,
    calibration: list[list[int]] | None,
    load_average: str,
    start: float,
) -> dict[str, Any]:
    """The report's header: what ran, where, on which workload, and how long it took."""
    from foudre.bench.roofline import machine

    quality = []
    if docs:
        n_bytes = rows[0].get("eval_bytes", 0)
        quality.append(
            f"bits per byte on {len(docs)} held-out documents of {data.name} ({n_bytes} bytes)"
        )
    if opts.kl and opts.quality:
        quality.append(
            f"KL(fp32 || scheme) of next-token distributions, mean over {opts.kl_seqs} random "
            f"sequences x {opts.kl_len} tokens"
        )
    return {
        "model": args.model or "the embedded model",
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "load_average": load_average,
        "command": "foudre " + shlex.join(list(argv) if argv is not None else sys.argv[1:]),
        "workload": (
            f"speed: batch 1, {opts.input_len}-token prompt, {opts.output_len} greedy tokens "
            f"(decode steps timed); throughput: {opts.batch_size} concurrent requests of "
            f"{opts.input_len} + {opts.output_len} tokens, ignore_eos, prefill included"
            if opts.speed
            else "speed: skipped"
        ),
        "batch_size": opts.batch_size,
        "quality": "; ".join(quality) if quality else "skipped",
        "calibration": (
            f"the first {len(calibration)} train documents of {data.name} (256 tokens max each)"
            if calibration
            else "at load, the engine's default: 8 sequences x 64 random token ids"
        ),
        "total_s": time.perf_counter() - start,
    }


def _write_report(
    out: Path,
    base: EngineConfig,
    rows: list[dict[str, Any]],
    targets: list[dict[str, Any]],
    meta: dict[str, Any],
) -> None:
    """Write ``quant.md``, ``quant.json`` and ``quant.png`` into ``out`` and print the report."""
    out.mkdir(parents=True, exist_ok=True)
    md = format_markdown(rows, targets, meta)
    (out / "quant.md").write_text(md)
    payload = {**meta, "config": dataclasses.asdict(base), "targets": targets, "rows": rows}
    (out / "quant.json").write_text(json.dumps(payload, indent=2, default=str) + "\n")
    title = f"foudre quantization: {Path(str(meta['model'])).name}"
    plot_quant(rows, out / "quant.png", title=title)
    print(md)
    for t in targets:
        verdict = "PASS" if t["passed"] else "n/a" if t["passed"] is None else "FAIL"
        print(f"target: {t['target']}: {t['shown']} {verdict}")


def run_quant(args: argparse.Namespace, argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """``foudre bench quant``: measure the selected schemes, print the report and write
    ``quant.md``, ``quant.json`` and ``quant.png`` into ``--output``."""
    from foudre.engine.options import engine_config_from
    from foudre.loading.loader import shared_dir

    start = time.perf_counter()
    load_average = " ".join(f"{x:.2f}" for x in os.getloadavg())
    schemes = _check_schemes(args)
    _size_engine(args)
    base = engine_config_from(args)
    data = Path(args.data) if args.data else shared_dir() / "data" / _DEFAULT_DATA
    tokenizer, docs = _quality_docs(args, data)
    tokenizer, calibration = _calibration_ids(args, schemes, tokenizer, data)
    opts = _options(args, schemes)
    rows = run_quant_bench(
        base, opts, tokenizer=tokenizer, docs=docs, calibration=calibration, log=_log
    )
    targets = check_targets(rows)
    meta = _report_meta(args, argv, opts, rows, docs, data, calibration, load_average, start)
    _write_report(Path(args.output), base, rows, targets, meta)
    return rows


_DEFAULT_DATA = "tinystories_v2_train_first2MiB.txt"
