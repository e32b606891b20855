"""One-figure picture of a serving benchmark run (matplotlib, Agg backend: no display needed)."""

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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    slos = slos or {}
    ok = [r for r in results if r.success]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    try:
        ttft = np.array([r.ttft for r in ok]) * 1000.0
        e2el = np.array([r.latency for r in ok]) * 1000.0
        _cdf_panel(axes[0, 0], ttft, "Time to first token", "tab:blue", slos.get("ttft_ms"))
        _cdf_panel(axes[0, 1], e2el, "End-to-end latency", "tab:purple", slos.get("e2el_ms"))

        ax = axes[1, 0]
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
            ax.text(
                0.5, 0.5, "no inter-token gaps", ha="center", va="center", transform=ax.transAxes
            )
        ax.set_title(f"Inter-token latency (n={itl.size})")
        ax.set_xlabel("ms")
        ax.set_ylabel("gaps")
        ax.grid(alpha=0.3)

        ax = axes[1, 1]
        duration = float(metrics["duration"])
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

        fig.suptitle(f"{title}\n{_key_figures(metrics)}", fontsize=12)
        fig.tight_layout()
        out = Path(path)
        fig.savefig(out, dpi=110)
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
