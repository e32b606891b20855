"""The CPU reference backend: ``scaled_dot_product_attention`` over K/V gathered from blocks.

Requests are split into groups so that padding never multiplies work: decode requests (one new
token each) run as batched calls whose keys are padded to the longest context of their group, one
group per band of context lengths within about a factor of two (``decode_groups``), so a request
rarely pays for more than twice its own keys; requests with several new tokens (prefill chunks,
verification) run as one more batched call padded to the longest chunk. No Python loop runs over
requests in ``forward``.

A layer with a sliding window (``forward(..., window=W)``: a query at position ``p`` sees keys
``p - W + 1 .. p``) gets its own groups, built on first use in a step: masks with the window's
lower edge, and tables that start at the first block any query of the row sees, so blocks wholly
outside the window are never gathered. This backend is the reference the paged kernels are
tested against, and the fallback where they cannot run (no C++ compiler, no Triton); it reads a
quantized KV cache by gathering its blocks dequantized to the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from foudre.attention.base import AttentionBackend, BatchLayout, check_sinks, gather_blocks
from foudre.attention.quantized_cache import QuantizedKVCache


@dataclass(slots=True)
class _Group:
    token_idx: torch.Tensor  # [B, max_q] flat indices of the group's tokens (padding -> 0)
    valid: torch.Tensor | None  # [B, max_q] bool; None when no query padding
    block_tables: torch.Tensor  # [B, max_blocks]
    mask: torch.Tensor  # [B, 1, max_q, max_blocks * block_size] bool, True = attend


@dataclass(slots=True)
class SDPAMetadata:
    slot_mapping: torch.Tensor
    groups: list[_Group]  # full causal attention
    # what windowed groups are built from, on first use (by window size)
    layout: BatchLayout | None = None
    bands: list[list[int]] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    device: torch.device | None = None
    windowed: dict[int, list[_Group]] = field(default_factory=dict)

    def groups_for(self, window: int | None) -> list[_Group]:
        """The groups of full attention (``window`` None) or of a sliding window."""
        if window is None:
            return self.groups
        groups = self.windowed.get(window)
        if groups is None:
            assert self.layout is not None and self.device is not None
            groups = [
                _build_group(rows, self.layout, self.starts, self.device, window)
                for rows in self.bands
            ]
            self.windowed[window] = groups
        return groups


def _build_group(
    rows: list[int],
    layout: BatchLayout,
    starts: list[int],
    device: torch.device,
    window: int | None = None,
) -> _Group:
    bs = layout.block_size
    q_lens = [layout.query_lens[r] for r in rows]
    ctx = [layout.seq_lens[r] for r in rows]
    max_q = max(q_lens)
    # the first block each row reads: 0, or the block of the first key its first query sees
    first = [
        0 if window is None else max(0, c - q - window + 1) // bs
        for q, c in zip(q_lens, ctx, strict=True)
    ]
    # each row's blocks from its first read, up to the last its context reaches (the rest of
    # its table is never read; entries past it are masked out below)
    max_blocks = max(-(-c // bs) - f for c, f in zip(ctx, first, strict=True))
    step_tables = layout.tables()
    width = step_tables.shape[1]
    columns = torch.tensor(first).view(-1, 1) + torch.arange(max_blocks).view(1, -1)
    row_index = torch.tensor(rows, dtype=torch.long).view(-1, 1)
    tables = step_tables.cpu()[row_index, columns.clamp(max=width - 1)].long()
    q_len_t = torch.tensor(q_lens).view(-1, 1)
    ctx_t = torch.tensor(ctx).view(-1, 1, 1)
    qi = torch.arange(max_q).view(1, -1)
    token_idx = torch.tensor([starts[r] for r in rows]).view(-1, 1) + qi
    valid = qi < q_len_t
    token_idx = torch.where(valid, token_idx, torch.zeros_like(token_idx))
    # query i of a request sits at position ctx - q_len + i and sees keys 0..that position
    # (the last `window` of them, with a sliding window)
    q_pos = (ctx_t.view(-1, 1) - q_len_t + qi).unsqueeze(-1)  # [B, max_q, 1]
    kr = torch.arange(max_blocks * bs).view(1, 1, -1)  # a key's index in the gathered blocks
    kj = kr + (torch.tensor(first) * bs).view(-1, 1, 1)  # its position
    mask = (kj <= q_pos) & (kj < ctx_t)
    if window is not None:
        mask &= kj > q_pos - window
    # padded query rows attend to key 0 so that softmax stays finite; their output is dropped
    mask = mask | (~valid).unsqueeze(-1) & (kr == 0)
    return _Group(
        token_idx=token_idx.to(device),
        valid=None if bool(valid.all()) else valid.to(device),
        block_tables=tables.to(device),
        mask=mask.unsqueeze(1).to(device),
    )


def split_rows(layout: BatchLayout) -> tuple[list[int], list[int], list[int]]:
    """Each request's first flat token index, the decode rows (one new token) and the rows with
    several new tokens."""
    starts = [0]
    for n in layout.query_lens:
        starts.append(starts[-1] + n)
    decode = [i for i, n in enumerate(layout.query_lens) if n == 1]
    multi = [i for i, n in enumerate(layout.query_lens) if n > 1]
    return starts, decode, multi


def decode_groups(rows: list[int], seq_lens: list[int], min_rows: int = 8) -> list[list[int]]:
    """``rows`` sorted by context length and cut into bands: a band closes once it holds
    ``min_rows`` rows (each band costs one more attention call) and the next context is over
    twice its shortest, so past its first ``min_rows`` rows no row pays for more than twice its
    own keys."""
    groups: list[list[int]] = []
    current: list[int] = []
    for r in sorted(rows, key=lambda r: seq_lens[r]):
        if len(current) >= min_rows and seq_lens[r] > 2 * seq_lens[current[0]]:
            groups.append(current)
            current = []
        current.append(r)
    if current:
        groups.append(current)
    return groups


class TorchSDPABackend(AttentionBackend):
    name = "torch"

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> SDPAMetadata:
        starts, decode, multi = split_rows(layout)
        bands = [rows for rows in (*decode_groups(decode, layout.seq_lens), multi) if rows]
        groups = [_build_group(rows, layout, starts, device) for rows in bands]
        return SDPAMetadata(
            slot_mapping=layout.slot_mapping.to(device),
            groups=groups,
            layout=layout,
            bands=bands,
            starts=starts,
            device=device,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | QuantizedKVCache,
        metadata: SDPAMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        sinks = check_sinks(sinks, q.shape[1])
        gather = write_kv(kv_cache, metadata.slot_mapping, k, v)
        out = torch.empty_like(q)
        attend_groups(q, gather, metadata.groups_for(window), out, scale, sinks)
        return out


Gather = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def store_kv(
    kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    """Store the step's K/V ``[T, kv_heads, head_dim]`` at ``slot_mapping`` in a float cache
    ``[2, blocks, block_size, kv_heads, head_dim]``."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def write_kv(
    kv_cache: torch.Tensor | QuantizedKVCache,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> Gather:
    """Store the step's K/V at ``slot_mapping``; return the function that reads blocks back
    (``block_tables [B, nb] -> (K, V) [B, nb, block_size, kv_heads, head_dim]``)."""
    if isinstance(kv_cache, QuantizedKVCache):
        kv_cache.write(slot_mapping, k, v)
        return kv_cache.gather
    store_kv(kv_cache, slot_mapping, k, v)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    return lambda tables: (gather_blocks(k_cache, tables), gather_blocks(v_cache, tables))


def with_sinks(
    keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Keys, values and a float mask for SDPA that add each head's sink to its softmax
    denominator: one more key and value of zeros (``[B, KV, L + 1, D]``), whose score is the
    mask's last column, the sink of the query row's head (rows ``g * Q + i`` of
    ``[B, KV, G * Q, L + 1]``: query head ``kv * G + g``); the boolean ``mask`` (True: attend)
    becomes 0 / -inf before it."""
    b, kv, _, d = keys.shape
    rows = mask.shape[-2]
    groups = sinks.numel() // kv
    zero = keys.new_zeros(b, kv, 1, d)
    keys, values = torch.cat([keys, zero], dim=2), torch.cat([values, zero], dim=2)
    bias = torch.zeros(mask.shape, dtype=keys.dtype, device=keys.device)
    bias = bias.masked_fill(~mask, float("-inf")).expand(b, kv, rows, -1)
    sink = sinks.to(keys.dtype).view(1, kv, groups, 1).repeat_interleave(rows // groups, dim=2)
    return keys, values, torch.cat([bias, sink.expand(b, kv, rows, 1)], dim=-1)


def attend_groups(
    q: torch.Tensor,
    gather: Gather,
    groups: list[_Group],
    out: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention of each group's queries over its gathered blocks, written into ``out`` (with
    each head's sink logit in its softmax denominator where ``sinks`` ``[num_heads]`` is
    given)."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    for g in groups:
        b, max_q = g.token_idx.shape
        k_blocks, v_blocks = gather(g.block_tables)
        num_kv_heads = k_blocks.shape[-2]
        per_kv = num_heads // num_kv_heads
        keys = k_blocks.view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        values = v_blocks.view(b, -1, num_kv_heads, head_dim).transpose(1, 2)
        # Fold each KV head's query heads into the query axis ([B, KV, G*Q, D]): plain
        # attention per KV head, which CPU kernels run far faster than enable_gqa (8x in bf16).
        queries = q[g.token_idx].view(b, max_q, num_kv_heads, per_kv, head_dim)
        queries = queries.permute(0, 2, 3, 1, 4).reshape(b, num_kv_heads, per_kv * max_q, -1)
        mask = g.mask if max_q == 1 and sinks is None else g.mask.repeat(1, 1, per_kv, 1)
        if sinks is not None:
            keys, values, mask = with_sinks(keys, values, mask, sinks)
        o = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)
        o = o.view(b, num_kv_heads, per_kv, max_q, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(b, max_q, num_heads, head_dim)
        if g.valid is None:
            out[g.token_idx.view(-1)] = o.reshape(-1, num_heads, head_dim)
        else:
            out[g.token_idx[g.valid]] = o[g.valid]
