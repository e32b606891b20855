"""CUDA graphs for decode, verification and mixed steps: one captured forward per bucket,
replayed each step.

A small model's decode step on a GPU is bound by launching kernels, not by the kernels: hundreds
of small launches, each paying Python and driver overhead, for microseconds of work. A CUDA graph
records the launches of one forward once and replays them with one call. That needs fixed shapes
and fixed addresses, so a decode step of ``n`` rows runs in the graph of the smallest bucket
``B >= n``, over static input buffers that each step overwrites:

    input_ids [B]  positions [B]  slot_mapping [B]  block_tables [B, max_blocks]  seq_lens [B]

Rows ``n..B`` are padding: token 0 at position 0, K/V written to the runner's scratch block, a
context of one token; their outputs are dropped. Attention inside the graph is the Triton paged
kernel, which reads lengths and block ids from those buffers (no host sync, no data-dependent
shape), and reads a quantized KV cache (int8 / fp8 codes and scales) as stored: the step's
quantize-on-write and the kernels' reads of codes are captured like the rest. Graphs are
captured lazily, the first time a bucket is used, each in its own memory pool.

Steps with rows of several tokens (speculative verification: 1 + drafts per row; chunked
prefill beside decode rows) run in graphs of the varlen prefill kernel, bucketed by their total
tokens ``T`` (16, 32, 64, ... up to ``max_tokens``, at most ``max_model_len``), over static
buffers of rows and tiles:

    input_ids [T]  positions [T]  slot_mapping [T]
    q_starts [R]  q_lens [R]  seq_lens [R]  block_tables [R, max_blocks]  tiles [2, n_tiles(T)]

The step's rows come first; the bucket's spare tokens form one padding row (positions 0.., K/V
in the scratch block, its own tiles, outputs dropped); tiles past the step's are -1 (their
programs return at once). Steps over ``max_tokens`` tokens, over the rows of the buffers, or
with a block table wider than ``max_model_len`` run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from foudre.attention.base import slot_mapping, table_tensor
from foudre.attention.paged import PagedMetadata, PrefillRows
from foudre.runner.step import ForwardStep

logger = logging.getLogger("foudre")

# the model's forward over the runner's caches and backend: (input ids, positions, metadata)
ForwardFn = Callable[[torch.Tensor, torch.Tensor, PagedMetadata], torch.Tensor]


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to 256, then of 64; capped at ``max_batch``."""
    sizes = [1, 2, 4, 8, *range(16, 257, 16), *range(320, max_batch + 64, 64)]
    out = [s for s in sizes if s < max_batch]
    return [*out, max_batch]


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, ... (powers of two) below ``max_tokens``, then ``max_tokens``."""
    sizes: list[int] = []
    size = 16
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens]


class DecodeGraphs:
    """Captured decode forwards of ``forward`` for every bucket up to ``max_batch`` rows, and,
    with ``tile_positions`` (the query positions per tile of the backend's prefill kernel), of
    steps with multi-token rows up to ``max_tokens`` tokens.

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
        tile_positions: int | None = None,
        max_tokens: int = 512,
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
        # steps with multi-token rows: token buckets over static rows and tiles
        self.tile_positions = tile_positions
        # the padding row (positions 0 .. bucket - 2) stays within max_model_len, so within the
        # RoPE tables, and within max_blocks blocks, so within the buffers
        self.max_tokens = min(max_tokens, max_model_len) if tile_positions else 0
        self.token_sizes = token_buckets(self.max_tokens) if tile_positions else []
        self.max_rows = max_batch + 1  # a padding row
        width = max(max_batch, self.max_tokens)
        if width > max_batch:
            self.input_ids = torch.zeros(width, dtype=torch.long, device=dev)
            self.positions = torch.zeros(width, dtype=torch.long, device=dev)
            self.slot_mapping = torch.zeros(width, dtype=torch.long, device=dev)
        if tile_positions:
            rows = self.max_rows
            self.q_starts = torch.zeros(rows, dtype=torch.int32, device=dev)
            self.q_lens = torch.zeros(rows, dtype=torch.int32, device=dev)
            self.row_lens = torch.ones(rows, dtype=torch.int32, device=dev)
            self.row_tables = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=dev)
            self.tiles = {
                size: torch.full((2, self.num_tiles(size)), -1, dtype=torch.int32, device=dev)
                for size in self.token_sizes
            }
        self.mixed_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def num_tiles(self, tokens: int) -> int:
        """Tiles a step of ``tokens`` tokens (padding row included) can need at most: one
        partial tile per row, plus the full ones."""
        assert self.tile_positions
        return self.max_rows + tokens // self.tile_positions

    def bucket(self, n: int) -> int:
        return next(s for s in self.sizes if s >= n)

    def can_run(self, step: ForwardStep) -> bool:
        """Decode rows only, no more than the largest bucket; or (with multi-token graphs) at
        most ``max_tokens`` tokens in fewer rows than the buffers hold; tables within them."""
        if not step.token_ids or table_tensor(step.block_tables).shape[1] > self.max_blocks:
            return False
        if step.decode_only and len(step.token_ids) <= self.max_batch:
            return True
        tokens = sum(len(ids) for ids in step.token_ids)
        return 0 < tokens <= self.max_tokens and len(step.token_ids) < self.max_rows

    def run_logits(self, step: ForwardStep) -> torch.Tensor | None:
        """None: the graphs end at the hidden states (the head runs after, eagerly)."""
        return None

    def run(self, step: ForwardStep) -> torch.Tensor:
        """Hidden states ``[n, hidden]`` of one step: in a decode graph when every row computes
        one token (row ``i`` its token at position ``starts[i]`` through ``block_tables[i]``),
        else in a graph of its token bucket."""
        if not (step.decode_only and len(step.token_ids) <= self.max_batch):
            return self.run_mixed(step)
        tables, starts = table_tensor(step.block_tables), step.starts
        tokens = [ids[0] for ids in step.token_ids]
        n = len(tokens)
        size = self.bucket(n)
        bs, pad = self.block_size, size - n
        scratch = self.scratch_block
        width = tables.shape[1]
        slots = slot_mapping(tables, np.asarray(starts, np.int64), bs).tolist()
        rope = starts
        if step.position_offsets:
            rope = [p + o for p, o in zip(starts, step.position_offsets, strict=True)]
        host = torch.tensor(
            [[*tokens, *[0] * pad], [*rope, *[0] * pad], [*slots, *[scratch * bs] * pad]],
            dtype=torch.long,
        )
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        self.slot_mapping[:size].copy_(host[2], non_blocking=True)
        lens = torch.tensor([*[p + 1 for p in starts], *[1] * pad], dtype=torch.int32)
        self.seq_lens[:size].copy_(lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(tables, non_blocking=True)
        self.block_tables[n:size, :width].fill_(scratch)
        entry = self.graphs.get(size)
        if entry is None:
            entry = self._capture(size)
            self.graphs[size] = entry
        graph, hidden = entry
        graph.replay()
        return hidden[:n]

    def run_mixed(self, step: ForwardStep) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a step with multi-token rows, in the graph of the
        smallest token bucket that holds it."""
        assert self.tile_positions
        bs, scratch, per_tile = self.block_size, self.scratch_block, self.tile_positions
        n = sum(len(ids) for ids in step.token_ids)
        size = next(s for s in self.token_sizes if s >= n)
        pad = size - n
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_starts: list[int] = []
        q_lens: list[int] = []
        lens: list[int] = []
        step_tables = table_tensor(step.block_tables).cpu()
        host_tables = step_tables.tolist()  # (a step of at most max_tokens tokens)
        offsets = step.position_offsets or [0] * len(step.starts)
        for table, start, ids, offset in zip(
            host_tables, step.starts, step.token_ids, offsets, strict=True
        ):
            q_starts.append(len(tokens))
            q_lens.append(len(ids))
            lens.append(start + len(ids))
            tokens.extend(ids)
            for p in range(start, start + len(ids)):
                positions.append(p + offset)
                slots.append(table[p // bs] * bs + p % bs)
        rows = len(host_tables)
        width = step_tables.shape[1]
        if pad:  # one padding row: positions 0.., K/V in the scratch block
            q_starts.append(n)
            q_lens.append(pad)
            lens.append(pad)
            tokens.extend([0] * pad)
            positions.extend(range(pad))
            slots.extend(scratch * bs + p % bs for p in range(pad))
            width = max(width, -(-pad // bs))
        tiles = [(r, q0) for r, q in enumerate(q_lens) for q0 in range(0, q, per_tile)]
        free = self.num_tiles(size) - len(tiles)
        host_tiles = [[r for r, _ in tiles] + [-1] * free, [q0 for _, q0 in tiles] + [0] * free]
        host = torch.tensor([tokens, positions, slots], dtype=torch.long)
        self.input_ids[:size].copy_(host[0], non_blocking=True)
        self.positions[:size].copy_(host[1], non_blocking=True)
        self.slot_mapping[:size].copy_(host[2], non_blocking=True)
        per_row = torch.tensor([q_starts, q_lens, lens], dtype=torch.int32)
        every = len(q_lens)  # the step's rows, then the padding row
        self.q_starts[:every].copy_(per_row[0], non_blocking=True)
        self.q_lens[:every].copy_(per_row[1], non_blocking=True)
        self.row_lens[:every].copy_(per_row[2], non_blocking=True)
        self.row_tables[:every, :width].fill_(scratch)
        self.row_tables[:rows, : step_tables.shape[1]].copy_(step_tables, non_blocking=True)
        self.tiles[size].copy_(torch.tensor(host_tiles, dtype=torch.int32), non_blocking=True)
        entry = self.mixed_graphs.get(size)
        if entry is None:
            entry = self._capture_fn(self.mixed_forward_fn(size))
            self.mixed_graphs[size] = entry
        graph, hidden = entry
        graph.replay()
        return hidden[:n]

    def mixed_forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward of a ``size``-token step with multi-token rows over the static buffers."""
        assert self.tile_positions
        rows = PrefillRows(
            q_starts=self.q_starts,
            q_lens=self.q_lens,
            seq_lens=self.row_lens,
            block_tables=self.row_tables,
            max_q_len=size,
            num_tokens=size,
            tiles={self.tile_positions: self.tiles[size]},
        )
        meta = PagedMetadata(self.slot_mapping[:size], None, None, None, rows)

        def forward() -> torch.Tensor:
            return self.forward(self.input_ids[:size], self.positions[:size], meta)

        return forward

    def forward_fn(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward of a ``size``-row decode step over the static buffers."""
        meta = PagedMetadata(
            slot_mapping=self.slot_mapping[:size],
            decode_tokens=self.token_idx[:size],
            block_tables=self.block_tables[:size],
            seq_lens=self.seq_lens[:size],
        )

        def forward() -> torch.Tensor:
            return self.forward(self.input_ids[:size], self.positions[:size], meta)

        return forward

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        graph, hidden = self._capture_fn(self.forward_fn(size))
        logger.debug("captured a CUDA graph for decode batches of %d rows", size)
        return graph, hidden

    def _capture_fn(
        self, forward: Callable[[], torch.Tensor]
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """``forward`` captured in a CUDA graph (after a warm-up run), and its output."""
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
        return graph, hidden
