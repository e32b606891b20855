"""The token-budget scheduler: continuous batching with chunked prefill and preemption.

Every step it decides how many new tokens each request computes::

    budget = max_num_batched_tokens
    1. running requests, oldest first: each gets min(tokens it lacks, budget), where a request
       verifying speculative drafts also lacks its drafts (cut to what the budget allows);
       if blocks run out, the newest running request is preempted (freed, recomputed later)
    2. waiting requests, in arrival order, while budget, seats and blocks remain and the batching
       policy (``policies.py``) admits them:
       prefix-cache hits count as computed; the prompt is chunked to what the budget allows

A request admitted in a step is never preempted in that same step (victims are taken from the
tail, which holds only requests not yet scheduled), so blocks hashed at allocation always get
their K/V written.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from foudre.engine.kv_cache import KVCacheManager
from foudre.engine.policies import ContinuousPolicy, SchedulingPolicy
from foudre.engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes: requests in batch order with their number of new tokens."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_padding_rows: int = 0  # throw-away rows of a rectangular (static / dynamic) batch

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __len__(self) -> int:
        return len(self.requests)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: SchedulingPolicy | None = None,
    ) -> None:
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy or ContinuousPolicy()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.on_free: Callable[[Request], None] | None = None  # e.g. the draft model's cache

    # -- queue management ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Retire a request (finished or aborted) and return its blocks, wherever it is."""
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            with contextlib.suppress(ValueError):  # already taken out of the queue
                self.waiting.remove(request)
        request.status = status
        self._free(request)
        self.policy.on_finish(request)

    def _free(self, request: Request) -> None:
        request.clear_spec()
        self.kv.free(request)
        if self.on_free is not None:
            self.on_free(request)

    def _preempt(self, request: Request) -> None:
        self._free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            lacking = req.num_tokens - req.num_computed_tokens
            num_new = min(lacking + len(req.spec_token_ids), budget)
            if num_new < lacking + len(req.spec_token_ids):  # keep the drafts that fit
                keep = max(num_new - lacking, 0)
                req.spec_token_ids = req.spec_token_ids[:keep]
                if req.spec_probs is not None:
                    req.spec_probs = req.spec_probs[:keep] if keep else None
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new, num_final_tokens=req.num_tokens):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.requests.append(req)
                out.num_new_tokens.append(num_new)
                budget -= num_new
                i += 1

        if not out.preempted and self.waiting:
            allowed = self.policy.admissible(self.waiting, len(self.running), time.monotonic())
            while allowed > 0 and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                hits, num_cached = self.kv.get_computed_blocks(req)
                num_new = req.num_tokens - num_cached
                if num_new > budget:
                    if not self.enable_chunked_prefill and out.requests:
                        break
                    num_new = budget
                if not self.kv.allocate_slots(req, num_new, hits):
                    break
                self.waiting.popleft()
                allowed -= 1
                self.kv.record_prefix_lookup(req.num_tokens, num_cached)
                req.num_computed_tokens = num_cached
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_cached
                req.status = RequestStatus.RUNNING
                self.running.append(req)
                out.requests.append(req)
                out.num_new_tokens.append(num_new)
                budget -= num_new

        if out.requests:
            out.num_padding_rows = self.policy.num_padding_rows
        assert out.total_tokens <= self.max_num_batched_tokens
        assert len(self.running) <= self.max_num_seqs
        return out

    def check_invariants(self) -> None:
        """Blocks held by live requests plus free blocks account for the whole pool."""
        held = {b.block_id for blocks in self.kv.req_blocks.values() for b in blocks}
        assert len(held) + self.kv.num_free_blocks == self.kv.num_blocks, (
            len(held),
            self.kv.num_free_blocks,
            self.kv.num_blocks,
        )
