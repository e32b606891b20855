"""The runner's per-slot block tables, computed-token counts and last sampled tokens.

The persistent batch (``input_batch.py``) gives each running request a slot; this keeps, per
slot, what laying out its rows needs, as host tensors updated by the scheduler's deltas instead
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

import torch


class SlotTables:
    """Per-slot block tables (``num_groups`` of them), counts and tokens (module docstring)."""

    def __init__(self, num_groups: int, capacity: int, width: int = 16) -> None:
        self.num_groups = num_groups
        self.tables = [torch.zeros(capacity, width, dtype=torch.int32) for _ in range(num_groups)]
        self.lens = torch.zeros(num_groups, capacity, dtype=torch.int32)
        self.num_computed = torch.zeros(capacity, dtype=torch.int64)
        self.last_token = torch.zeros(capacity, dtype=torch.int64)

    @property
    def capacity(self) -> int:
        return self.num_computed.shape[0]

    @property
    def width(self) -> int:
        return self.tables[0].shape[1]

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` slots (the slots held keep their state)."""
        extra = capacity - self.capacity
        if extra <= 0:
            return
        self.tables = [torch.cat([t, t.new_zeros(extra, t.shape[1])]) for t in self.tables]
        self.lens = torch.cat([self.lens, self.lens.new_zeros(self.num_groups, extra)], dim=1)
        self.num_computed = torch.cat([self.num_computed, self.num_computed.new_zeros(extra)])
        self.last_token = torch.cat([self.last_token, self.last_token.new_zeros(extra)])

    def _widen(self, width: int) -> None:
        old = self.width
        new = max(width, 2 * old)
        self.tables = [
            torch.cat([t, t.new_zeros(t.shape[0], new - old)], dim=1) for t in self.tables
        ]

    def reset(self, slot: int) -> None:
        """A request enters ``slot``: empty tables (its first row brings them whole)."""
        self.lens[:, slot] = 0
        for t in self.tables:
            t[slot].zero_()

    def apply(self, slot: int, group: int, start: int, block_ids: Sequence[int]) -> None:
        """Group ``group``'s table of ``slot`` from ``start`` on becomes ``block_ids`` (its
        length ``start + len(block_ids)``; nothing changes where ``block_ids`` is empty)."""
        if not block_ids:
            return
        end = start + len(block_ids)
        if start > int(self.lens[group, slot]):
            raise ValueError(
                f"table_start {start} is past the {int(self.lens[group, slot])} blocks the "
                f"runner holds for slot {slot} (group {group}): a table change was lost"
            )
        if end > self.width:
            self._widen(end)
        self.tables[group][slot, start:end] = torch.tensor(block_ids, dtype=torch.int32)
        self.lens[group, slot] = end

    def table(self, slot: int, group: int = 0) -> list[int]:
        """``slot``'s table of ``group`` as a list (a view for tests and for consumers of lists;
        the step's rows are gathered, not listed)."""
        return self.tables[group][slot, : int(self.lens[group, slot])].tolist()

    def gather(
        self, group: int, slots: torch.Tensor, num_padding_rows: int = 0, padding_block: int = 0
    ) -> torch.Tensor:
        """The tables of ``slots`` (int64) in order, as int32 ``[rows, width]`` (width: the
        longest of them), then ``num_padding_rows`` rows of ``padding_block``."""
        lens = self.lens[group]
        width = max(int(lens[slots].max()) if slots.numel() else 0, 1)
        rows = self.tables[group][slots, :width]
        if num_padding_rows:
            pad = rows.new_full((num_padding_rows, width), padding_block)
            rows = torch.cat([rows, pad])
        return rows

    def advance(self, slots: torch.Tensor, ends: Sequence[int] | None) -> None:
        """The rows of ``slots`` computed their tokens: each slot's count becomes its row's
        ``ends`` entry (its start plus its tokens); None: every row computed one token."""
        if ends is None:
            self.num_computed[slots] += 1
        else:
            self.num_computed[slots] = torch.tensor(ends, dtype=torch.int64)

    def sampled(
        self, slots: Sequence[int], token_ids: Sequence[list[int]], rollback: Sequence[int] = ()
    ) -> None:
        """Rows sampled ``token_ids`` for ``slots`` (the last kept as the slot's next input),
        and, per slot, ``rollback`` computed tokens dropped (rejected drafts)."""
        if not slots:
            return
        index = torch.tensor(slots, dtype=torch.int64)
        self.last_token[index] = torch.tensor([t[-1] for t in token_ids], dtype=torch.int64)
        if rollback and any(rollback):
            self.num_computed[index] -= torch.tensor(rollback, dtype=torch.int64)
