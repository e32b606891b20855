"""Attention backends behind one interface (see ``base.AttentionBackend``)."""

from foudre.runner.attention.base import AttentionBackend, BatchLayout
from foudre.runner.attention.torch_sdpa import TorchSDPABackend

__all__ = ["AttentionBackend", "BatchLayout", "TorchSDPABackend", "get_backend"]


def get_backend(name: str) -> AttentionBackend:
    """The backend registered under ``name``; ``ValueError`` for an unknown one."""
    # "contiguous" is the non-paged baseline: the same kernels over per-request buffers reserved
    # at max_model_len (see KVCacheManager's reserve_tokens)
    if name in ("torch", "sdpa", "auto", "contiguous"):
        return TorchSDPABackend()
    raise ValueError(f"unknown attention backend {name!r} (available: torch, contiguous)")
