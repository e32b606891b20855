"""``foudre bench ablate``: switch one technique off at a time against the full configuration.

The full configuration is paged KV, continuous batching, prefix caching on and chunked prefill on
(token budget ``256 * scale`` unless ``--max-num-batched-tokens`` is given), with every row in the
same KV memory (``--num-kv-blocks``, by default ``--kv-seqs`` full-length sequences). Each
experiment runs its reference row (the full configuration) and its variants on the workload it
needs, through the in-process replay driver (``offline.replay``):

=========  ======================================  ==============================================
experiment variants                                 workload
=========  ======================================  ==============================================
paging     paged vs contiguous (each request        ``--workload`` (chat by default), every
           reserves ``max_model_len`` of KV)        request at t=0; seats = ``--num-prompts``, so
                                                    only KV memory limits concurrency (headline:
                                                    max concurrent requests)
batching   continuous vs dynamic vs static          ``--workload``, Poisson arrivals at
                                                    ``--request-rate``; chat outputs vary 16-512
prefix     prefix caching on vs off                 rag: a ~1,000-token shared system prompt and
                                                    ~32-token distinct questions, Poisson arrivals
chunked    chunked prefill on vs off, and "idle"    ~4 short requests (32 in / 128 out) decoding
           (no long prompt)                         when a ~2,000-token prompt arrives (once the
                                                    shorts have ~16 tokens each); latencies are
                                                    those of the short requests
quant...   model dtype vs int8 vs int4 weights      ``--workload`` as batching
speculative off vs n-gram lookup vs draft model     ``--workload`` as batching; the draft row runs
           (``--num-speculative-tokens``)          with ``--speculative-model`` (default: the
                                                    embedded draft for the embedded target)
sharing... n=8 samples, beam width 4: forked        ``max(2, num_prompts // 8)`` ~256-token prompts
           sequences share blocks (copy-on-write)   at t=0: 8 samples of 64 tokens each, or a beam
           vs copy the prompt's blocks at the fork  search of width 4 over 32 tokens (headline:
                                                    peak KV blocks used)
=========  ======================================  ==============================================

Token lengths are multiplied by ``--scale`` (1.0: the sizes above). A variant is a name, a
workload and ``EngineConfig`` overrides, so new rows (quantization, speculative decoding) are one
``Variant`` each in ``DEFAULT_VARIANTS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from foudre.bench.datasets import arrival_times, sample_lengths
from foudre.bench.metrics import RequestResult, compute_metrics
from foudre.bench.offline import WorkItem, replay
from foudre.config import EngineConfig

WORKLOADS = ("chat", "rag", "mixed")
OUTPUT_DISTS = ("uniform", "loguniform")


@dataclass(frozen=True, slots=True)
class Sizes:
    """The knobs of one ablation run. ``tokens(n)`` scales a nominal token count."""

    scale: float = 1.0
    num_prompts: int = 32
    request_rate: float = 1.0
    max_model_len: int = 2048
    seed: int = 0
    workload: str = "chat"
    output_dist: str = "uniform"  # chat output lengths: uniform | loguniform over 16-512

    def tokens(self, n: float) -> int:
        return max(1, round(n * self.scale))


Overrides = Mapping[str, Any] | Callable[[Sizes], Mapping[str, Any]]


@dataclass(frozen=True, slots=True)
class Variant:
    """One row: ``overrides`` of the full ``EngineConfig`` (a mapping, or a function of the
    run's ``Sizes``), run on ``workload``. ``focus``: report latencies of the requests with this
    tag only. The ``reference`` row of an experiment is the one ratios are taken against."""

    experiment: str
    name: str
    workload: str
    overrides: Overrides = field(default_factory=dict)
    reference: bool = False
    focus: str | None = None

    def resolve(self, sizes: Sizes) -> dict[str, Any]:
        o = self.overrides(sizes) if callable(self.overrides) else self.overrides
        return dict(o)


def _all_seats(sizes: Sizes) -> dict[str, Any]:
    return {"max_num_seqs": sizes.num_prompts}


def _contiguous(sizes: Sizes) -> dict[str, Any]:
    # the SDPA backend, as the recorded baseline ran (paging's gain measured with its kernels)
    return {
        "max_num_seqs": sizes.num_prompts,
        "kv_allocation": "contiguous",
        "attention_backend": "torch",
    }


DEFAULT_VARIANTS: tuple[Variant, ...] = (
    Variant("paging", "paged (full)", "main-burst", _all_seats, reference=True),
    Variant("paging", "contiguous", "main-burst", _contiguous),
    Variant("batching", "continuous (full)", "main", reference=True),
    Variant("batching", "dynamic", "main", {"scheduling_policy": "dynamic"}),
    Variant("batching", "static", "main", {"scheduling_policy": "static"}),
    Variant("prefix", "prefix caching on (full)", "rag", reference=True),
    Variant("prefix", "prefix caching off", "rag", {"enable_prefix_caching": False}),
    Variant("chunked", "chunked prefill on (full)", "interference", reference=True, focus="short"),
    Variant(
        "chunked",
        "chunked prefill off",
        "interference",
        {"enable_chunked_prefill": False},
        focus="short",
    ),
    Variant("chunked", "idle (no long prompt)", "interference-idle", focus="short"),
    Variant("quantization", "model dtype weights (full)", "main", reference=True),
    Variant("quantization", "int8 weights", "main", {"quantization": "int8"}),
    Variant("quantization", "int4 weights (g128)", "main", {"quantization": "int4"}),
    Variant("speculative", "no speculation (full)", "main", reference=True),
    Variant("speculative", "n-gram lookup", "main", {"speculative_method": "ngram"}),
    Variant("speculative", "draft model", "main", {"speculative_method": "draft"}),
    Variant("sharing-n8", "n=8, copy-on-write (full)", "samples-n8", reference=True),
    Variant("sharing-n8", "n=8, full copies", "samples-n8", {"copy_on_write": False}),
    Variant("sharing-beam4", "beam 4, copy-on-write (full)", "beams-4", reference=True),
    Variant("sharing-beam4", "beam 4, full copies", "beams-4", {"copy_on_write": False}),
)
"""The rows of ``foudre bench ablate``, in order. Add quantization or speculative decoding as
e.g. ``Variant("quant", "int8", "main", {"quantization": "int8"})`` with a reference row."""

EXPERIMENTS = tuple(dict.fromkeys(v.experiment for v in DEFAULT_VARIANTS))


# ---------------------------------------------------------------------------------------------
# workloads


def _ids(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    low = 10 if vocab > 20 else 0
    return rng.integers(low, vocab, size=n).tolist()


def chat_workload(sizes: Sizes, vocab: int, *, burst: bool = False) -> list[WorkItem]:
    """``num_prompts`` short prompts (32-160 tokens) with outputs of 16-512 tokens (both
    scaled), Poisson arrivals at ``request_rate`` (all at t=0 when ``burst``).

    Output lengths are uniform (``output_dist="uniform"``, mean 264) or log-uniform (every
    doubling of the length equally likely, mean 143, median 91), the long-tailed shape of chat
    answers: most are short, a few run long."""
    n = sizes.num_prompts
    rng = np.random.default_rng(sizes.seed)
    lo, hi = sizes.tokens(32), sizes.tokens(160)
    in_lens = rng.integers(lo, hi + 1, size=n).tolist()
    out_lo, out_hi = sizes.tokens(16), sizes.tokens(512)
    if sizes.output_dist == "loguniform":
        logs = rng.uniform(math.log(out_lo), math.log(out_hi + 1), size=n)
        out_lens = np.clip(np.floor(np.exp(logs)), out_lo, out_hi).astype(int).tolist()
    elif sizes.output_dist == "uniform":
        out_lens = rng.integers(out_lo, out_hi + 1, size=n).tolist()
    else:
        raise ValueError(f"output_dist must be one of {OUTPUT_DISTS}, got {sizes.output_dist!r}")
    times = [0.0] * n if burst else arrival_times(n, sizes.request_rate, 1.0, sizes.seed)
    items = []
    for a, i, o in zip(times, in_lens, out_lens, strict=True):
        o = max(1, min(o, sizes.max_model_len - i))
        items.append(WorkItem(_ids(rng, i, vocab), o, arrival=a, tag="chat"))
    return items


def rag_workload(sizes: Sizes, vocab: int, *, burst: bool = False) -> list[WorkItem]:
    """``max(2, num_prompts // 2)`` requests: one shared ~1,000-token system prompt followed by a
    distinct ~32-token question each, 32 output tokens (all scaled), Poisson arrivals at
    ``request_rate`` (at t=0 when ``burst``)."""
    n = max(2, sizes.num_prompts // 2)
    rng = np.random.default_rng(sizes.seed + 1)
    q_len, out = sizes.tokens(32), sizes.tokens(32)
    sys_len = max(1, min(sizes.tokens(1000), sizes.max_model_len - q_len - out))
    system = _ids(rng, sys_len, vocab)
    times = [0.0] * n if burst else arrival_times(n, sizes.request_rate, 1.0, sizes.seed + 1)
    q_lens = sample_lengths(n, q_len, 0.5, rng)
    return [
        WorkItem(system + _ids(rng, q, vocab), out, arrival=a, tag="rag")
        for a, q in zip(times, q_lens, strict=True)
    ]


def mixed_workload(sizes: Sizes, vocab: int, *, burst: bool = False) -> list[WorkItem]:
    """The chat and rag workloads together (half the prompts each), interleaved by arrival."""
    half = dataclasses.replace(sizes, num_prompts=max(2, sizes.num_prompts // 2))
    items = chat_workload(half, vocab, burst=burst) + rag_workload(half, vocab, burst=burst)
    return sorted(items, key=lambda w: w.arrival)


def interference_workload(sizes: Sizes, vocab: int, *, with_long: bool = True) -> list[WorkItem]:
    """``max(2, num_prompts // 8)`` short requests (32 in / 128 out, tag "short") at t=0 and,
    with ``with_long``, one long prompt (~2,000 tokens, 16 out, tag "long") that arrives once the
    shorts have produced ~16 tokens each (all scaled)."""
    k = max(2, sizes.num_prompts // 8)
    rng = np.random.default_rng(sizes.seed + 2)
    short_in, short_out = sizes.tokens(32), sizes.tokens(128)
    items = [WorkItem(_ids(rng, short_in, vocab), short_out, tag="short") for _ in range(k)]
    if with_long:
        long_out = sizes.tokens(16)
        long_in = max(1, min(sizes.tokens(2000), sizes.max_model_len - long_out))
        trigger = k * max(2, min(sizes.tokens(16), short_out // 4))
        items.append(
            WorkItem(_ids(rng, long_in, vocab), long_out, after_tokens=trigger, tag="long")
        )
    return items


_MAIN = {"chat": chat_workload, "rag": rag_workload, "mixed": mixed_workload}


def build_workload(name: str, sizes: Sizes, vocab: int) -> list[WorkItem]:
    """The workload called ``name``: ``main`` (the ``--workload`` one, Poisson arrivals),
    ``main-burst`` (the same, all at t=0), ``chat``, ``rag``, ``mixed`` (and their ``-burst``
    forms), ``interference`` and ``interference-idle``."""
    burst = name.endswith("-burst")
    base = name.removesuffix("-burst")
    if base == "main":
        base = sizes.workload
    if base in _MAIN:
        return _MAIN[base](sizes, vocab, burst=burst)
    if base == "interference":
        return interference_workload(sizes, vocab)
    if base == "interference-idle":
        return interference_workload(sizes, vocab, with_long=False)
    raise ValueError(f"unknown workload {name!r}")


# ---------------------------------------------------------------------------------------------
# running


def full_config(base: EngineConfig) -> EngineConfig:
    """``base`` with every technique on: paged KV, continuous batching, prefix caching and chunked
    prefill (other fields, such as dtype, block size and the KV pool, are kept). Speculative
    decoding is off: it is its own experiment."""
    return dataclasses.replace(
        base,
        kv_allocation="paged",
        scheduling_policy="continuous",
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        speculative_method=None,
        speculative_model=None,
        speculative_quantization=None,
    )


def has_draft_model(base: EngineConfig) -> bool:
    """Whether the draft-model row can run: a ``--speculative-model``, or the embedded target
    (whose draft ships beside it)."""
    return base.speculative_model is not None or base.model is None


def _row(
    variant: Variant,
    config: EngineConfig,
    results: Sequence[RequestResult],
    tags: Sequence[str],
    duration: float,
    engine_figs: dict[str, Any],
) -> dict[str, Any]:
    focus = [r for r, t in zip(results, tags, strict=True) if variant.focus in (None, t)]
    whole = compute_metrics(results, duration)
    lat = compute_metrics(focus, duration) if variant.focus else whole
    itls = [g for r in focus if r.success for g in r.itls]
    by_tag: dict[str, list[float]] = {}
    for r, t in zip(results, tags, strict=True):
        if r.success:
            by_tag.setdefault(t, []).append(r.ttft * 1e3)
    return {
        "experiment": variant.experiment,
        "variant": variant.name,
        "reference": variant.reference,
        "workload": variant.workload,
        "focus": variant.focus,
        "completed": whole["completed"],
        "failed": whole["failed"],
        "duration_s": duration,
        "total_output_tokens": whole["total_output_tokens"],
        "output_throughput": whole["output_throughput"],
        "mean_ttft_ms": lat["mean_ttft_ms"],
        "p99_ttft_ms": lat["p99_ttft_ms"],
        "mean_tpot_ms": lat["mean_tpot_ms"],
        "p99_tpot_ms": lat["p99_tpot_ms"],
        "p99_itl_ms": lat["p99_itl_ms"],
        "max_itl_ms": max(itls) * 1e3 if itls else None,
        "mean_ttft_ms_by_tag": {t: float(np.mean(v)) for t, v in by_tag.items()},
        "num_kv_blocks": config.num_kv_blocks,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        **engine_figs,
    }


def run_variant(
    variant: Variant, base: EngineConfig, sizes: Sizes, *, warmup: bool = True
) -> dict[str, Any]:
    """Build a fresh engine with ``variant``'s overrides of ``full_config(base)``, replay its
    workload, and return its row of figures (the engine is released before returning)."""
    from foudre.engine.llm import LLM
    from foudre.sampling_params import SamplingParams

    overrides = variant.resolve(sizes)
    config = dataclasses.replace(full_config(base), **overrides)
    if config.speculative_method == "draft":  # the draft the user named, if any
        config = dataclasses.replace(
            config,
            speculative_model=base.speculative_model,
            speculative_quantization=base.speculative_quantization,
        )
    t0 = time.perf_counter()
    llm = LLM.from_config(config)
    engine = llm.engine
    try:
        vocab = engine.model_config.vocab_size
        if warmup:  # first-call costs (allocations, kernel selection) are not the technique's
            rng = np.random.default_rng(sizes.seed + 99)
            llm.generate(_ids(rng, 8, vocab), SamplingParams(temperature=0, max_tokens=2))
        if variant.workload in SHARING_WORKLOADS:
            row = run_sharing(llm, variant, config, sizes)
            row["overrides"] = overrides
            row["wall_s"] = time.perf_counter() - t0
            return row
        items = build_workload(variant.workload, sizes, vocab)
        before = engine.metrics()
        rep = replay(engine, items)
        after = engine.metrics()
        drafts, draft_tokens, accepted, padding = (
            after[k] - before[k]
            for k in (
                "spec_num_drafts",
                "spec_draft_tokens",
                "spec_accepted_tokens",
                "num_padding_tokens",
            )
        )
        per_block = engine.kv_bytes_per_block
        num_blocks = int(after["num_total_blocks"])
        figs = {
            "peak_kv_cache_usage": rep.peak_kv_usage,
            "peak_kv_mib": rep.peak_kv_usage * num_blocks * per_block / (1 << 20),
            "max_running": rep.max_running,
            "num_preemptions": rep.num_preemptions,
            "prefix_cache_hits": rep.prefix_cache_hits,
            "prefix_cache_queries": rep.prefix_cache_queries,
            "num_steps": rep.num_steps,
            "num_padding_tokens": padding,
            "peak_rss_mib": rep.peak_rss_bytes / (1 << 20),
            "spec_draft_tokens": draft_tokens,
            "spec_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
            "spec_mean_acceptance_length": 1 + accepted / drafts if drafts else None,
        }
        resolved = dataclasses.replace(config, num_kv_blocks=num_blocks)
        row = _row(variant, resolved, rep.results, rep.tags, rep.duration, figs)
        row["overrides"] = overrides
        row["wall_s"] = time.perf_counter() - t0
        return row
    finally:
        del engine, llm
        gc.collect()


SHARING_WORKLOADS = ("samples-n8", "beams-4")


def run_sharing(llm: Any, variant: Variant, config: EngineConfig, sizes: Sizes) -> dict[str, Any]:
    """A sharing row: ``max(2, num_prompts // 8)`` prompts of ~256 tokens (scaled) at once, with
    8 samples of 64 tokens (``samples-n8``) or a width-4 beam search over 32 (``beams-4``);
    output tokens/s and the peak of KV blocks used."""
    from foudre.sampling_params import BeamSearchParams, SamplingParams

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(sizes.seed + 3)
    k = max(2, sizes.num_prompts // 8)
    prompts = [_ids(rng, sizes.tokens(256), vocab) for _ in range(k)]
    engine.reset_prefix_cache()
    if variant.workload == "beams-4":  # a first beam search: its own first-call costs
        llm.beam_search(prompts[:1], BeamSearchParams(beam_width=4, max_tokens=2))
    before = engine.metrics()
    t0 = time.perf_counter()
    if variant.workload == "samples-n8":
        params = SamplingParams(n=8, temperature=1.0, seed=0, max_tokens=sizes.tokens(64),
                                ignore_eos=True)  # fmt: skip
        outs = llm.generate(prompts, params)
        tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    else:
        beams = BeamSearchParams(beam_width=4, max_tokens=sizes.tokens(32), ignore_eos=True)
        searches = llm.beam_search(prompts, beams)
        # every live beam computes a token per step: 4 per step of each search
        tokens = sum(4 * max(len(s.token_ids) for s in o.sequences) for o in searches)
    duration = time.perf_counter() - t0
    after = engine.metrics()
    num_blocks = int(after["num_total_blocks"])
    peak = after["peak_kv_cache_usage"]
    return {
        "experiment": variant.experiment,
        "variant": variant.name,
        "reference": variant.reference,
        "workload": variant.workload,
        "focus": None,
        "completed": k,
        "failed": 0,
        "duration_s": duration,
        "total_output_tokens": tokens,
        "output_throughput": tokens / duration,
        "mean_ttft_ms": None,
        "p99_ttft_ms": None,
        "mean_tpot_ms": None,
        "p99_tpot_ms": None,
        "p99_itl_ms": None,
        "max_itl_ms": None,
        "mean_ttft_ms_by_tag": {},
        "num_kv_blocks": num_blocks,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "peak_kv_cache_usage": peak,
        "peak_kv_blocks": round(peak * num_blocks),
        "peak_kv_mib": peak * num_blocks * engine.kv_bytes_per_block / (1 << 20),
        "max_running": after["peak_running"],
        "num_preemptions": after["num_preemptions"] - before["num_preemptions"],
        "num_cow_copies": after["num_cow_copies"] - before["num_cow_copies"],
        "prefix_cache_hits": after["prefix_cache_hits"] - before["prefix_cache_hits"],
        "prefix_cache_queries": after["prefix_cache_queries"] - before["prefix_cache_queries"],
        "num_padding_tokens": 0,
    }


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """Give every row ``ratio``: its metrics divided by those of its experiment's reference row
    (None where either is missing or the reference is zero)."""
    refs = {r["experiment"]: r for r in rows if r["reference"]}
    for row in rows:
        ref = refs.get(row["experiment"])
        row["ratio"] = {}
        for key in PLOT_METRICS:
            a, b = row.get(key), ref.get(key) if ref else None
            row["ratio"][key] = a / b if a is not None and b else None


def run_ablation(
    base: EngineConfig,
    sizes: Sizes,
    variants: Sequence[Variant] = DEFAULT_VARIANTS,
    *,
    log: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Run every variant (in order) and return their rows, with ratios to the reference rows."""
    rows = []
    for k, v in enumerate(variants, 1):
        row = run_variant(v, base, sizes)
        rows.append(row)
        if log:
            log(
                f"[{k}/{len(variants)}] {v.experiment} / {v.name}: "
                f"{row['output_throughput']:.1f} out tok/s, "
                f"TTFT mean {_f(row['mean_ttft_ms'])} ms, "
                f"TPOT mean {_f(row['mean_tpot_ms'])} ms, max concurrency {row['max_running']} "
                f"({row['wall_s']:.1f} s)"
            )
    add_ratios(rows)
    return rows


# ---------------------------------------------------------------------------------------------
# reporting

PLOT_METRICS: dict[str, str] = {
    "output_throughput": "output tok/s",
    "mean_ttft_ms": "mean TTFT (ms)",
    "p99_ttft_ms": "p99 TTFT (ms)",
    "mean_tpot_ms": "mean TPOT (ms)",
    "p99_tpot_ms": "p99 TPOT (ms)",
    "peak_kv_mib": "peak KV (MiB)",
    "max_running": "max concurrency",
}
"""Metrics of every row, in table and figure order, with their labels."""


def _f(value: float | None, digits: int = 1) -> str:
    return (
        "n/a"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else (f"{value:.{digits}f}")
    )


def _cell(row: dict[str, Any], key: str) -> str:
    value = row.get(key)
    text = str(value) if isinstance(value, int) else _f(value)
    ratio = row.get("ratio", {}).get(key)
    if row["reference"] or ratio is None:
        return text
    return f"{text} (×{ratio:.2f})"


def headlines(rows: Sequence[dict[str, Any]]) -> list[str]:
    """One sentence per experiment with its key figure (experiments without one are skipped)."""
    by = {(r["experiment"], r["variant"]): r for r in rows}
    out = []
    ref = {r["experiment"]: r for r in rows if r["reference"]}
    if "paging" in ref and ("paging", "contiguous") in by:
        p, c = ref["paging"], by[("paging", "contiguous")]
        out.append(
            f"**paging**: {p['max_running']} concurrent requests paged vs {c['max_running']} "
            f"contiguous in the same {p['num_kv_blocks']} KV blocks; output "
            f"{_f(p['output_throughput'])} vs {_f(c['output_throughput'])} tok/s."
        )
    if "batching" in ref:
        parts = [
            f"{r['variant']} {_f(r['output_throughput'])} tok/s, "
            f"mean TTFT {_f(r['mean_ttft_ms'])} ms"
            + (f", {r['num_padding_tokens']} padding tokens" if r.get("num_padding_tokens") else "")
            for r in rows
            if r["experiment"] == "batching"
        ]
        out.append("**batching**: " + "; ".join(parts) + ".")
    if "prefix" in ref and ("prefix", "prefix caching off") in by:
        on, off = ref["prefix"], by[("prefix", "prefix caching off")]
        out.append(
            f"**prefix caching**: {on['prefix_cache_hits']} of {on['prefix_cache_queries']} prompt "
            f"tokens hit the cache; mean TTFT {_f(on['mean_ttft_ms'])} ms on vs "
            f"{_f(off['mean_ttft_ms'])} ms off."
        )
    if "chunked" in ref:
        idle = by.get(("chunked", "idle (no long prompt)"))
        parts = []
        for r in rows:
            if r["experiment"] != "chunked":
                continue
            text = f"{r['variant']}: p99 TPOT {_f(r['p99_tpot_ms'])} ms"
            if idle is not None and r is not idle and r["p99_tpot_ms"] and idle["p99_tpot_ms"]:
                text += f" (×{r['p99_tpot_ms'] / idle['p99_tpot_ms']:.2f} idle)"
            text += f", p99 ITL {_f(r['p99_itl_ms'])} ms, max ITL {_f(r['max_itl_ms'])} ms"
            if "long" in r["mean_ttft_ms_by_tag"]:
                text += f", long prompt TTFT {_f(r['mean_ttft_ms_by_tag']['long'])} ms"
            parts.append(text)
        out.append("**chunked prefill** (short requests): " + "; ".join(parts) + ".")
    if "quantization" in ref:
        parts = [
            f"{r['variant']} {_f(r['output_throughput'])} tok/s, "
            f"mean TPOT {_f(r['mean_tpot_ms'])} ms"
            for r in rows
            if r["experiment"] == "quantization"
        ]
        out.append("**quantization**: " + "; ".join(parts) + ".")
    for name, what in (("sharing-n8", "n=8 samples"), ("sharing-beam4", "beam search of width 4")):
        if name in ref:
            parts = [
                f"{r['variant']}: peak {r['peak_kv_blocks']} KV blocks, "
                f"{_f(r['output_throughput'])} tok/s, {r['num_preemptions']} preemptions"
                for r in rows
                if r["experiment"] == name
            ]
            out.append(f"**{what}**: " + "; ".join(parts) + ".")
    if "speculative" in ref:
        parts = []
        for r in rows:
            if r["experiment"] != "speculative":
                continue
            text = f"{r['variant']} {_f(r['output_throughput'])} tok/s"
            if r.get("spec_acceptance_rate") is not None:
                text += (
                    f" (acceptance {r['spec_acceptance_rate']:.2f}, "
                    f"{r['spec_mean_acceptance_length']:.2f} tokens per target forward)"
                )
            parts.append(text)
        out.append("**speculative decoding**: " + "; ".join(parts) + ".")
    return out


def format_markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The ablation as markdown: machine, command, date, configuration, headlines, one table."""
    lines = [
        f"# Ablation: {meta['model']}",
        "",
        f"- date: {meta['date']}",
        f"- machine: {meta['machine']}",
        f"- command: `{meta['command']}`",
        f"- full configuration: {meta['full_config']}",
        f"- sizes: {meta['sizes']}",
        "- ratios in parentheses are against the experiment's full-configuration row; latencies "
        "of the chunked rows are those of the short requests",
        "",
        *[f"- {h}" for h in headlines(rows)],
        "",
        "| experiment | variant | " + " | ".join(PLOT_METRICS.values()) + " | preemptions "
        "| prefix hits (tokens) | p99 ITL (ms) |",
        "| --- | --- | " + " | ".join("---:" for _ in PLOT_METRICS) + " | ---: | ---: | ---: |",
    ]
    for r in rows:
        cells = [_cell(r, k) for k in PLOT_METRICS]
        lines.append(
            f"| {r['experiment']} | {r['variant']} | " + " | ".join(cells) + f" | "
            f"{r['num_preemptions']} | {r['prefix_cache_hits']} | {_f(r['p99_itl_ms'])} |"
        )
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# CLI


def add_ablate_args(parser: argparse.ArgumentParser) -> None:
    """Flags of ``foudre bench ablate`` (the engine flags are added by the caller, whose defaults
    this changes: 16 seats, token budget 256*scale, ``--kv-seqs`` full-length sequences of KV)."""
    p = parser
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="chat",
        help="workload of the paging and batching experiments (default: chat)",
    )
    p.add_argument(
        "--output-dist",
        choices=OUTPUT_DISTS,
        default="uniform",
        help="chat output lengths over 16-512 tokens: uniform (mean 264) or loguniform "
        "(long-tailed: mean 143, median 91) (default: uniform)",
    )
    p.add_argument("--output", default="benchmarks/results/ablate", metavar="DIR")
    p.add_argument(
        "--num-prompts",
        type=int,
        default=32,
        help="chat requests; rag uses half, the chunked experiment an eighth (>= 2)",
    )
    p.add_argument("--scale", type=float, default=1.0, help="multiplies every token length")
    p.add_argument(
        "--request-rate",
        type=float,
        default=1.0,
        help="Poisson arrival rate (req/s) of the batching and prefix workloads",
    )
    p.add_argument(
        "--kv-seqs",
        type=float,
        default=4.0,
        help="KV pool size in max_model_len sequences when --num-kv-blocks is not given",
    )
    p.add_argument(
        "--experiments",
        default=",".join(EXPERIMENTS),
        help=f"comma-separated subset of {','.join(EXPERIMENTS)}",
    )
    p.set_defaults(max_num_seqs=16, max_num_batched_tokens=None)


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_ablate(args: argparse.Namespace, argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """``foudre bench ablate``: run the selected experiments, print the markdown table and write
    ``ablate.md``, ``ablate.json`` and ``ablate.png`` into ``--output``."""
    from foudre.bench.plots import plot_ablation
    from foudre.bench.roofline import machine
    from foudre.engine.options import engine_config_from

    wanted = [e.strip() for e in args.experiments.split(",") if e.strip()]
    unknown = set(wanted) - set(EXPERIMENTS)
    if unknown:
        raise ValueError(f"unknown experiment(s) {sorted(unknown)}; choose from {EXPERIMENTS}")
    if args.num_prompts < 2 or not args.scale > 0 or not args.request_rate > 0:
        raise ValueError("need --num-prompts >= 2, --scale > 0 and --request-rate > 0")
    scale = args.scale
    if args.max_model_len is None:
        args.max_model_len = max(64, round(2048 * scale))
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = max(args.max_num_seqs + 16, round(256 * scale))
    if args.num_kv_blocks is None:
        args.num_kv_blocks = math.ceil(args.kv_seqs * args.max_model_len / args.block_size)
    base = dataclasses.replace(engine_config_from(args), skip_tokenizer_init=True)
    sizes = Sizes(
        scale=scale,
        num_prompts=args.num_prompts,
        request_rate=args.request_rate,
        max_model_len=args.max_model_len,
        seed=args.seed,
        workload=args.workload,
        output_dist=args.output_dist,
    )
    variants = [v for v in DEFAULT_VARIANTS if v.experiment in wanted]
    if not has_draft_model(base):
        _log("speculative / draft model: skipped (give --speculative-model for this model)")
        variants = [v for v in variants if v.overrides != {"speculative_method": "draft"}]
    rows = run_ablation(base, sizes, variants, log=_log)
    full = full_config(base)
    meta = {
        "model": args.model,
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "foudre " + shlex.join(list(argv) if argv is not None else sys.argv[1:]),
        "full_config": (
            f"paged, continuous, prefix caching on, chunked prefill on; dtype {full.dtype}, "
            f"max_model_len {full.max_model_len}, {full.num_kv_blocks} KV blocks of "
            f"{full.block_size}, max_num_seqs {full.max_num_seqs}, "
            f"max_num_batched_tokens {full.max_num_batched_tokens}"
        ),
        "sizes": (
            f"scale {scale}, {args.num_prompts} prompts, workload {args.workload} "
            f"({args.output_dist} output lengths), "
            f"request rate {args.request_rate} req/s, seed {args.seed}"
        ),
    }
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    md = format_markdown(rows, meta)
    (out / "ablate.md").write_text(md)
    (out / "ablate.json").write_text(
        json.dumps(
            {**meta, "config": dataclasses.asdict(full), "rows": rows}, indent=2, default=str
        )
        + "\n"
    )
    plot_ablation(
        rows,
        out / "ablate.png",
        title=f"foudre ablation: {Path(args.model or 'default model').name}",
        metrics=PLOT_METRICS,
    )
    print(md)
    return rows
