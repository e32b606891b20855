"""Prometheus export of the server's metrics, on a per-app ``CollectorRegistry``.

Latency histograms are observed from each request's outputs; counters and gauges that mirror
engine totals (tokens, preemptions, prefix cache, KV usage, queue lengths) are read from the
engine's metrics snapshot at scrape time, so they can never drift from the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from foudre.metrics.stats import RequestStatsTracker
from foudre.outputs import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_TOKEN_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075,
    0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip


class _EngineCollector(Collector):
    """Counters and gauges read from an engine metrics snapshot (``AsyncLLM.metrics()``)."""

    _COUNTERS = (
        ("foudre:prompt_tokens", "Prompt tokens processed.", "prompt_tokens"),
        ("foudre:generation_tokens", "Tokens generated.", "generation_tokens"),
        ("foudre:num_preemptions", "Requests preempted for lack of KV blocks.", "num_preemptions"),
        ("foudre:prefix_cache_queries", "Prompt blocks looked up in the prefix cache.",
         "prefix_cache_queries"),
        ("foudre:prefix_cache_hits", "Prompt blocks found in the prefix cache.",
         "prefix_cache_hits"),
        ("foudre:spec_decode_num_drafts", "Speculative verifications (requests with drafts).",
         "spec_num_drafts"),
        ("foudre:spec_decode_num_draft_tokens", "Draft tokens proposed and verified.",
         "spec_draft_tokens"),
        ("foudre:spec_decode_num_accepted_tokens", "Draft tokens accepted by the target.",
         "spec_accepted_tokens"),
        ("foudre:engine_step_failures", "Engine steps whose forward raised (requests isolated).",
         "num_step_failures"),
        ("foudre:kv_cache_cow_copies", "KV blocks copied before a write (copy-on-write).",
         "num_cow_copies"),
        ("foudre:engine_failed_requests", "Requests failed by a step they ran alone.",
         "num_failed_requests"),
    )  # fmt: skip
    _GAUGES = (
        ("foudre:num_requests_running", "Requests in the running batch.", "num_running"),
        ("foudre:num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
        ("foudre:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).",
         "kv_cache_usage"),
        ("foudre:kv_cache_blocks_used", "KV-cache blocks held by requests.", "num_used_blocks"),
        ("foudre:kv_cache_shared_blocks", "KV-cache blocks held by more than one sequence.",
         "num_shared_blocks"),
        ("foudre:recurrent_state_slots_used", "Recurrent state slots held by requests.",
         "num_used_state_slots"),
        ("foudre:recurrent_state_snapshot_bytes",
         "Bytes of recurrent state snapshots held for the prefix cache.", "state_snapshot_bytes"),
        ("foudre:spec_decode_mean_acceptance_length",
         "Tokens per speculative verification step (accepted drafts + 1).",
         "spec_mean_acceptance_length"),
    )  # fmt: skip

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        for name, doc, key in self._COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(snap.get(key, 0)))
        for name, doc, key in self._GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(snap.get(key, 0)))
        per_position = CounterMetricFamily(
            "foudre:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (1 = first).",
            labels=["position"],
        )
        for i, count in enumerate(snap.get("spec_accepted_per_position", [])):
            per_position.add_metric([str(i + 1)], float(count))
        yield per_position
        experts = CounterMetricFamily(
            "foudre:moe_expert_tokens",
            "Tokens routed to each expert of each mixture-of-experts layer.",
            labels=["layer", "expert"],
        )
        for layer, counts in snap.get("moe_expert_tokens", {}).items():
            for expert, count in enumerate(counts):
                experts.add_metric([str(layer), str(expert)], float(count))
        yield experts


class PrometheusMetrics:
    """All ``foudre:`` metrics of one server. ``observe`` is the engine-thread output hook;
    ``render`` gives the text exposition."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.ttft = Histogram(
            "foudre:time_to_first_token_seconds",
            "Time from arrival to the first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "foudre:inter_token_latency_seconds",
            "Gap between successive tokens of a request.",
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        )
        self.tpot = Histogram(
            "foudre:time_per_output_token_seconds",
            "(last token time - first token time) / (output tokens - 1), per request.",
            buckets=_TOKEN_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "foudre:e2e_request_latency_seconds",
            "Time from arrival to finish.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "foudre:request_queue_time_seconds",
            "Time from arrival to first scheduling.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.success = Counter(
            "foudre:request_success",
            "Finished requests, by finish reason.",
            ["finish_reason"],
            registry=reg,
        )
        for reason in ("stop", "length", "abort"):
            self.success.labels(reason)
        reg.register(_EngineCollector(snapshot))
        self._tracker = RequestStatsTracker()

    def observe(self, out: RequestOutput) -> None:
        ev = self._tracker.update(out)
        for gap in ev.itl:
            self.itl.observe(gap)
        if not ev.finished:
            return
        self.success.labels(ev.finish_reason or "unknown").inc()
        for hist, value in (
            (self.ttft, ev.ttft),
            (self.tpot, ev.tpot),
            (self.e2e, ev.e2e),
            (self.queue_time, ev.queue_time),
        ):
            if value is not None:
                hist.observe(value)

    def render(self) -> bytes:
        return generate_latest(self.registry)
