"""The attention backend interface and the batch layout every backend receives.

The runner flattens the new tokens of all scheduled requests into one sequence of ``T`` tokens::

    request 0            request 1   request 2
    [ q q q q q q ]      [ q ]       [ q q q ]      <- new tokens, in schedule order
    query_start_loc = [0, 6, 7, 10]
    seq_lens        = [ctx0+6, ctx1+1, ctx2+3]      <- context (cached + new) per request

Each request's new tokens are the *last* ``q_len`` positions of its context; their K/V are
written to the paged cache at ``slot_mapping`` before attention reads the whole context back
through the request's block table. A backend must therefore make every token attend causally to
all earlier positions of its own request, and to nothing else; a layer with a sliding window
``W`` (``forward(..., window=W)``) to the last ``W`` positions only, its own included.

Attention sinks (gpt-oss: ``forward(..., sinks=s)``, ``s`` ``[num_heads]``): head ``h``'s softmax
takes one more logit, ``s[h]``, in its denominator, a key whose value is zero::

    out = sum_j exp(x_j) v_j / (exp(s[h]) + sum_j exp(x_j))      x_j = scale * q . k_j

so a head may attend to nothing. Every backend applies them (or raises ``ValueError``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


def table_tensor(tables: Sequence[Sequence[int]] | torch.Tensor) -> torch.Tensor:
    """Block tables as an int32 tensor ``[rows, width]``: lists padded with zeros, a tensor
    as it is (its entries past a row's blocks are never read)."""
    if isinstance(tables, torch.Tensor):
        return tables
    width = max((len(t) for t in tables), default=0)
    return torch.tensor([[*t, *[0] * (width - len(t))] for t in tables], dtype=torch.int32)


def slot_mapping(
    tables: torch.Tensor,
    positions: np.ndarray,
    block_size: int,
    token_rows: np.ndarray | None = None,
) -> torch.Tensor:
    """Each token's cache slot (int64, on the host): the block its position (int64) falls in,
    in its row's table (``token_rows``: each token's row; None: token ``i`` is row ``i``), times
    ``block_size``, plus the offset in the block. (In numpy: a few small ops, each several times
    cheaper than torch's.)"""
    rows = np.arange(len(positions)) if token_rows is None else token_rows
    blocks = tables.cpu().numpy()[rows, positions // block_size]
    return torch.from_numpy(blocks * np.int64(block_size) + positions % block_size)


@dataclass(slots=True)
class BatchLayout:
    """What a step computes, in the backend-neutral form the runner builds."""

    query_lens: list[int]  # new tokens per request
    seq_lens: list[int]  # context length per request after this step's tokens
    # physical block ids per request: int32 ``[requests, width]``, row ``i`` starting with the
    # blocks of request ``i`` (entries past its ``ceil(seq_lens[i] / block_size)``: unused);
    # lists are accepted too (``table_tensor`` pads them)
    block_tables: torch.Tensor | list[list[int]]
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) per token
    block_size: int

    def tables(self) -> torch.Tensor:
        """``block_tables`` as an int32 tensor (``table_tensor``)."""
        return table_tensor(self.block_tables)


@dataclass(slots=True)
class GroupedMetadata:
    """A step's metadata for a model whose layers form several cache groups (their own block
    tables, see ``attention/cache_spec.py``): the backend's metadata of each group, built once
    per step, and each layer's group; the model hands layer ``i`` ``for_layer(i)``."""

    groups: list[Any]
    group_of_layer: list[int]

    def for_layer(self, index: int) -> Any:
        return self.groups[self.group_of_layer[index]]


class AttentionBackend(ABC):
    """Stores the new K/V into the paged cache and computes attention for the flat batch."""

    name: str = "abstract"

    @abstractmethod
    def build_metadata(self, layout: BatchLayout, device: torch.device) -> Any:
        """Precompute whatever the per-layer ``forward`` needs, once per step."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: Any,  # [2, num_blocks, block_size, num_kv_heads, head_dim] or quantized
        metadata: Any,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]: each head's sink logit
    ) -> torch.Tensor:
        """Return attention outputs ``[T, num_heads, head_dim]``: a query at position ``p``
        attends to keys ``0 .. p`` of its request, or ``p - window + 1 .. p``; with ``sinks``,
        each head's softmax denominator also holds ``exp(sinks[h])``."""


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> torch.Tensor | None:
    """``sinks`` as a contiguous float32 vector of ``num_heads`` (None stays None);
    ``ValueError`` for another shape."""
    if sinks is None:
        return None
    if tuple(sinks.shape) != (num_heads,):
        raise ValueError(
            f"attention sinks must have one value per query head ({num_heads}), "
            f"got shape {tuple(sinks.shape)}"
        )
    return sinks.detach().to(torch.float32).contiguous()


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """``cache`` indexed along ``dim`` (its block axis) by ``tables`` ``[B, n]``: the tables'
    shape takes the place of that axis.

    Same result as ``cache[tables]``, but ``index_select`` copies each block as one contiguous
    run, which on the CPU is 2-4x faster than advanced indexing (that gather is most of the cost
    of decode attention at long contexts)."""
    flat = torch.index_select(cache.flatten(dim + 1), dim, tables.reshape(-1))
    return flat.view(*cache.shape[:dim], *tables.shape, *cache.shape[dim + 1 :])
