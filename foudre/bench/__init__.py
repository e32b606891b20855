"""Benchmarks: ``serve`` (online load generator against an OpenAI-compatible server)."""
