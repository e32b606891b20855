"""Backends whose decode rows are computed by a paged-attention kernel (Triton on CUDA, C++ on
the CPU) and whose multi-token rows go through the SDPA groups.

A decode kernel reads K/V straight from the pool through each row's block table, so nothing is
gathered or padded: ``decode(q, k_cache, v_cache, out, token_idx, block_tables, seq_lens,
scale)`` computes row ``i`` (token ``token_idx[i]`` of ``q [T, H, D]``, seeing the first
``seq_lens[i]`` positions of its blocks ``block_tables[i]`` in ``[num_blocks, block_size,
kv_heads, D]``) into ``out[token_idx[i]]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foudre.layers.attention import AttentionBackend, BatchLayout
from foudre.runner.attention.kv_quant import QuantizedKVCache
from foudre.runner.attention.torch_sdpa import (
    _build_group,
    _Group,
    attend_groups,
    split_rows,
    write_kv,
)


@dataclass(slots=True)
class PagedMetadata:
    """One step's layout: the decode rows as device tensors (None when there are none) and the
    SDPA groups of the multi-token rows."""

    slot_mapping: torch.Tensor  # [T] int64
    decode_tokens: torch.Tensor | None  # [D] int32: flat token index of each decode row
    block_tables: torch.Tensor | None  # [D, W] int32 (entries past a row's blocks: unused)
    seq_lens: torch.Tensor | None  # [D] int32
    groups: list[_Group]


class PagedDecodeBackend(AttentionBackend):
    """Decode rows through ``decode`` (a paged kernel, set by each subclass to its module's
    kernel function), the rest through SDPA groups."""

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        token_idx: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> None:
        raise NotImplementedError

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> PagedMetadata:
        starts, decode, multi = split_rows(layout)
        tok = tables = lens = None
        if decode:
            width = max(len(layout.block_tables[r]) for r in decode)
            rows = [
                layout.block_tables[r] + [0] * (width - len(layout.block_tables[r])) for r in decode
            ]
            tables = torch.tensor(rows, dtype=torch.int32).to(device)
            tok = torch.tensor([starts[r] for r in decode], dtype=torch.int32).to(device)
            lens = torch.tensor([layout.seq_lens[r] for r in decode], dtype=torch.int32).to(device)
        groups = [_build_group(multi, layout, starts, device)] if multi else []
        return PagedMetadata(layout.slot_mapping.to(device), tok, tables, lens, groups)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | QuantizedKVCache,
        metadata: PagedMetadata,
        scale: float,
    ) -> torch.Tensor:
        if isinstance(kv_cache, QuantizedKVCache):
            raise ValueError(f"the {self.name} attention backend reads a float KV cache only")
        gather = write_kv(kv_cache, metadata.slot_mapping, k, v)
        out = torch.empty_like(q)
        if metadata.decode_tokens is not None:
            assert metadata.block_tables is not None and metadata.seq_lens is not None
            self.decode(
                q,
                kv_cache[0],
                kv_cache[1],
                out,
                metadata.decode_tokens,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
            )
        attend_groups(q, gather, metadata.groups, out, scale)
        return out
