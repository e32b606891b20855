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

The scheduler owns ``num_computed_tokens``: admission sets it to the prefix-cache hit,
preemption resets it, and ``update`` (after the runner's forward) advances it by the tokens the
step computed and rolls back the drafts the target rejected. Nothing else writes it.

It also tells the runner's persistent batch who enters it (admitted, resumed or forked requests,
as ``NewRequest``) and who leaves it (finished or preempted ids): the deltas since the last step
that ran, carried by the next ``SchedulerOutput`` that has rows (a step without rows does not
reach the runner, so its deltas wait). A row carries only what changed in its request's block
tables since its last row (``KVCacheManager.table_changes``' ``take``), and marks a decode row
``continued`` when the runner already holds its input: the request stayed in the batch since
its last sampling row, whose last token is the one it now computes (not so after a beam
search replaced it, nor for a request that just entered), so the runner lays it out from its
per-slot state.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable

from foudre.engine.kv_cache import KVCacheManager
from foudre.engine.policies import ContinuousPolicy, SchedulingPolicy
from foudre.engine.request import Cohort, Request, RequestStatus
from foudre.runner.step import NewRequest, ScheduledRow, SchedulerOutput, StepOutput


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
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        # requests of a step that failed, each scheduled alone until it samples (see quarantine)
        self.quarantined: set[str] = set()
        self.num_preemptions = 0
        self.on_free: Callable[[Request], None] | None = None  # e.g. the draft model's cache
        # the runner's batch deltas not yet sent: entering requests (by id), leaving ids
        self._entering: dict[str, Request] = {}
        self._leaving: list[str] = []
        # per request in the runner's batch: the token the runner sampled for it last
        self._sampled: dict[str, int] = {}

    # -- queue management ----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        """Queue ``request``; its ``fork_children`` wait, unqueued, to be forked from it."""
        for r in (request, *request.fork_children):
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already in use")
        for r in (request, *request.fork_children):
            self.requests[r.request_id] = r
        self.waiting.append(request)

    def fork(self, parent: Request, child: Request) -> None:
        """Start ``child`` from ``parent``'s computed tokens: it holds the parent's blocks (one
        more reference each; written blocks are copied first) and runs from the next step. A
        child's tokens must extend the parent's computed ones. Without copy-on-write and with
        too few free blocks for the copies, the child is queued to compute its tokens itself."""
        self.requests[child.request_id] = child
        if not self.kv.can_fork(parent):
            child.num_computed_tokens = 0
            child.status = RequestStatus.WAITING
            self.waiting.appendleft(child)
            return
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.position_offset = parent.position_offset
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        self._entering[child.request_id] = child

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def set_draining(self, draining: bool) -> None:
        """Tell the batching policy that no more requests will arrive (offline input fully
        queued), so that batches stop waiting for arrivals; ``False`` when more may come."""
        self.policy.flush = draining

    def finish(self, request: Request, status: RequestStatus, uncache: bool = False) -> None:
        """Retire a request (finished, aborted or failed) and return its blocks, wherever it is
        (``uncache``: their K/V is not trusted, see ``KVCacheManager.free``)."""
        assert status.finished
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif not request.is_finished:
            with contextlib.suppress(ValueError):  # already taken out of the queue
                self.waiting.remove(request)
        request.status = status
        self.requests.pop(request.request_id, None)
        self.quarantined.discard(request.request_id)
        self._free(request, uncache)
        self.policy.on_finish(request)
        if request.cohort is not None and request in request.cohort.members:
            request.cohort.members.remove(request)
        for child in request.fork_children:  # never forked: they compute the prompt themselves
            if not child.is_finished:
                self.waiting.appendleft(child)
        request.fork_children = []

    def _free(self, request: Request, uncache: bool = False) -> None:
        self._entering.pop(request.request_id, None)
        self._sampled.pop(request.request_id, None)
        self.kv.table_changes.forget(request.request_id)  # (its next tables: whole)
        self._leaving.append(request.request_id)
        request.clear_spec()
        self.kv.free(request, uncache)
        if self.on_free is not None:
            self.on_free(request)

    def _preempt(self, request: Request, uncache: bool = False, count: bool = True) -> None:
        self._free(request, uncache)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if count:
            request.num_preemptions += 1
            self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _recompute_rotated(self) -> list[Request]:
        """Free and queue for recomputation (at the head of the queue, with their cohorts) the
        running requests whose K/V was rotated for a sequence shorter than they now hold: a
        LongRoPE model's request that grew past the original context (its offset changed, see
        ``KVCacheManager.position_offset``). Transformers' ``generate`` does the same for
        Phi-3: the step a sequence first exceeds ``original_max_position_embeddings`` it drops
        the cache and recomputes the whole sequence with the long factors. Not counted as
        preemptions. The drafts of the others are cut where accepting them would cross."""
        offset_of = self.kv.rope_offset
        assert offset_of is not None
        stale = [r for r in self.running if offset_of(r.num_tokens) != r.position_offset]
        for req in list(stale):
            if req.cohort is not None:
                stale += [m for m in req.cohort.members if m.status == RequestStatus.RUNNING]
        victims = list(dict.fromkeys(stale))
        for req in reversed(victims):  # each goes to the head: keep their order
            self.running.remove(req)
            self._preempt(req, count=False)
        for req in self.running:  # logits past the switch would read the old rotation
            keep = len(req.spec_token_ids)
            while keep and offset_of(req.num_tokens + keep) != req.position_offset:
                keep -= 1
            if keep < len(req.spec_token_ids):
                req.spec_token_ids = req.spec_token_ids[:keep]
                if req.spec_probs is not None:
                    req.spec_probs = req.spec_probs[:keep] if keep else None
        return victims

    def quarantine(self, request_ids: list[str]) -> None:
        """The rows of a step that failed: preempt their requests (blocks freed, and dropped from
        the prefix cache: that step's K/V was not written) and from now on schedule each alone,
        until it samples once, so that a request that makes steps fail fails by itself while
        the others resume (they recompute, exactly as after a preemption)."""
        ids = list(request_ids)
        for rid in request_ids:  # a cohort's other members read what the step hashed
            req = self.requests.get(rid)
            if req is not None and req.cohort is not None:
                ids += [m.request_id for m in req.cohort.members if m.request_id not in ids]
        for rid in reversed(ids):  # preemption puts each at the head: keep step order
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue
            self.running.remove(req)
            self._preempt(req, uncache=True)
            self.quarantined.add(rid)

    def _probe(self) -> Request | None:
        """The quarantined request to run alone this step (None when none is quarantined)."""
        if not self.quarantined:
            return None
        for req in self.running:
            if req.request_id in self.quarantined:
                return req
        for req in self.waiting:
            if req.request_id in self.quarantined:
                return req
        self.quarantined.clear()  # finished meanwhile
        return None

    # -- the step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step's rows (see the module docstring); preempts when blocks run out."""
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        budget = self.max_num_batched_tokens
        probe = self._probe()
        if self.kv.rope_offset is not None:
            preempted += self._recompute_rotated()

        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if probe is not None and req is not probe:
                i += 1
                continue
            num_tokens = req.num_tokens
            lacking = num_tokens - req.num_computed_tokens
            wanted = lacking + len(req.spec_token_ids)
            num_new = min(wanted, budget)
            if num_new < wanted:  # keep the drafts that fit
                keep = max(num_new - lacking, 0)
                req.spec_token_ids = req.spec_token_ids[:keep]
                if req.spec_probs is not None:
                    req.spec_probs = req.spec_probs[:keep] if keep else None
            if num_new <= 0:
                i += 1
                continue
            while not self.kv.allocate_slots(req, num_new, num_final_tokens=num_tokens):
                earlier = {id(r) for r in self.running[:i]}
                victims = self._preempt_newest({id(r) for r, _ in scheduled})
                preempted += victims
                i -= sum(1 for v in victims if id(v) in earlier)  # cohort members before req
                if req in victims:
                    break
            else:
                scheduled.append((req, num_new))
                budget -= num_new
                i += 1
        # a preempted cohort member may sit before ``i``: keep only requests still running
        scheduled = [(r, n) for r, n in scheduled if r.status == RequestStatus.RUNNING]
        budget = self.max_num_batched_tokens - sum(n for _, n in scheduled)

        now = time.monotonic()
        if probe is not None and probe.status != RequestStatus.RUNNING:
            self._make_room(probe, budget, preempted)
        if self.waiting and (self.waiting[0] is probe if probe else not preempted):
            if probe is None:
                allowed = self.policy.admissible(self.waiting, len(self.running), now)
            else:
                allowed = 1
            free_seats = self.max_num_seqs - self._occupied_seats()
            while allowed > 0 and budget > 0 and self.waiting:
                req = self.waiting[0]
                cohort = req.cohort if probe is None else None
                group = self._waiting_members(cohort) if cohort is not None else [req]
                seats = self._seats_needed(req, cohort)
                if seats > free_seats:
                    break
                admitted = self._admit(group, budget, scheduled, now)
                if admitted is None:
                    break
                allowed -= len(group)
                free_seats -= seats
                budget -= admitted

        out = SchedulerOutput(
            [],
            [r.request_id for r in preempted],
            self.policy.num_padding_rows if scheduled else 0,
            self.kv.take_copies() if scheduled else [],  # else they wait for a step that runs
        )
        if scheduled:  # the batch's deltas, else they wait for a step that runs
            out.removed, self._leaving = self._leaving, []
            out.new_requests = self._take_entering()
            out.rows = [self._row(req, n, out.new_requests) for req, n in scheduled]
            self._state_rows(out)
        assert out.total_tokens <= self.max_num_batched_tokens
        assert self._occupied_seats() <= self.max_num_seqs
        return out

    def _take_entering(self) -> list[NewRequest]:
        """The requests entering the runner's batch since the last step that ran (their slots
        are new: nothing sampled there yet)."""
        for rid in self._entering:
            self._sampled.pop(rid, None)
        entering, self._entering = self._entering, {}
        return [new_request(r) for r in entering.values()]

    def _state_rows(self, out: SchedulerOutput) -> None:
        """A recurrent model's step: the state copies to make first (zeroed slots, restored
        snapshots, forks), each row's slot and the snapshots it fills."""
        states = self.kv.states
        if states is None:
            return
        out.state_copies = states.take_copies()
        for row in out.rows:
            row.state_slot = states.slot(row.request_id)
            row.state_snapshots = states.take_snapshots(
                row.request_id, row.start, row.num_new_tokens
            )

    def _admit(
        self,
        group: list[Request],
        budget: int,
        scheduled: list[tuple[Request, int]],
        now: float,
    ) -> int | None:
        """Admit the waiting requests of ``group`` (one request, or a cohort's waiting members)
        all or none: each gets its prefix-cache hits and as much of the rest as the budget
        leaves. Returns the tokens scheduled, or None when blocks (or, without chunked prefill,
        the budget) do not allow it."""
        plan = []
        left = budget
        counted: set[int] = set()
        need = 0
        for req in group:
            hits, num_cached = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, left)
            whole = num_new == req.num_tokens - num_cached
            if not (whole or self.enable_chunked_prefill):
                if req is not group[0]:
                    num_new = 0  # a cohort's next members: admitted now, computed next steps
                elif scheduled:
                    return None  # no chunked prefill: a prompt runs whole, in a step of its own
            need += self.kv.num_blocks_needed(req, num_new, hits)
            need += self.kv.num_free_hits(hits, counted)
            plan.append((req, hits, num_cached, num_new))
            left -= num_new
        states = self.kv.states
        if need > self.kv.num_free_blocks or (states and not states.has_free(len(plan))):
            return None
        pinned = [b for _, hits, _, _ in plan for group in hits for b in group]
        self.kv.pin(pinned)  # no member's allocation may take (or evict) another's hits
        for req, hits, num_cached, num_new in plan:
            ok = self.kv.allocate_slots(req, num_new, hits)
            assert ok, "the plan counted the blocks"
            self.waiting.remove(req)
            self.kv.record_prefix_lookup(req.num_tokens, num_cached)
            req.num_computed_tokens = num_cached
            req.position_offset = self.kv.position_offset(req)
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._entering[req.request_id] = req
            if num_new:
                scheduled.append((req, num_new))
        self.kv.unpin(pinned)
        return budget - left

    def _waiting_members(self, cohort: Cohort) -> list[Request]:
        return [m for m in cohort.members if m.status != RequestStatus.RUNNING]

    def _seats_needed(self, req: Request, cohort: Cohort | None) -> int:
        if cohort is None:
            return req.num_seats
        running = sum(1 for m in cohort.members if m.status == RequestStatus.RUNNING)
        return cohort.seats if running == 0 else len(self._waiting_members(cohort))

    def _occupied_seats(self) -> int:
        """Running requests, plus seats reserved for their pending forks and for cohorts."""
        seats = len(self.running)
        cohorts: dict[int, Cohort] = {}
        for req in self.running:
            seats += len(req.fork_children)
            if req.cohort is not None:
                cohorts[id(req.cohort)] = req.cohort
        for cohort in cohorts.values():
            seats += max(cohort.seats - len(cohort.members), 0)
        return seats

    def _preempt_newest(self, scheduled: set[int] | None = None) -> list[Request]:
        """Preempt the newest running request, with every running member of its cohort. A
        member already scheduled in this step (``scheduled``: ids) had blocks hashed for K/V
        that this step will now not write: they leave the prefix cache."""
        victim = self.running.pop()
        victims = [victim]
        if victim.cohort is not None:
            for member in victim.cohort.members:
                if member is not victim and member.status == RequestStatus.RUNNING:
                    self.running.remove(member)
                    victims.append(member)
        for v in victims:
            self._preempt(v, uncache=scheduled is not None and id(v) in scheduled)
        return victims

    def _make_room(self, probe: Request, budget: int, preempted: list[Request]) -> None:
        """Preempt running requests (newest first) until the waiting ``probe`` has a seat and
        blocks for its next chunk, then put it at the head of the queue."""
        while self.running:
            hits, num_cached = self.kv.get_computed_blocks(probe)
            num_new = min(probe.num_tokens - num_cached, budget)
            free_seats = self.max_num_seqs - self._occupied_seats()
            seated = free_seats >= self._seats_needed(probe, None)
            if seated and self.kv.can_allocate(probe, num_new, hits):
                break
            preempted += self._preempt_newest()
        self.waiting.remove(probe)
        self.waiting.appendleft(probe)

    def _row(self, req: Request, num_new: int, entering: list[NewRequest]) -> ScheduledRow:
        """The row of ``req`` computing ``num_new`` tokens, with its tables' change; the
        samples forking from it at this step enter the runner's batch (``entering``) to draw
        from its logits."""
        rid = req.request_id
        start = req.num_computed_tokens
        end = start + num_new
        num_tokens = req.num_tokens
        kv = self.kv
        starts, ids = kv.table_changes.take(rid, kv.req_table_ids.get(rid))
        if end == num_tokens and num_new == 1 and req.output_token_ids:  # a decode row
            token = req.output_token_ids[-1]
            row = ScheduledRow(
                rid,
                start,
                [token],
                ids[0],
                1,
                spec_token_ids=req.spec_token_ids,
                fork_ids=[c.request_id for c in self._forks(req, entering)]
                if req.fork_children
                else [],
                position_offset=req.position_offset,
                table_start=starts[0],
                continued=self._sampled.get(rid) == token,
            )
        else:
            # a request samples once it reaches its last token; every draft adds one position
            num_logits = end - num_tokens + 1 if end >= num_tokens else 0
            row = ScheduledRow(
                rid,
                start,
                req.input_token_ids(start, end),
                ids[0],
                num_logits,
                position_offset=req.position_offset,
                table_start=starts[0],
            )
            if num_logits:
                assert num_logits == len(req.spec_token_ids) + 1, "drafts scheduled partially"
                row.spec_token_ids = req.spec_token_ids
                row.spec_probs = req.spec_probs
                row.fork_ids = [c.request_id for c in self._forks(req, entering)]
        if len(ids) > 1:
            row.group_block_ids = ids[1:]
            row.group_table_starts = starts[1:]
        return row

    @staticmethod
    def _forks(req: Request, entering: list[NewRequest]) -> list[Request]:
        """The samples that fork from ``req`` at this step, entering the runner's batch."""
        forks = [c for c in req.fork_children if not c.is_finished]
        entering += [new_request(c) for c in forks]
        return forks

    def update(self, scheduled: SchedulerOutput, result: StepOutput) -> list[Request]:
        """Account for a step the runner computed: every scheduled request advances by its new
        tokens, and a request that verified drafts rolls back the ones the target rejected
        (their K/V is overwritten later; a recurrent model's request also the accepted ones,
        which its next step recomputes from the state the runner restored). Returns the
        requests that sampled, in ``result``'s order; their tokens are the engine's to
        append."""
        for row in scheduled.rows:
            self.requests[row.request_id].num_computed_tokens += row.num_new_tokens
        sampled = []
        for rid, tokens, n_draft, n_accepted in zip(
            result.request_ids,
            result.token_ids,
            result.num_draft_tokens,
            result.num_accepted,
            strict=True,
        ):
            req = self.requests[rid]
            self._sampled[rid] = tokens[-1]
            req.num_computed_tokens -= n_draft - n_accepted
            if n_accepted < n_draft and self.kv.states is not None:
                # a recurrent state went past the rejected drafts: the runner put back the
                # state after the row's first token, and the accepted drafts are recomputed
                req.num_computed_tokens -= n_accepted
            req.clear_spec()
            self.quarantined.discard(rid)  # it ran a whole step and sampled: not the culprit
            sampled.append(req)
        for row in scheduled.rows:  # after the rollbacks: forks start from the final count
            if row.fork_ids:
                parent = self.requests[row.request_id]
                for child in parent.fork_children:
                    if child.request_id in row.fork_ids and not child.is_finished:
                        self.fork(parent, child)
                parent.fork_children = []
        return sampled

    def check_invariants(self) -> None:
        """Blocks held by live requests (in any layer group) plus free blocks account for the
        whole pool; so do the recurrent state slots (one per running request) and snapshots."""
        held = {b.block_id for blocks in self.kv.req_blocks.values() for b in blocks}
        assert len(held) + self.kv.num_free_blocks == self.kv.num_blocks, (
            len(held),
            self.kv.num_free_blocks,
            self.kv.num_blocks,
        )
        states = self.kv.states
        if states is not None:
            assert len(states.free_slots) + len(states.of_request) == states.num_slots
            assert set(states.of_request) == {r.request_id for r in self.running}
            assert len(states.free_snapshots) + len(states.holders) == states.num_snapshots


def new_request(req: Request) -> NewRequest:
    """What the runner's batch keeps of ``req`` (its token lists copied: the engine appends)."""
    return NewRequest(
        req.request_id,
        list(req.prompt_token_ids),
        list(req.output_token_ids),
        req.sampling_params,
        req.eos_token_ids,
        req.generator,
        req.grammar,
    )
