"""The runner's per-slot block tables, computed-token counts and last sampled tokens.

The persistent batch (``input_batch.py``) gives each running request a slot; this keeps, per
slot, what laying out its rows needs, as host arrays updated by the scheduler's deltas instead
of being rebuilt from Python lists each step::

    slot:            0            1            2     ...
    tables[g]     [ 7  8  9  0 ][ 3  0  0  0 ][ ...      int32 [slots, width], one per group
    lens          [ 3,           1,            ...]      int32 [groups, slots]: table lengths
    num_computed  [ 35,          2,            ...]      int64: tokens with K/V in the cache
    last_token    [ 812,         15,           ...]      int64: the token sampled last

A row's table change (``ScheduledRow.block_ids`` from ``table_start``) is written into its
slot's row (``apply``); a step gathers its rows' tables with one index (``gather``). The counts
and tokens are the runner's own record of its steps: every row advances its slot's count by its
tokens, rejected drafts roll it back as ``Scheduler.update`` does, every sampling row's last
token is kept; a decode row the scheduler marks ``continued`` is laid out from them. A slot's
entries past its tables' lengths, or its count and token before its first row, mean nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


class SlotTables:
    """Per-slot block tables (``num_groups`` of them), counts and tokens (module docstring),
    in numpy arrays: a step's few small indexed ops on the host cost a microsecond each
    there, several times less than torch's; the step's tables reach the backends as torch
    tensors over the gathered arrays (``torch.from_numpy``, not copied)."""

    def __init__(self, num_groups: int, capacity: int, width: int = 16) -> None:
        self.num_groups = num_groups
        self.tables = [np.zeros((capacity, width), np.int32) for _ in range(num_groups)]
        self.lens = np.zeros((num_groups, capacity), np.int32)
        self.num_computed = np.zeros(capacity, np.int64)
        self.last_token = np.zeros(capacity, np.int64)

    @property
    def capacity(self) -> int:
        return int(self.num_computed.shape[0])

    @property
    def width(self) -> int:
        return int(self.tables[0].shape[1])

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` slots (the slots held keep their state)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return
        self.tables = [np.pad(t, ((0, extra), (0, 0))) for t in self.tables]
        self.lens = np.pad(self.lens, ((0, 0), (0, extra)))
        self.num_computed = np.pad(self.num_computed, (0, extra))
        self.last_token = np.pad(self.last_token, (0, extra))

    def reset(self, slot: int) -> None:
        """A request enters ``slot``: empty tables (its first row brings them whole)."""
        self.lens[:, slot] = 0
        for t in self.tables:
            t[slot] = 0

    def apply(self, slot: int, group: int, start: int, block_ids: Sequence[int]) -> None:
        """Group ``group``'s table of ``slot`` from ``start`` on becomes ``block_ids`` (its
        length ``start + len(block_ids)``; nothing changes where ``block_ids`` is empty)."""
        if not block_ids:
            return
        end = start + len(block_ids)
        held = int(self.lens[group, slot])
        if start > held:
            raise ValueError(
                f"table_start {start} is past the {held} blocks the runner holds for slot "
                f"{slot} (group {group}): a table change was lost"
            )
        if end > self.width:
            more = max(end, 2 * self.width) - self.width
            self.tables = [np.pad(t, ((0, 0), (0, more))) for t in self.tables]
        self.tables[group][slot, start:end] = block_ids
        self.lens[group, slot] = end

    def table(self, slot: int, group: int = 0) -> list[int]:
        """``slot``'s table of ``group`` as a list (a view for tests and for consumers of lists;
        the step's rows are gathered, not listed)."""
        return [int(b) for b in self.tables[group][slot, : self.lens[group, slot]]]

    def gather(
        self, group: int, slots: np.ndarray, num_padding_rows: int = 0, padding_block: int = 0
    ) -> torch.Tensor:
        """The tables of ``slots`` (int64) in order, as int32 ``[rows, width]`` (width: the
        longest of theirs, at least 1), then ``num_padding_rows`` rows of ``padding_block``."""
        width = max(int(self.lens[group, slots].max()), 1) if len(slots) else 1
        rows = self.tables[group][slots, :width]
        if num_padding_rows:
            rows = np.concatenate(
                [rows, np.full((num_padding_rows, width), padding_block, np.int32)]
            )
        return torch.from_numpy(rows)

    def advance(self, slots: np.ndarray, ends: Sequence[int] | None) -> None:
        """The rows of ``slots`` computed their tokens: each slot's count becomes its row's
        ``ends`` entry (its start plus its tokens); None: every row computed one token."""
        if ends is None:
            self.num_computed[slots] += 1
        else:
            self.num_computed[slots] = ends

    def sampled(
        self, slots: Sequence[int], last_tokens: Sequence[int], rollback: Sequence[int] = ()
    ) -> None:
        """Rows sampled for ``slots``, ``last_tokens`` last (each slot's next input), and,
        per slot, ``rollback`` computed tokens dropped (rejected drafts)."""
        if not slots:
            return
        self.last_token[slots] = last_tokens
        if rollback and any(rollback):
            self.num_computed[slots] -= np.asarray(rollback, np.int64)
