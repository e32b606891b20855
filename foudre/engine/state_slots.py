"""Recurrent state slots: what a request of a state-space or hybrid model holds besides blocks.

A recurrent layer (a Mamba-2 mixer, a gated DeltaNet) keeps, per request, a fixed-size state
whatever the sequence length (``RecurrentStateSpec``); the runner keeps every recurrent layer's
states in pools of slots (``RecurrentCache``), and this bookkeeping hands the slot ids out, as
``BlockPool`` hands out block ids::

    slots   0 .. num_slots-1                      one per running request
            num_slots .. num_slots+snapshots-1    prefix-cache snapshots
            num_slots+snapshots                   the padding rows' scratch slot

- A request takes a slot when it is first given blocks (admission) and returns it when it
  finishes, is aborted or preempted; a fresh slot is zeroed, or filled from the snapshot of
  its last prefix-cache hit. A fork (``n`` > 1, beam search) takes a slot holding a copy of its
  parent's (attention blocks are shared by reference; a state is rewritten every token, so it
  is copied at once). These copies are handed to the runner with the step (``take_copies``)
  and applied, in order, before its forward.
- Prefix caching: a cached block whose end is a multiple of ``snapshot_every`` blocks gets a
  snapshot slot, which the step that computes the block's last token fills with the state after
  that token (the row's ``state_snapshots``); a later request whose prefix hits that block
  restores it. A hit counts only up to the last block with a snapshot written in an earlier
  step. Snapshots live as long as their block's hash: evicting or forgetting the block frees
  its snapshot; when none is free, the least recently used snapshot of a block no request
  holds is reused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol


class SnapshotBlock(Protocol):
    """What of a block the snapshots read (``engine/kv_cache.Block``)."""

    ref_cnt: int
    snapshot: int
    snapshot_step: int


class StateSlots:
    """Slot ids of the recurrent state pools: a slot per running request, the prefix-cache
    snapshots, and the copies the runner makes before a step."""

    def __init__(
        self,
        num_slots: int,
        num_snapshots: int = 0,
        snapshot_every: int = 1,
        bytes_per_slot: int = 0,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"a recurrent model needs at least one state slot, got {num_slots}")
        if snapshot_every < 1:
            raise ValueError(f"snapshot_every must be positive, got {snapshot_every}")
        self.num_slots = num_slots
        self.num_snapshots = num_snapshots
        self.snapshot_every = snapshot_every  # in blocks
        self.bytes_per_slot = bytes_per_slot  # a request's state over every recurrent layer
        self.free_slots = list(range(num_slots))[::-1]
        self.of_request: dict[str, int] = {}
        self.free_snapshots = list(range(num_slots, num_slots + num_snapshots))[::-1]
        self.holders: dict[int, SnapshotBlock] = {}  # snapshot slot -> block, oldest first
        self.copies: list[tuple[int | None, int]] = []  # (source, or None: zeros; destination)
        self.pending: dict[str, list[tuple[int, int]]] = {}  # request -> (token index, slot)
        self.step = 0  # steps handed to the runner: a snapshot is ready once its step ran

    @property
    def padding_slot(self) -> int:
        return self.num_slots + self.num_snapshots

    # -- requests ------------------------------------------------------------------------------
    def slot(self, request_id: str) -> int:
        """The slot of a request that holds one."""
        return self.of_request[request_id]

    def has_free(self, n: int) -> bool:
        """Whether ``n`` requests that hold none can take a slot each now."""
        return len(self.free_slots) >= n

    def can_take(self, request_id: str) -> bool:
        return request_id in self.of_request or bool(self.free_slots)

    def take(self, request_id: str, source: int | None = None) -> None:
        """Give the request a slot (if it has none): zeros, or a copy of slot ``source``."""
        if request_id in self.of_request:
            return
        assert source is None or 0 <= source < self.padding_slot, f"no state in slot {source}"
        slot = self.free_slots.pop()
        self.of_request[request_id] = slot
        self.copies.append((source, slot))
        if source is not None and source in self.holders:  # a restored snapshot: now the
            self.holders[source] = self.holders.pop(source)  # most recently used

    def fork(self, parent_id: str, child_id: str) -> None:
        self.take(child_id, self.of_request[parent_id])

    def release(self, request_id: str) -> None:
        slot = self.of_request.pop(request_id, None)
        if slot is not None:
            self.free_slots.append(slot)
        self.pending.pop(request_id, None)

    def take_copies(self) -> list[tuple[int | None, int]]:
        """The state copies since the last call, in order, for the step about to run (which
        makes the snapshots assigned so far ready for the steps after it)."""
        copies, self.copies = self.copies, []
        self.step += 1
        return copies

    # -- prefix-cache snapshots ----------------------------------------------------------------
    def wants_snapshot(self, block_index: int) -> bool:
        return self.num_snapshots > 0 and (block_index + 1) % self.snapshot_every == 0

    def ready(self, block: SnapshotBlock | None) -> bool:
        """Whether ``block`` carries a snapshot that a step has written."""
        return block is not None and block.snapshot >= 0 and block.snapshot_step < self.step

    def hit(self, block_at: Callable[[int], SnapshotBlock | None], m: int) -> int:
        """The longest prefix of at most ``m`` blocks whose last block (``block_at(i)``: the
        request's cached block ``i``) holds a written snapshot."""
        while m > 0 and not self.ready(block_at(m - 1)):
            m -= 1
        return m

    def assign(self, block: SnapshotBlock, request_id: str, index: int, block_size: int) -> None:
        """Where a snapshot is due at the end of the request's block ``index`` (just cached),
        give ``block`` a snapshot slot, to be filled with the request's state after the
        block's last token by the step that computes it (none when every snapshot belongs to
        a block some request holds)."""
        if block.snapshot >= 0 or not self.wants_snapshot(index):
            return
        if self.free_snapshots:
            slot = self.free_snapshots.pop()
        else:
            victim = next((b for b in self.holders.values() if b.ref_cnt == 0), None)
            if victim is None:
                return
            slot = victim.snapshot
            self.drop(victim)
            self.free_snapshots.remove(slot)
        block.snapshot, block.snapshot_step = slot, self.step
        self.holders[slot] = block
        self.pending.setdefault(request_id, []).append(((index + 1) * block_size - 1, slot))

    def drop(self, block: SnapshotBlock) -> None:
        """``block`` leaves the prefix cache: its snapshot slot is free again."""
        if block.snapshot >= 0:
            self.holders.pop(block.snapshot, None)
            self.free_snapshots.append(block.snapshot)
            block.snapshot = -1

    def take_snapshots(self, request_id: str, start: int, num_tokens: int) -> list[tuple[int, int]]:
        """The snapshots a row of ``request_id`` computing tokens ``start ..`` fills: (offset in
        the row, slot) each."""
        pending = self.pending.get(request_id)
        if not pending:
            return []
        end = start + num_tokens
        now = [(i - start, slot) for i, slot in pending if start <= i < end]
        rest = [(i, slot) for i, slot in pending if not start <= i < end]
        if rest:
            self.pending[request_id] = rest
        else:
            del self.pending[request_id]
        return now


def state_metrics(states: StateSlots | None) -> dict[str, int]:
    """The engine metrics of a recurrent model's state (zeros for a transformer): the bytes of
    one request's state over every recurrent layer, the slots, those in use, the prefix-cache
    snapshots and their bytes."""
    if states is None:
        return dict.fromkeys(_METRICS, 0)
    per, snapshots = states.bytes_per_slot, len(states.holders)
    values = (per, states.num_slots, len(states.of_request), snapshots, snapshots * per)
    return dict(zip(_METRICS, values, strict=True))


_METRICS = (
    "state_bytes_per_request",
    "num_state_slots",
    "num_used_state_slots",
    "num_state_snapshots",
    "state_snapshot_bytes",
)
