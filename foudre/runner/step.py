"""What crosses between the scheduler and the runner, and between the runner and its fast paths.

The scheduler (``engine/``) decides; the runner computes. Their whole contract is two plain
records, so the runner needs nothing from ``engine``::

    Scheduler.schedule() --SchedulerOutput--> ModelRunner.execute() --StepOutput--+
    Scheduler.update()   <--------------------------------------------------------+

A row is "compute ``token_ids`` at positions ``start...`` of request ``request_id``, whose K/V
lives in ``block_ids``, and sample from the last ``num_logits`` of them": 0 while a prompt is
still being chunked in, 1 for a row that samples its next token, 1 + drafts for a row that
verifies speculative tokens. What sampling reads of the request (its parameters, its output so
far, its drafts) comes as ``sampler``, a ``DraftRow`` (``sample/rejection.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from foudre.sample.rejection import DraftRow


@dataclass(slots=True)
class ScheduledRow:
    request_id: str
    start: int  # position of token_ids[0]; the first `start` tokens have K/V in the cache
    token_ids: list[int]
    block_ids: list[int]
    num_logits: int  # 0, 1 or 1 + drafts
    sampler: DraftRow | None = None  # set when num_logits > 0
    # sequences forked from this one at this step (the other samples of its prompt): each draws
    # its own token from the same last logits, then holds the row's blocks as its own
    forks: list[DraftRow] = field(default_factory=list)
    fork_ids: list[str] = field(default_factory=list)

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


@dataclass(slots=True)
class ForwardStep:
    """One forward's rows (``ModelRunner.forward``'s arguments) and, once built, their flattened
    tensors (``input_ids``, ``positions``, the backend's ``metadata``)."""

    block_tables: Sequence[list[int]]
    starts: Sequence[int]
    token_ids: Sequence[list[int]]
    num_logits: Sequence[int]
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
    the path computes the model's head too, else None (the caller then calls ``run``).
    ``counts_moe_rows``, read after ``can_run`` allowed a step: whether the runner must set the
    routers' row count (``count_moe_rows``) before it runs (False where the path knows its
    model has no sparse layer: the count walks every layer, ~80 us a step once the weights'
    stream has left the caches cold)."""

    @property
    def counts_moe_rows(self) -> bool: ...

    def can_run(self, step: ForwardStep) -> bool: ...

    def run(self, step: ForwardStep) -> torch.Tensor: ...

    def run_logits(self, step: ForwardStep) -> torch.Tensor | None: ...
