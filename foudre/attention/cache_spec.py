"""What one layer keeps per token in the paged KV cache: a cache spec.

A model declares one spec per layer (``kv_cache_specs()``); the runner allocates each layer's
pages from its spec and sizes the pool by the specs' bytes per token, summed over the layers.
Every spec hands the attention backends the same 5-D view, ``[2, blocks, block_size,
kv_heads, head_dim]`` (K then V), so no backend needs to know which spec it reads:

- ``FullAttentionSpec``: K and V of every KV head, each its own memory (Llama and its family;
  with ``window`` the layer only looks back that far, but keeps its blocks as full attention
  does);
- ``LatentAttentionSpec``: multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) keeps one
  vector per token shared by all heads, the ``latent_dim`` compressed KV followed by the
  ``rope_dim`` decoupled RoPE key. The backends see it as multi-query attention with one KV
  head of ``latent_dim + rope_dim`` whose V is the same memory as its K::

      pages  [blocks, block_size, 1, latent_dim + rope_dim]       what is allocated
      view   pages.unsqueeze(0).expand(2, ...)                    stride 0 on the K/V axis

  so ``view[0]`` and ``view[1]`` alias: a backend that stores V after K writes the same values
  twice, and the attention output's first ``latent_dim`` values are the latent-space output
  (the model applies W_UV to them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """K and V of ``num_kv_heads`` heads of ``head_dim`` per token (``window``: a sliding
    window, which the backends apply; the pages are the same)."""

    num_kv_heads: int
    head_dim: int
    window: int | None = None

    @property
    def num_kv_heads_seen(self) -> int:
        """KV heads as the backends see them."""
        return self.num_kv_heads

    @property
    def head_dim_seen(self) -> int:
        """Head size as the backends see it."""
        return self.head_dim

    def page_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """The shape of the tensor allocated for ``num_blocks`` blocks."""
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def values_per_token(self) -> int:
        """Cached values per token (K and V)."""
        return 2 * self.num_kv_heads * self.head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.values_per_token() * element_size(dtype)

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Zeroed pages, as the backends read them: ``[2, blocks, block_size, heads, dim]``."""
        return torch.zeros(self.page_shape(num_blocks, block_size), dtype=dtype, device=device)


@dataclass(frozen=True, slots=True)
class LatentAttentionSpec:
    """One vector per token shared by all heads: the ``latent_dim`` compressed KV (after its
    norm), then the ``rope_dim`` rotated key."""

    latent_dim: int
    rope_dim: int

    @property
    def num_kv_heads_seen(self) -> int:
        return 1

    @property
    def head_dim_seen(self) -> int:
        return self.latent_dim + self.rope_dim

    def page_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, 1, self.latent_dim + self.rope_dim)

    def values_per_token(self) -> int:
        return self.latent_dim + self.rope_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        return self.values_per_token() * element_size(dtype)

    def allocate(
        self, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """Zeroed pages viewed as the backends read them: ``[2, blocks, block_size, 1, D]``
        whose K and V halves are the same memory (stride 0)."""
        pages = torch.zeros(self.page_shape(num_blocks, block_size), dtype=dtype, device=device)
        return pages.unsqueeze(0).expand(2, *pages.shape)


CacheSpec = FullAttentionSpec | LatentAttentionSpec


def pages_of(cache: torch.Tensor) -> list[torch.Tensor]:
    """The distinct memories of a layer's 5-D cache view, each ``[blocks, block_size, heads,
    dim]``: K and V, or the one latent page tensor both alias (what a block copy must copy)."""
    if cache.stride(0) == 0:
        return [cache[0]]
    return [cache[0], cache[1]]
