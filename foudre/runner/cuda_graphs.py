"""CUDA graphs for decode steps: one captured forward per batch-size bucket, replayed each step.

A small model's decode step on a GPU is bound by launching kernels, not by the kernels: hundreds
of small launches, each paying Python and driver overhead, for microseconds of work. A CUDA graph
records the launches of one forward once and replays them with one call. That needs fixed shapes
and fixed addresses, so a decode step of ``n`` rows runs in the graph of the smallest bucket
``B >= n``, over static input buffers that each step overwrites:

    input_ids [B]  positions [B]  slot_mapping [B]  block_tables [B, max_blocks]  seq_lens [B]

Rows ``n..B`` are padding: token 0 at position 0, K/V written to the runner's scratch block, a
context of one token; their outputs are dropped. Attention inside the graph is the Triton paged
kernel, which reads lengths and block ids from those buffers (no host sync, no data-dependent
shape). Graphs are captured lazily, the first time a bucket is used, each in its own memory pool.
Steps with prefill chunks, speculative verification or more rows than the largest bucket run
eagerly as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from foudre.runner.attention.paged import PagedMetadata
from foudre.runner.step import ForwardStep

logger = logging.getLogger("foudre")

# the model's forward over the runner's caches and backend: (input ids, positions, metadata)
ForwardFn = Callable[[torch.Tensor, torch.Tensor, PagedMetadata], torch.Tensor]


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to 256, then of 64; capped at ``max_batch``."""
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(320, max_batch + 64, 64)]
    out = [s for s in sizes if s < max_batch]
    return [*out, max_batch]


class DecodeGraphs:
    """Captured decode forwards of ``forward`` for every bucket up to ``max_batch`` rows.

    ``scratch_block`` is a block of the cache that no request holds: padding rows write there.
    """

    def __init__(
        self,
        forward: ForwardFn,
        device: torch.device,
        block_size: int,
        scratch_block: int,
        max_batch: int,
        max_model_len: int,
    ) -> None:
        self.forward = forward
        self.device = dev = device
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.sizes = bucket_sizes(max_batch)
        self.max_batch = max_batch
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.slot_mapping = torch.zeros(max_batch, dtype=torch.long, device=dev)
        self.block_tables = torch.zeros(max_batch, self.max_blocks, dtype=torch.int32, device=dev)
        self.seq_lens = torch.ones(max_batch, dtype=torch.int32, device=dev)
        self.token_idx = torch.arange(max_batch, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def can_run(self, step: ForwardStep) -> bool:
        """Decode rows only, no more than the largest bucket, tables within the buffers."""
        return (
            step.decode_only
            and len(step.token_ids) <= self.max_batch
            and max(len(t) for t in step.block_tables) <= self.max_blocks
        )

    def run(self, step: ForwardStep) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of one decode step: row ``i`` computes its one token at
        position ``starts[i]`` through ``block_tables[i]``."""
        block_tables, starts = step.block_tables, step.starts
        tokens = [ids[0] for ids in step.token_ids]
        n = len(tokens)
        size = self.bucket(n)
        bs, pad = self.block_size, size - n
        scratch = self.scratch_block
        width = max(len(t) for t in block_tables)
        tables = [list(t) + [scratch] * (width - len(t)) for t in block_tables]
        tables += [[scratch] * width] * pad
        slots = [t[p // bs] * bs + p % bs for t, p in zip(block_tables, starts, strict=True)]
        host = torch.tensor(
            [[*tokens, *[0] * pad], [*starts, *[0] * pad], [*slots, *[scratch * bs] * pad]],
            dtype=torch.long,
        )
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        self.slot_mapping[:size].copy_(host[2], non_blocking=True)
        lens = torch.tensor([*[p + 1 for p in starts], *[1] * pad], dtype=torch.int32)
        self.seq_lens[:size].copy_(lens, non_blocking=True)
        self.block_tables[:size, :width].copy_(
            torch.tensor(tables, dtype=torch.int32), non_blocking=True
        )
        entry = self.graphs.get(size)
        if entry is None:
            entry = self._capture(size)
            self.graphs[size] = entry
        graph, hidden = entry
        graph.replay()
        return hidden[:n]

    def forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward of a ``size``-row decode step over the static buffers."""
        meta = PagedMetadata(
            slot_mapping=self.slot_mapping[:size],
            decode_tokens=self.token_idx[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
            groups=[],
        )

        def forward() -> torch.Tensor:
            return self.forward(self.input_ids[:size], self.positions[:size], meta)

        return forward

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        forward = self.forward_fn(size)
        # warm up on a side stream (compiles the Triton kernels, initialises cuBLAS workspaces),
        # as capture requires; the buffers hold this step's real inputs, so the K/V it writes
        # are the ones the step writes anyway
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            forward()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden = forward()
        logger.debug("captured a CUDA graph for decode batches of %d rows", size)
        return graph, hidden
