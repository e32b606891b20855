"""Batching policies: which waiting requests the scheduler may admit now.

The scheduler is the same for all of them (token budget, chunked prefill, preemption); a policy
only gates admission, so comparing them measures batching alone:

- ``continuous`` (default): admit whenever budget, seats and blocks allow; requests join and
  leave the running batch at every step (in-flight batching).
- ``static``: wait for a full batch of ``max_num_seqs`` requests (or ``batch_wait_ms``, when given,
  or the end of the offline input), then run that batch to completion before forming the next.
- ``dynamic``: form a batch from what arrived within ``batch_wait_ms`` of the oldest waiting
  request (up to ``max_num_seqs``), then run it to completion.

Static and dynamic batches are rectangular, as in engines without iteration-level scheduling
(Hugging Face ``generate``, request-level servers): a member that finishes early keeps its row
until the whole batch is done, and that row is still computed, as padding
(``num_padding_rows``; the runner runs one throw-away token per padding row each step). That
wasted work, and the seats it holds, are what continuous batching wins back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from foudre.engine.request import Request

POLICIES = ("continuous", "static", "dynamic")


class SchedulingPolicy(ABC):
    """Decides how many requests at the head of the waiting queue may be admitted."""

    # set while the caller has submitted everything it will (offline ``LLM.generate``), so that
    # policies that wait for arrivals stop waiting
    flush: bool = False

    @property
    def num_padding_rows(self) -> int:
        """Rows of finished requests that the current batch still computes (0 by default)."""
        return 0

    @abstractmethod
    def admissible(self, waiting: Sequence[Request], num_running: int, now: float) -> int:
        """Number of leading waiting requests that may be admitted in this step."""

    def on_finish(self, request: Request) -> None:  # noqa: B027 - optional hook
        """Called when a request leaves the engine (finished or aborted)."""


class ContinuousPolicy(SchedulingPolicy):
    def admissible(self, waiting: Sequence[Request], num_running: int, now: float) -> int:
        return len(waiting)


class BatchPolicy(SchedulingPolicy):
    """Run-to-completion batches (static and dynamic batching).

    A batch is fixed when it forms: only its members are admitted (a preempted member goes back to
    the head of the queue and is re-admitted), and no new batch forms until all members are done.
    """

    def __init__(self, max_batch: int, wait_s: float | None) -> None:
        self.max_batch = max_batch
        self.wait_s = wait_s
        self.members: set[str] = set()
        self.batch_size = 0  # members when the current batch formed
        self.num_batches = 0

    @property
    def num_padding_rows(self) -> int:
        return self.batch_size - len(self.members) if self.members else 0

    def admissible(self, waiting: Sequence[Request], num_running: int, now: float) -> int:
        if not self.members and waiting:
            full = len(waiting) >= self.max_batch
            waited = self.wait_s is not None and now - waiting[0].arrival_time >= self.wait_s
            if full or waited or self.flush:
                self.members = {r.request_id for r in list(waiting)[: self.max_batch]}
                self.batch_size = len(self.members)
                self.num_batches += 1
        count = 0
        for req in waiting:
            if req.request_id not in self.members:
                break
            count += 1
        return count

    def on_finish(self, request: Request) -> None:
        self.members.discard(request.request_id)


def make_policy(name: str, max_num_seqs: int, batch_wait_ms: float | None) -> SchedulingPolicy:
    """The policy called ``name``; ``ValueError`` for an unknown one."""
    if name == "continuous":
        return ContinuousPolicy()
    if name == "static":
        return BatchPolicy(max_num_seqs, None if batch_wait_ms is None else batch_wait_ms / 1e3)
    if name == "dynamic":
        return BatchPolicy(max_num_seqs, (50.0 if batch_wait_ms is None else batch_wait_ms) / 1e3)
    raise ValueError(f"unknown scheduling_policy {name!r} (choose from {', '.join(POLICIES)})")
