"""Requests, the paged KV cache, the scheduler and the engine step."""
