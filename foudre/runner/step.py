"""What crosses between the scheduler and the runner, and between the runner and its fast paths.

The scheduler (``engine/``) decides; the runner computes. Their whole contract is two plain
records, so the runner needs nothing from ``engine``::

    Scheduler.schedule() --SchedulerOutput--> ModelRunner.execute() --StepOutput--+
    Scheduler.update()   <--------------------------------------------------------+

A row is "compute ``token_ids`` at positions ``start...`` of request ``request_id``, whose K/V
lives in its block tables, and sample from the last ``num_logits`` of them": 0 while a prompt is
still being chunked in, 1 for a row that samples its next token, 1 + drafts for a row that
verifies speculative tokens (the last ``len(spec_token_ids)`` of ``token_ids``).

The block tables themselves stay in the runner, one per slot of its persistent batch
(``runner/slot_tables.py``); a row carries only what changed in them since the request's last
row: ``block_ids``, the entries of group 0's table from ``table_start`` on (and
``group_block_ids`` from ``group_table_starts``, for the layers of other cache groups), empty
where nothing changed (most decode rows). A row whose request entered the batch in its step
carries its whole tables (start 0). A decode row marked ``continued`` computes the token the
runner sampled for it last, at the position after the runner's count of its computed tokens:
the runner lays it out from its per-slot state (its ``start`` and ``token_ids`` stay, equal).

The runner keeps what sampling needs of each request in its persistent batch
(``runner/input_batch.py``), updated by the deltas a ``SchedulerOutput`` carries: requests that
enter it (``new_requests``: admitted, resumed after a preemption, forked; each with its tokens so
far, parameters, seed generator and grammar state) and requests that leave it (``removed``:
finished or preempted). No engine ``Request`` crosses into the runner, and a step costs no
per-request work beyond its rows' tokens::

    schedule():  rows + new_requests + removed --> execute(): batch.remove(removed),
                                                      batch.add(new_requests), forward, sample
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from foudre.sampling_params import SamplingParams
from foudre.structured.grammar import GrammarMatcher


@dataclass(slots=True)
class NewRequest:
    """A request entering the runner's persistent batch: its tokens so far (prompt and output:
    the history its penalties count), how to sample it, and the objects it samples with (its
    seeded generator, its grammar's state: shared with the engine, which advances them)."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None


@dataclass(slots=True)
class ScheduledRow:
    request_id: str
    start: int  # position of token_ids[0]; the first `start` tokens have K/V in the cache
    token_ids: list[int]  # prompt / output tokens, then the drafts to verify
    block_ids: list[int]  # group 0's table from ``table_start`` on: what changed (see above)
    num_logits: int  # 0, 1 or 1 + drafts
    spec_token_ids: list[int] = field(default_factory=list)  # drafts (the end of token_ids)
    spec_probs: torch.Tensor | None = None  # the proposer's [k, vocab]; None: one-hot
    # sequences forked from this one at this step (the other samples of its prompt, entering
    # the batch in this step): each draws its own token from the same last logits, then holds
    # the row's blocks as its own
    fork_ids: list[str] = field(default_factory=list)
    # added to the RoPE position of each of its tokens (the rotary's position_offset: 0 but for
    # LongRoPE past the original context); its K/V slots follow the plain positions
    position_offset: int = 0
    # the block tables of layer groups 1.. from ``group_table_starts`` on (``block_ids`` is
    # group 0's; empty for a model of one group): a sliding-window group's table holds the
    # padding block before its window
    group_block_ids: list[list[int]] = field(default_factory=list)
    table_start: int = 0  # the index of block_ids[0] in group 0's table
    group_table_starts: list[int] = field(default_factory=list)  # (empty: all 0)
    # a decode row of the token the runner last sampled for it, after its computed tokens
    continued: bool = False
    # a recurrent model's: the request's state slot, and the prefix-cache snapshots the row
    # fills: (offset in the row, slot), the state after that token copied into that slot
    state_slot: int = -1
    state_snapshots: Sequence[tuple[int, int]] = ()

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    """One step: its rows in batch order, and the throw-away rows of a rectangular batch."""

    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids preempted in this step
    num_padding_rows: int = 0  # static / dynamic batching: rows of finished members
    # copy-on-write: (source, destination) block ids to copy before the forward, in order
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # the persistent batch's deltas, applied before the rows: leaving, then entering
    removed: list[str] = field(default_factory=list)
    new_requests: list[NewRequest] = field(default_factory=list)
    # a recurrent model's state slots to fill before the forward, in order: (source slot, or
    # None for zeros; destination slot)
    state_copies: list[tuple[int | None, int]] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.rows)

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(slots=True)
class StepOutput:
    """Per row that sampled, in batch order: its new tokens (one, or accepted drafts plus one)."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[dict[int, float]] | None] = field(default_factory=list)
    num_draft_tokens: list[int] = field(default_factory=list)  # drafts verified (0 without)
    num_accepted: list[int] = field(default_factory=list)


# a step's block tables of one cache group: per row a list of block ids, or an int32 tensor
# ``[rows, width]`` whose row ``i`` starts with row ``i``'s table (entries past it: unused)
Tables = Sequence[list[int]] | torch.Tensor


@dataclass(slots=True)
class ForwardStep:
    """One forward's rows (``ModelRunner.forward``'s arguments) and, once built, their flattened
    tensors (``input_ids``, ``positions``, the backend's ``metadata``)."""

    block_tables: Tables
    starts: Sequence[int]
    token_ids: Sequence[list[int]]
    num_logits: Sequence[int]
    position_offsets: Sequence[int] | None = None  # per row, added to its RoPE positions
    # layer groups 1..: per group, per row, its block table (``block_tables`` is group 0's)
    group_tables: Sequence[Tables] = ()
    # a recurrent model's: per row its state slot, and the snapshots (row, offset, slot)
    state_slots: Sequence[int] = ()
    state_snapshots: Sequence[tuple[int, int, int]] = ()
    # where every row but the padding ones is a continued decode row: their persistent-batch
    # slots (int64), whose tokens and positions the runner gathers from its per-slot state
    slots: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    metadata: Any = None

    @property
    def decode_only(self) -> bool:
        """Every row computes exactly one token."""
        return bool(self.token_ids) and all(len(ids) == 1 for ids in self.token_ids)


class DecodePath(Protocol):
    """A faster way to run some decode steps (replayed CUDA graphs, the native CPU layers).
    ``can_run`` is cheap and side-effect free; ``run`` returns the final hidden states of every
    row (after the model's last norm), exactly what the model's forward would; ``run_logits``,
    for a step ``can_run`` allows, its float32 logits (``compute_logits`` of those states) where
    the path computes the model's head too, else None (the caller then calls ``run``). The
    routers' statistics are the model's own (``count_moe_rows``, set before the path runs)."""

    def can_run(self, step: ForwardStep) -> bool: ...

    def run(self, step: ForwardStep) -> torch.Tensor: ...

    def run_logits(self, step: ForwardStep) -> torch.Tensor | None: ...
