"""Pictures of benchmark runs (matplotlib, Agg backend: no display needed): one serving run, an
ablation, a request-rate sweep."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from foudre.bench.metrics import RequestResult


def chunk_timeline(results: Sequence[RequestResult]) -> tuple[np.ndarray, np.ndarray]:
    """Times (seconds from the benchmark start) of every content chunk of the successful
    requests, and the output tokens attributed to each: a request's ``output_len`` spread evenly
    over its chunks, so the weights of a request sum to its ``output_len``."""
    times: list[float] = []
    weights: list[float] = []
    for r in results:
        if not r.success:
            continue
        chunk_times = r.start + r.ttft + np.concatenate(([0.0], np.cumsum(r.itls)))
        times.extend(chunk_times.tolist())
        weights.extend([r.output_len / len(chunk_times)] * len(chunk_times))
    return np.asarray(times, dtype=np.float64), np.asarray(weights, dtype=np.float64)


def _cdf_panel(ax: Any, values_ms: np.ndarray, name: str, color: str, slo_ms: float | None) -> None:
    if values_ms.size == 0:
        ax.text(0.5, 0.5, "no successful request", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(name)
        return
    xs = np.sort(values_ms)
    ys = np.arange(1, xs.size + 1) / xs.size
    ax.step(xs, ys, where="post", color=color, linewidth=1.8)
    for q, style in ((50, "--"), (99, ":")):
        v = float(np.percentile(values_ms, q))
        ax.axvline(v, color="0.3", linestyle=style, linewidth=1.0)
        ax.annotate(
            f"p{q} {v:.1f} ms",
            xy=(v, q / 100.0),
            xytext=(4, -12 if q == 99 else 4),
            textcoords="offset points",
            fontsize=8,
        )
    if slo_ms is not None:
        ax.axvline(slo_ms, color="tab:red", linewidth=1.2, label=f"SLO {slo_ms:g} ms")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_title(f"{name} (CDF, n={xs.size})")
    ax.set_xlabel("ms")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3)


def _itl_panel(ax: Any, ok: Sequence[RequestResult]) -> None:
    """Histogram of the inter-token gaps of the successful requests, with p50/p99 markers."""
    itl = np.array([g for r in ok for g in r.itls]) * 1000.0
    if itl.size:
        # a few stalls must not squash the bulk of the distribution into one bin
        upper = min(float(itl.max()), 3.0 * float(np.percentile(itl, 99))) or 1.0
        hidden = int(np.sum(itl > upper))
        bins = min(60, max(10, itl.size // 20))
        ax.hist(itl, bins=bins, range=(0.0, upper), color="tab:green", alpha=0.8)
        for q, style in ((50, "--"), (99, ":")):
            v = float(np.percentile(itl, q))
            ax.axvline(v, color="0.3", linestyle=style, linewidth=1.0, label=f"p{q} {v:.1f} ms")
        if hidden:
            ax.plot([], [], " ", label=f"{hidden} gaps > {upper:.0f} ms not shown")
        ax.legend(fontsize=8)
        ax.set_yscale("log")
    else:
        ax.text(0.5, 0.5, "no inter-token gaps", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(f"Inter-token latency (n={itl.size})")
    ax.set_xlabel("ms")
    ax.set_ylabel("gaps")
    ax.grid(alpha=0.3)


def _throughput_panel(ax: Any, results: Sequence[RequestResult], duration: float) -> None:
    """Output tokens/s over the run in bins of 0.1 s (at most 60), with requests in flight."""
    times, weights = chunk_timeline(results)
    num_bins = int(np.clip(duration / 0.1, 1, 60))
    edges = np.linspace(0.0, duration, num_bins + 1)
    width = edges[1] - edges[0]
    tokens, _ = np.histogram(np.clip(times, 0.0, duration), bins=edges, weights=weights)
    ax.bar(
        edges[:-1],
        tokens / width,
        width=width,
        align="edge",
        color="tab:orange",
        alpha=0.85,
        label="output tok/s",
    )
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens / s")
    ax.set_xlim(0.0, duration)
    ax.grid(alpha=0.3)
    starts = np.array([r.start for r in results])
    ends = np.array([r.start + r.latency for r in results])
    mids = (edges[:-1] + edges[1:]) / 2.0
    in_flight = [(np.sum((starts <= t) & (ends > t))) for t in mids]
    twin = ax.twinx()
    twin.plot(mids, in_flight, color="0.2", linewidth=1.2, label="requests in flight")
    twin.set_ylabel("requests in flight")
    twin.set_ylim(bottom=0)
    handles = ax.get_legend_handles_labels()
    twin_handles = twin.get_legend_handles_labels()
    ax.legend(
        handles[0] + twin_handles[0],
        handles[1] + twin_handles[1],
        fontsize=8,
        loc="upper right",
    )
    ax.set_title("Throughput over the run")


def plot_benchmark(
    results: Sequence[RequestResult],
    metrics: Mapping[str, Any],
    path: str | Path,
    *,
    title: str,
    slos: Mapping[str, float] | None = None,
) -> Path:
    """Write a 2x2 PNG to ``path`` and return it: TTFT and E2E latency CDFs with p50/p99
    markers (and SLO lines), the ITL histogram, and output tokens/s over the run with requests
    in flight. ``title`` heads the figure above a line of key figures from ``metrics``."""
    plt = pyplot()
    slos = slos or {}
    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    try:
        ttft = np.array([r.ttft for r in ok]) * 1000.0
        e2el = np.array([r.latency for r in ok]) * 1000.0
        _cdf_panel(axes[0, 0], ttft, "Time to first token", "tab:blue", slos.get("ttft_ms"))
        _cdf_panel(axes[0, 1], e2el, "End-to-end latency", "tab:purple", slos.get("e2el_ms"))
        _itl_panel(axes[1, 0], ok)
        _throughput_panel(axes[1, 1], results, float(metrics["duration"]))
        out = save_figure(fig, path, f"{title}\n{_key_figures(metrics)}", fontsize=12)
    finally:
        plt.close(fig)
    return out


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f} ms"


def _key_figures(metrics: Mapping[str, Any]) -> str:
    parts = [
        f"{metrics['completed']} ok / {metrics['failed']} failed",
        f"{metrics['request_throughput']:.2f} req/s",
        f"{metrics['output_throughput']:.1f} out tok/s",
        f"TTFT p50 {_ms(metrics['median_ttft_ms'])}",
        f"TPOT p50 {_ms(metrics['median_tpot_ms'])}",
    ]
    if "goodput" in metrics:
        parts.append(f"goodput {metrics['goodput']:.2f} req/s")
    return "  ·  ".join(parts)


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str | Path, title: str, fontsize: int = 11) -> Path:
    """Give ``fig`` its title and a tight layout, write it as a 110-dpi PNG to ``path``."""
    fig.suptitle(title, fontsize=fontsize)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    return out


def plot_ablation(
    rows: Sequence[Mapping[str, Any]],
    path: str | Path,
    *,
    title: str,
    metrics: Mapping[str, str],
) -> Path:
    """Write one horizontal bar panel per metric in ``metrics`` (key -> label) to ``path``:
    one bar per row, labelled ``experiment: variant``, coloured by experiment, each annotated
    with its value and, for non-reference rows, its ratio to the experiment's reference row
    (``row["ratio"][key]``). Missing values are drawn as empty bars marked n/a."""
    plt = pyplot()
    keys = list(metrics)
    ncols = min(4, len(keys))
    nrows = -(-len(keys) // ncols)
    height = max(3.0, 0.32 * len(rows) + 1.2)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, height * nrows), squeeze=False)
    experiments = list(dict.fromkeys(str(r["experiment"]) for r in rows))
    palette = plt.get_cmap("tab10")
    colors = {e: palette(i % 10) for i, e in enumerate(experiments)}
    labels = [f"{r['experiment']}: {r['variant']}" for r in rows]
    ypos = np.arange(len(rows))[::-1]
    try:
        for k, (ax, key) in enumerate(zip(axes.flat, keys)):
            values = [r.get(key) for r in rows]
            finite = [float(v) for v in values if v is not None and np.isfinite(v)]
            top = max(finite, default=1.0) or 1.0
            for y, row, v in zip(ypos, rows, values):
                color = colors[str(row["experiment"])]
                if v is None or not np.isfinite(v):
                    ax.text(0, y, " n/a", va="center", fontsize=7)
                    continue
                ax.barh(y, float(v), color=color, alpha=0.55 if row.get("reference") else 0.9)
                text = f" {float(v):,.0f}" if abs(float(v)) >= 100 else f" {float(v):.3g}"
                ratio = (row.get("ratio") or {}).get(key)
                if not row.get("reference") and ratio is not None:
                    text += f" (×{ratio:.2f})"
                ax.text(float(v), y, text, va="center", fontsize=7)
            ax.set_xlim(0, top * 1.45)
            ax.set_yticks(ypos)
            ax.set_yticklabels(labels if k % ncols == 0 else [], fontsize=8)
            ax.set_title(metrics[key], fontsize=10)
            ax.grid(axis="x", alpha=0.3)
        for ax in list(axes.flat)[len(keys) :]:
            ax.axis("off")
        out = save_figure(fig, path, f"{title}\n(light bars: full configuration; ×ratio vs it)")
    finally:
        plt.close(fig)
    return out


def plot_sweep(points: Sequence[Mapping[str, Any]], path: str | Path, *, title: str) -> Path:
    """Latency-throughput curves of a request-rate sweep, written to ``path``: mean and p99 TTFT
    and TPOT against achieved output tokens/s (one point per offered rate, annotated with it),
    and achieved against offered request rate. ``points`` are ``compute_metrics`` dicts with a
    ``request_rate`` key."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    xs = [float(p["output_throughput"]) for p in points]
    rates = [p["request_rate"] for p in points]
    try:
        for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
            for stat, style in (("mean", "o-"), ("p99", "s--")):
                ys = [p[f"{stat}_{metric}_ms"] for p in points]
                ys_f = [np.nan if y is None else float(y) for y in ys]
                ax.plot(xs, ys_f, style, label=f"{stat} {name}")
            for x, y, r in zip(xs, [p[f"mean_{metric}_ms"] for p in points], rates):
                if y is not None:
                    ax.annotate(
                        f"{r} req/s",
                        (x, float(y)),
                        xytext=(3, 3),
                        textcoords="offset points",
                        fontsize=7,
                    )
            ax.set_xlabel("achieved output tokens / s")
            ax.set_ylabel(f"{name} (ms)")
            ax.set_title(f"{name} vs throughput")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
        ax = axes[2]
        offered = [float(r) for r in rates]
        achieved = [float(p["request_throughput"]) for p in points]
        ax.plot(offered, achieved, "o-", label="achieved")
        finite = [r for r in offered if np.isfinite(r)]
        if finite:
            ax.plot([0, max(finite)], [0, max(finite)], ":", color="0.5", label="offered")
        ax.set_xlabel("offered request rate (req/s)")
        ax.set_ylabel("achieved request rate (req/s)")
        ax.set_title("Throughput vs offered load")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        out = save_figure(fig, path, title)
    finally:
        plt.close(fig)
    return out
