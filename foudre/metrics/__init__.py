"""Serving metrics: per-request latency statistics and their Prometheus export."""
