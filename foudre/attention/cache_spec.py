"""What one layer keeps per token in the paged KV cache: a cache spec.

A model declares one spec per layer (``kv_cache_specs()``); the runner allocates each layer's
pages from its spec and sizes the pool by the specs' bytes per token, summed over the layers.
Every spec hands the attention backends the same 5-D view, ``[2, blocks, block_size,
kv_heads, head_dim]`` (K then V), so no backend needs to know which spec it reads:

- ``FullAttentionSpec``: K and V of every KV head, each its own memory (Llama and its family;
  with ``window`` the layer only looks back that far: see the layer groups below);
- ``LatentAttentionSpec``: multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) keeps one
  vector per token shared by all heads, the ``latent_dim`` compressed KV followed by the
  ``rope_dim`` decoupled RoPE key. The backends see it as multi-query attention with one KV
  head of ``latent_dim + rope_dim`` whose V is the same memory as its K::

      pages  [blocks, block_size, 1, latent_dim + rope_dim]       what is allocated
      view   pages.unsqueeze(0).expand(2, ...)                    stride 0 on the K/V axis

  so ``view[0]`` and ``view[1]`` alias: a backend that stores V after K writes the same values
  twice, and the attention output's first ``latent_dim`` values are the latent-space output
  (the model applies W_UV to them).

Layer groups (``kv_cache_groups``): the layers whose cache the manager keeps alike. A model
without sliding windows is one group of all its layers. A model with windows (Mistral: every
layer; Gemma 3: five in six; gpt-oss: every other) groups its layers by window (None: full
attention), each kind cut into groups of the same number of layers, ``size`` (the greatest
common divisor of the kinds' counts)::

    Gemma 3, 6 layers   L0 L1 L2 L3 L4 [L5 global]   ->  6 groups of 1 layer
    gpt-oss, 4 layers   L0 [L1] L2 [L3]              ->  (L1 L3) full, (L0 L2) window

Each request holds one block table per group, all drawn from one pool of block ids; the
runner allocates ``size`` page tensors, and layer ``j`` of every group uses tensor ``j`` (a
block id belongs to one group at a time, so its pages hold that group's layers only). A window
group's blocks behind its window go back to the pool (``engine/kv_cache.py``); so a block id
costs ``size`` layers' pages, and the memory of ``n`` blocks of every layer makes ``n`` times
the number of groups block ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from foudre.native import huge_pages


def element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# a CPU pool this large or more lies in 2 MiB pages: a second-level TLB reaches about 8 MiB of
# 4 KiB pages, and a smaller pool would keep most of its last 2 MiB page resident for nothing
HUGE_POOL_BYTES = 8 << 20


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A KV pool of zeros: on the CPU in 2 MiB pages (``huge_pages.zeros``) from
    ``HUGE_POOL_BYTES`` on, since decode attention reads each row's blocks from anywhere in the
    pool, and from 4 KiB pages every block read costs a TLB miss of its own."""
    if (
        torch.device(device).type == "cpu"
        and math.prod(shape) * element_size(dtype) >= HUGE_POOL_BYTES
    ):
        return huge_pages.zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass(frozen=True, slots=True)
class FullAttentionSpec:
    """K and V of ``num_kv_heads`` heads of ``head_dim`` per token (``window``: a sliding
    window, which the backends apply; the pages are the same, the blocks a request keeps are
    not: see ``kv_cache_groups``)."""

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
        return zeroed_pages(self.page_shape(num_blocks, block_size), dtype, device)


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
        pages = zeroed_pages(self.page_shape(num_blocks, block_size), dtype, device)
        return pages.unsqueeze(0).expand(2, *pages.shape)


class RecurrentCache(NamedTuple):
    """A recurrent layer's state pools, one slot per request (and per prefix-cache snapshot):
    ``conv [slots, conv_window, conv_dim]`` and ``ssm [slots, *ssm_shape]``."""

    conv: torch.Tensor
    ssm: torch.Tensor


@dataclass(frozen=True, slots=True)
class RecurrentStateSpec:
    """What one recurrent layer (a Mamba-2 mixer, a gated DeltaNet) keeps per request, whatever
    the sequence length: the window of its causal convolution ``[conv_window, conv_dim]`` (in
    the model dtype) and its recurrent state ``[num_heads, head_dim, state_size]`` (float32: it
    accumulates over the whole sequence; a DeltaNet's ``[heads, key_dim, value_dim]``)."""

    conv_window: int
    conv_dim: int
    num_heads: int
    head_dim: int
    state_size: int
    ssm_dtype: torch.dtype = torch.float32

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_window, self.conv_dim)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.num_heads, self.head_dim, self.state_size)

    def bytes_per_request(self, dtype: torch.dtype) -> int:
        """Bytes of one request's state in this layer (conv state in ``dtype``)."""
        conv = self.conv_window * self.conv_dim * element_size(dtype)
        ssm = math.prod(self.ssm_shape) * element_size(self.ssm_dtype)
        return conv + ssm

    def allocate(self, num_slots: int, dtype: torch.dtype, device: torch.device) -> RecurrentCache:
        """Zeroed pools of ``num_slots`` slots."""
        return RecurrentCache(
            torch.zeros(num_slots, *self.conv_shape, dtype=dtype, device=device),
            torch.zeros(num_slots, *self.ssm_shape, dtype=self.ssm_dtype, device=device),
        )


AttentionSpec = FullAttentionSpec | LatentAttentionSpec
CacheSpec = FullAttentionSpec | LatentAttentionSpec | RecurrentStateSpec


def attention_layers(specs: Sequence[CacheSpec]) -> list[int]:
    """The indices of the layers that keep a paged cache (all but the recurrent ones)."""
    return [i for i, s in enumerate(specs) if not isinstance(s, RecurrentStateSpec)]


def recurrent_layers(specs: Sequence[CacheSpec]) -> list[int]:
    """The indices of the layers that keep a recurrent state per request."""
    return [i for i, s in enumerate(specs) if isinstance(s, RecurrentStateSpec)]


def state_bytes_per_request(specs: Sequence[CacheSpec], dtype: torch.dtype) -> int:
    """A request's recurrent state over every recurrent layer (0 for a transformer)."""
    return sum(s.bytes_per_request(dtype) for s in specs if isinstance(s, RecurrentStateSpec))


def pages_of(cache: torch.Tensor) -> list[torch.Tensor]:
    """The distinct memories of a layer's 5-D cache view, each ``[blocks, block_size, heads,
    dim]``: K and V, or the one latent page tensor both alias (what a block copy must copy)."""
    if cache.stride(0) == 0:
        return [cache[0]]
    return [cache[0], cache[1]]


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers whose blocks the cache manager keeps alike: their sliding ``window`` (None: full
    attention) and their indices, in layer order."""

    window: int | None
    layers: tuple[int, ...]


def kv_cache_groups(specs: Sequence[CacheSpec]) -> list[KVCacheGroup]:
    """The layer groups of a model of these per-layer specs (see the module docstring): one
    group of every attention layer without sliding windows, or where layers of different page
    shapes (or latent attention) could not share page tensors; else groups of equal size by
    window, full attention first. Recurrent layers are in no group (they hold a state slot,
    not blocks); a model of recurrent layers only has one group of no layers, whose blocks
    cost nothing and still count its tokens for the prefix cache."""
    layers = attention_layers(specs)
    whole = [KVCacheGroup(None, tuple(layers))]
    windows = {
        i: s.window if isinstance(s, FullAttentionSpec) else None for i, s in enumerate(specs)
    }
    if all(windows[i] is None for i in layers):
        return whole
    shapes = {
        (s.num_kv_heads, s.head_dim) if isinstance(s, FullAttentionSpec) else s
        for s in (specs[i] for i in layers)
    }
    if len(shapes) > 1:
        kinds_seen = {windows[i] for i in layers}
        return [KVCacheGroup(kinds_seen.pop() if len(kinds_seen) == 1 else None, whole[0].layers)]
    kinds: dict[int | None, list[int]] = {}
    for i in layers:
        kinds.setdefault(windows[i], []).append(i)
    size = math.gcd(*(len(group) for group in kinds.values()))
    order = sorted(kinds, key=lambda w: (w is not None, w or 0))
    return [
        KVCacheGroup(w, tuple(kinds[w][i : i + size]))
        for w in order
        for i in range(0, len(kinds[w]), size)
    ]
