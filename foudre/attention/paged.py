"""Backends whose attention is computed by paged kernels that read K/V straight from the pool
(Triton on CUDA, C++ on the CPU): nothing is gathered, padded or masked by a dense tensor.

Two kernels, set by each subclass to its module's functions:

- ``decode(q, k_cache, v_cache, out, token_idx, block_tables, seq_lens, scale, window)``
  computes the rows of one new token each: row ``i`` (token ``token_idx[i]`` of ``q [T, H, D]``,
  seeing the first ``seq_lens[i]`` positions of its blocks ``block_tables[i]`` in
  ``[num_blocks, block_size, kv_heads, D]``, the last ``window`` of them with a sliding window)
  into ``out[token_idx[i]]``;
- ``prefill(q, k_cache, v_cache, out, rows, scale, window)`` computes rows of any number of new
  tokens (``PrefillRows``: prompt chunks, speculative verification), FlashAttention-style: each
  query sees the keys of its own request up to its position (and within the window).

Both take ``sinks`` (float32 ``[num_heads]`` or None): each head's sink logit joins its softmax
denominator (``base.py``), which a kernel folds in as it normalizes its output.

A backend with ``mixed_in_one`` (Triton) sends every row of a step that holds a multi-token
row to ``prefill``, one launch; the others (the CPU) split decode rows from the rest.

A quantized KV cache (``QuantizedKVCache``) reaches both kernels as it is stored: the caches are
its codes, viewed as int8 or float8_e4m3fn (the dtype says which), with ``k_scale`` / ``v_scale``
``[num_blocks, block_size, kv_heads]``; the kernels convert codes as they read them and fold
each scale into the score or the softmax weight it multiplies. Nothing is dequantized into a
tensor.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from foudre.attention.base import AttentionBackend, BatchLayout, check_sinks
from foudre.attention.quantized_cache import QuantizedKVCache
from foudre.attention.torch_sdpa import split_rows, store_kv


@dataclass(slots=True)
class PrefillRows:
    """Rows for the prefill kernel, as int32 device tensors: row ``r`` computes ``q_lens[r]``
    tokens (flat indices ``q_starts[r]...``), the last positions of a context of
    ``seq_lens[r]`` tokens in blocks ``block_tables[r]``."""

    q_starts: torch.Tensor  # [P]
    q_lens: torch.Tensor  # [P]
    seq_lens: torch.Tensor  # [P]
    block_tables: torch.Tensor  # [P, W] (entries past a row's blocks: unused)
    max_q_len: int
    num_tokens: int  # sum of q_lens
    host_q_lens: list[int] = field(default_factory=list)  # q_lens on the host
    # work lists a kernel derives from the rows (by its tile size), built once per step
    tiles: dict[int, torch.Tensor] = field(default_factory=dict)

    def query_tiles(self, positions: int) -> torch.Tensor:
        """``[2, n]`` int32 on the rows' device: (row, first query) of every tile of
        ``positions`` consecutive queries of a row."""
        tiles = self.tiles.get(positions)
        if tiles is None:
            pairs = [
                (r, q0) for r, n in enumerate(self.host_q_lens) for q0 in range(0, n, positions)
            ]
            tiles = torch.tensor(pairs, dtype=torch.int32).t().contiguous()
            tiles = tiles.to(self.q_lens.device)
            self.tiles[positions] = tiles
        return tiles


@dataclass(slots=True)
class PagedMetadata:
    """One step's layout: the decode rows as device tensors (None when there are none) and the
    rows for the prefill kernel (None when there are none)."""

    slot_mapping: torch.Tensor  # [T] int64
    decode_tokens: torch.Tensor | None  # [D] int32: flat token index of each decode row
    block_tables: torch.Tensor | None  # [D, W] int32 (entries past a row's blocks: unused)
    seq_lens: torch.Tensor | None  # [D] int32
    prefill: PrefillRows | None = None


def _int32(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32).to(device)


def _rows_of(tables: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The int32 tables of ``rows`` (all of them: ``tables`` itself, not copied)."""
    if len(rows) != tables.shape[0]:
        tables = tables[torch.tensor(rows, dtype=torch.long, device=tables.device)]
    return tables.to(torch.int32)


def prefill_rows(
    rows: list[int], layout: BatchLayout, starts: list[int], device: torch.device
) -> PrefillRows:
    """``rows`` of ``layout`` (whose first flat token indices are ``starts``) for ``prefill``."""
    q_lens = [layout.query_lens[r] for r in rows]
    return PrefillRows(
        q_starts=_int32([starts[r] for r in rows], device),
        q_lens=_int32(q_lens, device),
        seq_lens=_int32([layout.seq_lens[r] for r in rows], device),
        block_tables=_rows_of(layout.tables(), rows).to(device),
        max_q_len=max(q_lens),
        num_tokens=sum(q_lens),
        host_q_lens=q_lens,
    )


class PagedBackend(AttentionBackend):
    """Decode rows through ``decode``, multi-token rows through ``prefill`` (both paged
    kernels, set by each subclass)."""

    mixed_in_one = False  # a step with a multi-token row sends all its rows to ``prefill``

    def stores_new_tokens(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
        """Whether ``decode`` takes a decode-only step's new K / V (``k_new``, ``v_new``) and
        writes them itself, before any row reads (a float cache): none does by default."""
        return False

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
        window: int | None = None,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
        k_new: torch.Tensor | None = None,
        v_new: torch.Tensor | None = None,
    ) -> None:
        raise NotImplementedError

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        rows: PrefillRows,
        scale: float,
        window: int | None = None,
        *,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        raise NotImplementedError

    def tile_positions(self, num_heads: int, num_kv_heads: int) -> int | None:
        """Query positions per tile of ``prefill`` where it runs every row of a step in one
        launch over a work list of tiles (``PrefillRows.query_tiles``): what a captured step
        must lay out; None where it does not."""
        return None

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> PagedMetadata:
        starts, decode, multi = split_rows(layout)
        if multi and self.mixed_in_one:
            multi, decode = list(range(len(layout.query_lens))), []
        tok = tables = lens = None
        if decode:  # (the step's tables: rows gathered from the runner's per-slot tables)
            tables = _rows_of(layout.tables(), decode).to(device)
            tok = _int32([starts[r] for r in decode], device)
            lens = _int32([layout.seq_lens[r] for r in decode], device)
        prefill = prefill_rows(multi, layout, starts, device) if multi else None
        return PagedMetadata(layout.slot_mapping.to(device), tok, tables, lens, prefill)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | QuantizedKVCache,
        metadata: PagedMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        sinks = check_sinks(sinks, q.shape[1])
        k_scale = v_scale = None
        new: dict[str, torch.Tensor] = {}
        if isinstance(kv_cache, QuantizedKVCache):
            kv_cache.write(metadata.slot_mapping, k, v)
            k_cache, v_cache, k_scale, v_scale = kv_cache.stored()
        elif metadata.prefill is None and self.stores_new_tokens(k, v, kv_cache[0]):
            new = {"k_new": k, "v_new": v}  # (every row a decode row)
            k_cache, v_cache = kv_cache[0], kv_cache[1]
        else:
            store_kv(kv_cache, metadata.slot_mapping, k, v)
            k_cache, v_cache = kv_cache[0], kv_cache[1]
        out = torch.empty_like(q)
        if metadata.decode_tokens is not None:
            assert metadata.block_tables is not None and metadata.seq_lens is not None
            self.decode(
                q,
                k_cache,
                v_cache,
                out,
                metadata.decode_tokens,
                metadata.block_tables,
                metadata.seq_lens,
                scale,
                window,
                k_scale=k_scale,
                v_scale=v_scale,
                sinks=sinks,
                **new,
            )
        if metadata.prefill is not None:
            self.prefill(
                q,
                k_cache,
                v_cache,
                out,
                metadata.prefill,
                scale,
                window,
                k_scale=k_scale,
                v_scale=v_scale,
                sinks=sinks,
            )
        return out
