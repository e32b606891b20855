"""Serving benchmark arithmetic: per-request traces in, summary figures out.

Definitions (the established ones, as in vLLM's ``benchmark_serving``):

- TTFT: time from sending the request to receiving the first content chunk.
- ITL: each gap between two successive content chunks of one request.
- E2EL: time from sending the request to the end of its stream.
- TPOT: ``(E2EL - TTFT) / (output_tokens - 1)``, defined only for requests with more than one
  output token.

Failed requests are counted in ``failed`` and contribute to nothing else: not to token totals,
throughputs, latency statistics or goodput. Nothing here reads a clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
"""Latency metrics summarised with mean / median / std / p90 / p99, in milliseconds."""

SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")
"""Service-level objectives accepted by ``compute_metrics`` (upper bounds, milliseconds)."""


@dataclass(slots=True)
class RequestResult:
    """The measured trace of one benchmark request. Times are in seconds.

    ``start`` is when the request was sent, relative to the benchmark start; the chunk times of
    a successful request are ``start + ttft``, then successive additions of ``itls``.
    ``error`` is empty exactly when ``success`` is true.
    """

    input_len: int
    output_len: int = 0
    start: float = 0.0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    success: bool = False
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first, or None if it is undefined."""
        if not self.success or self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def summarize(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, median, std, p90 and p99 of ``values_s`` (seconds), in milliseconds.

    Percentiles use numpy's default linear interpolation; std is the population one (ddof=0).
    An empty input gives None for every statistic rather than an invented number.
    """
    if len(values_s) == 0:
        return {"mean": None, "median": None, "std": None, "p90": None, "p99": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {
        "mean": float(np.mean(ms)),
        "median": float(np.median(ms)),
        "std": float(np.std(ms)),
        "p90": float(np.percentile(ms, 90)),
        "p99": float(np.percentile(ms, 99)),
    }


def meets_slos(result: RequestResult, slos: Mapping[str, float]) -> bool:
    """Whether a successful ``result`` meets every SLO in ``slos`` (``SLO_KEYS``, in ms).

    A failed request meets none. A request with a single output token has no TPOT, so a TPOT
    objective cannot be violated by it.
    """
    if not result.success:
        return False
    for key, bound_ms in slos.items():
        if key == "ttft_ms":
            value: float | None = result.ttft
        elif key == "tpot_ms":
            value = result.tpot
        elif key == "e2el_ms":
            value = result.latency
        else:
            raise ValueError(f"unknown SLO {key!r}; expected one of {', '.join(SLO_KEYS)}")
        if value is not None and value * 1000.0 > bound_ms:
            return False
    return True


def compute_metrics(
    results: Sequence[RequestResult],
    duration: float,
    slos: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Summary figures of a benchmark run that lasted ``duration`` seconds.

    Returns ``completed``, ``failed``, ``duration``, ``total_input_tokens``,
    ``total_output_tokens``, ``request_throughput``, ``output_throughput``,
    ``total_token_throughput`` and, for each m in ``METRICS``, ``mean_<m>_ms``, ``median_<m>_ms``,
    ``std_<m>_ms``, ``p90_<m>_ms`` and ``p99_<m>_ms`` (None when no request contributes), plus
    ``goodput`` (requests per second meeting all ``slos``) and ``slo_attainment`` (the
    fraction of all requests, failed ones included, that met them) when ``slos`` is non-empty.

    Token totals and statistics cover successful requests only; ITL statistics are over the
    gaps of all successful requests pooled together.
    """
    if duration <= 0:
        raise ValueError(f"duration must be positive, got {duration}")
    slos = dict(slos or {})
    for key in slos:
        if key not in SLO_KEYS:
            raise ValueError(f"unknown SLO {key!r}; expected one of {', '.join(SLO_KEYS)}")

    ok = [r for r in results if r.success]
    total_input = sum(r.input_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    samples: dict[str, list[float]] = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for r in ok if (t := r.tpot) is not None],
        "itl": [gap for r in ok for gap in r.itls],
        "e2el": [r.latency for r in ok],
    }

    out: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for m in METRICS:
        for stat, value in summarize(samples[m]).items():
            out[f"{stat}_{m}_ms"] = value
    if slos:
        met = sum(meets_slos(r, slos) for r in ok)
        out["goodput"] = met / duration
        out["slo_attainment"] = met / len(results) if results else 0.0
    return out


def request_arrays(results: Sequence[RequestResult]) -> dict[str, list[Any]]:
    """Per-request arrays, aligned with ``results``: ``ttfts`` and ``e2els`` (seconds, None for
    failed requests), ``itls`` (list of gap lists, seconds), ``output_lens``, ``input_lens`` and
    ``errors`` ("" for successful requests)."""
    return {
        "ttfts": [r.ttft if r.success else None for r in results],
        "itls": [list(r.itls) if r.success else [] for r in results],
        "e2els": [r.latency if r.success else None for r in results],
        "output_lens": [r.output_len if r.success else 0 for r in results],
        "input_lens": [r.input_len for r in results],
        "errors": [r.error for r in results],
    }
