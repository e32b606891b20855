"""The attention backend interface the models call (``base``), and dense causal attention
without a KV cache (``causal``) for training, evaluation and calibration. The paged backends
that serve requests live in ``foudre.runner.attention``."""

from foudre.layers.attention.base import AttentionBackend, BatchLayout

__all__ = ["AttentionBackend", "BatchLayout"]
