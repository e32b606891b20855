"""A step's layout for multi-head latent attention (``cache_spec.LatentAttentionSpec``): which
rows attend through the cache, which among their own new tokens only.

A row whose whole context is new this step (a prompt computed from its first token, in one
chunk) needs nothing from the cache: its attention can run in the expanded form (per-head keys
and values from its own latents, the smaller product for a long prompt), the latents merely
stored for later steps. Every other row (decode, later prompt chunks, prefix hits, speculative
verification) attends through the cache in the absorbed form, through the backend, over
metadata built for those rows alone::

    rows       [ fresh prompt ][ d ][ chunk 2 of a prompt ][ d ][ fresh prompt ]
    fresh      (0, 7)                                           (19, 5)     expanded, per row
    rest                       [7]  [8 .. 16]              [18]             absorbed, backend
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from foudre.attention.base import AttentionBackend, BatchLayout


@dataclass(slots=True)
class LatentMetadata:
    """``inner``: the backend's metadata for the rows that attend through the cache, whose
    tokens are ``rest`` (flat indices, None: every token of the step; ``inner`` is None when
    there are none); ``fresh``: ``(first flat token, length)`` of each row whose context is all
    new, ``fresh_tokens`` their flat indices and ``fresh_slots`` their cache slots."""

    inner: Any
    rest: torch.Tensor | None = None
    fresh: tuple[tuple[int, int], ...] = ()
    fresh_tokens: torch.Tensor | None = None
    fresh_slots: torch.Tensor | None = None


def build_latent_metadata(
    backend: AttentionBackend, layout: BatchLayout, device: torch.device
) -> LatentMetadata:
    """``layout`` split into its fresh rows (several new tokens, no cached context) and the
    rest, the backend's metadata built over the rest only."""
    starts = [0]
    for n in layout.query_lens:
        starts.append(starts[-1] + n)
    rows = range(len(layout.query_lens))
    fresh = [r for r in rows if layout.query_lens[r] == layout.seq_lens[r] > 1]
    if not fresh:
        return LatentMetadata(backend.build_metadata(layout, device))
    rest = [r for r in rows if r not in set(fresh)]
    rest_tokens = [t for r in rest for t in range(starts[r], starts[r + 1])]
    fresh_tokens = [t for r in fresh for t in range(starts[r], starts[r + 1])]
    inner = None
    if rest:
        sub = BatchLayout(
            query_lens=[layout.query_lens[r] for r in rest],
            seq_lens=[layout.seq_lens[r] for r in rest],
            block_tables=layout.tables()[torch.tensor(rest, dtype=torch.long)],
            slot_mapping=layout.slot_mapping[torch.tensor(rest_tokens, dtype=torch.long)],
            block_size=layout.block_size,
        )
        inner = backend.build_metadata(sub, device)
    fresh_index = torch.tensor(fresh_tokens, dtype=torch.long)
    return LatentMetadata(
        inner,
        rest=torch.tensor(rest_tokens, dtype=torch.long, device=device),
        fresh=tuple((starts[r], layout.query_lens[r]) for r in fresh),
        fresh_tokens=fresh_index.to(device),
        fresh_slots=layout.slot_mapping[fresh_index].to(device),
    )
