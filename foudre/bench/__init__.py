"""Benchmarks: ``serve`` (HTTP load generator), ``offline`` (replay driver, throughput, latency),
``ablate`` (one technique off at a time), ``sweep`` (request-rate curves), with ``metrics``,
``datasets``, ``roofline`` and ``plots`` shared by all."""
