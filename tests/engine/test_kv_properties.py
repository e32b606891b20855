"""Property tests (hypothesis) of the block pool, the KV-cache manager and the scheduler.

The scheduler is driven without a model: a fake "execute" advances ``num_computed_tokens`` and
writes each computed token's id into a dict ``slot -> token id`` that stands for the K/V cache.
Every running request must read its own token ids back from its block table at every computed
position; this catches prefix hits that return the wrong blocks and blocks reused while still
referenced. Every cached (hashed) block must hold the tokens of its key.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from foudre.engine.kv_cache import Block, BlockPool, FreeBlockQueue, KVCacheManager
from foudre.engine.request import Request, RequestStatus
from foudre.engine.scheduler import Scheduler
from foudre.runner.step import StepOutput
from foudre.sampling_params import SamplingParams

BS = 4
# the op sequences come from a seeded ``random.Random``: much faster than hypothesis' own
# ``st.randoms()``, at the price of shrinking only the configuration and the seed
SEEDS = st.integers(0, 2**32 - 1)


# -- FreeBlockQueue / BlockPool -------------------------------------------------------------------
def test_free_queue_basic_order_and_removal() -> None:
    blocks = [Block(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4] and q.num_free == 5
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and q.num_free == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 4, 2, 0]
    with pytest.raises(AssertionError):
        q.remove(Block(9))  # not in the queue
    for _ in range(5):
        q.popleft()
    with pytest.raises(RuntimeError):
        q.popleft()


def test_release_of_free_block_asserts() -> None:
    pool = BlockPool(3, enable_prefix_caching=True)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(AssertionError, match="double free"):
        pool.release([b])


@settings(max_examples=150, deadline=None)
@given(num_blocks=st.integers(1, 12), seed=SEEDS)
def test_block_pool_random_ops(num_blocks: int, seed: int) -> None:
    rnd = random.Random(seed)
    pool = BlockPool(num_blocks, enable_prefix_caching=True)
    ref = [0] * num_blocks  # model: reference counts
    free_order = list(range(num_blocks))  # model: LRU free queue, front is reused first
    refs: list[int] = []  # references held, one entry per reference
    hashes: dict[int, tuple[int, tuple[int, ...]]] = {}  # model: block id -> (hash, key tokens)
    for _ in range(60):
        op = rnd.choice(["alloc", "touch", "release", "release", "cache"])
        if op == "alloc" and free_order:
            n = rnd.randint(1, len(free_order))
            got = [b.block_id for b in pool.allocate(n)]
            assert got == free_order[:n]  # least recently freed first
            del free_order[:n]
            for i in got:
                assert ref[i] == 0
                ref[i] = 1
                if i in hashes:  # reuse evicts the hash
                    h, toks = hashes.pop(i)
                    assert pool.lookup(h, (None, toks)) is None
                assert pool.blocks[i].block_hash is None
            refs.extend(got)
        elif op == "touch" and hashes:
            i = rnd.choice(sorted(hashes))  # only cached blocks are ever touched
            h, toks = hashes[i]
            assert pool.lookup(h, (None, toks)) is pool.blocks[i]
            pool.touch(pool.blocks[i])
            if ref[i] == 0:
                free_order.remove(i)
            ref[i] += 1
            refs.append(i)
        elif op == "release" and refs:
            k = rnd.randint(1, len(refs))
            chosen = rnd.sample(range(len(refs)), k)
            ids = [refs[j] for j in chosen]
            if len(set(ids)) < len(ids):
                continue  # keep one reference per block per call: simpler to model
            for j in sorted(chosen, reverse=True):
                del refs[j]
            pool.release([pool.blocks[i] for i in ids])
            for i in ids:
                ref[i] -= 1
                if ref[i] == 0:
                    free_order.append(i)
        elif op == "cache" and refs:
            i = rnd.choice(refs)
            if i not in hashes:
                toks = (i, rnd.randint(0, 3))
                h = hash((None, toks))
                if pool.lookup(h, (None, toks)) is None:
                    pool.cache(pool.blocks[i], h, (None, toks))
                    hashes[i] = (h, toks)
        # invariants
        assert [b.block_id for b in pool.free_queue] == free_order
        assert pool.num_free_blocks == sum(1 for r in ref if r == 0) == len(free_order)
        assert [b.ref_cnt for b in pool.blocks] == ref
        for i in range(num_blocks):
            assert ref[i] == refs.count(i)
        for i, (h, toks) in hashes.items():
            assert pool.lookup(h, (None, toks)) is pool.blocks[i]
            assert pool.lookup(h, (None, (*toks, 0))) is None  # a mismatching key never hits
    for i in range(num_blocks):
        while ref[i]:
            pool.release([pool.blocks[i]])
            ref[i] -= 1
        with pytest.raises(AssertionError):
            pool.release([pool.blocks[i]])
    assert pool.num_free_blocks == num_blocks


# -- scheduler + KV-cache manager driven by a fake model ------------------------------------------
class FakeRun:
    """Scheduler, KV manager and a model of the K/V contents: ``slot -> token id``."""

    def __init__(self, sched: Scheduler, rnd: random.Random) -> None:
        self.s = sched
        self.kv = sched.kv
        self.rnd = rnd
        self.kv_content: dict[int, int] = {}
        self.max_tokens: dict[str, int] = {}
        self.live: list[Request] = []
        self.finished: list[Request] = []
        self.tables: dict[str, list[int]] = {}  # the runner's copies, kept by the rows' changes

    def slot(self, req: Request, pos: int) -> int:
        table = self.kv.block_ids(req.request_id)
        return table[pos // BS] * BS + pos % BS

    def step(self) -> None:
        s, kv = self.s, self.kv
        out = s.schedule()
        s.check_invariants()
        assert out.total_tokens <= s.max_num_batched_tokens
        assert len(out) <= s.max_num_seqs and len(s.running) <= s.max_num_seqs
        ids = [row.request_id for row in out.rows]
        assert len(set(ids)) == len(ids)
        reqs = [s.requests[rid] for rid in ids]
        for rid in out.preempted:
            v = s.requests[rid]
            assert v.status == RequestStatus.PREEMPTED and rid not in ids
            assert v.num_computed_tokens == 0 and rid not in kv.req_blocks
        for rid in out.removed:  # the runner's batch deltas
            self.tables.pop(rid, None)
        for new in out.new_requests:
            self.tables[new.request_id] = []
        # fake execute: write every computed token into its slot
        for row, req in zip(out.rows, reqs, strict=True):
            n = row.num_new_tokens
            assert n >= 1 and req.status == RequestStatus.RUNNING
            start = req.num_computed_tokens
            assert row.start == start and start + n <= req.num_tokens
            assert row.token_ids == req.token_ids_range(start, start + n)
            table = self.tables[row.request_id]  # the row's change applied to the copy
            assert row.table_start <= len(table)
            if row.block_ids:
                table[row.table_start :] = row.block_ids
            assert table == kv.block_ids(req.request_id)
            assert len(kv.block_ids(req.request_id)) * BS >= start + n
            assert row.num_logits == (1 if start + n == req.num_tokens else 0)
            if req.num_cached_tokens > 0 and start == req.num_cached_tokens:
                assert start % BS == 0 and start < req.num_tokens
            for p, tok in enumerate(req.token_ids_range(start, start + n), start):
                self.kv_content[self.slot(req, p)] = tok
        sampling = [row.request_id for row in out.rows if row.num_logits]
        zeros = [0] * len(sampling)
        result = StepOutput(sampling, [[0]] * len(sampling), [None] * len(sampling), zeros, zeros)
        for req in s.update(out, result):  # advances num_computed_tokens
            assert req.num_computed_tokens == req.num_tokens  # sample
            req.output_token_ids.append(self.rnd.randint(0, 2))
            if len(req.output_token_ids) == self.max_tokens[req.request_id]:
                s.finish(req, RequestStatus.FINISHED_LENGTH)
                self.live.remove(req)
                self.finished.append(req)
        self.check_state()

    def check_state(self) -> None:
        s, kv = self.s, self.kv
        s.check_invariants()
        # reference counts equal the number of requests holding each block; free == ref 0
        holders: dict[int, int] = {}
        for blocks in kv.req_blocks.values():
            assert len({b.block_id for b in blocks}) == len(blocks)
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        free = {b.block_id for b in kv.pool.free_queue}
        assert len(free) == kv.num_free_blocks
        assert not free & set(holders), "a block is both free and held"
        for b in kv.pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0)
        # only running requests hold blocks; waiting (and preempted) ones hold none
        assert set(kv.req_blocks) == {r.request_id for r in s.running}
        for r in s.waiting:
            assert r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert r.num_computed_tokens == 0
        # K/V content: every running request reads its own tokens at its computed positions
        for r in s.running:
            assert r.num_computed_tokens <= r.num_tokens
            assert len(kv.block_ids(r.request_id)) * BS >= r.num_computed_tokens
            want = r.token_ids_range(0, r.num_computed_tokens)
            got = [self.kv_content.get(self.slot(r, p)) for p in range(r.num_computed_tokens)]
            assert got == want, (r.request_id, r.num_cached_tokens)
        # every cached block holds the tokens of its key (its K/V was written)
        for h, b in kv.pool.cached.items():
            assert b.block_hash == h and b.key is not None
            got = [self.kv_content.get(b.block_id * BS + j) for j in range(BS)]
            assert tuple(got) == b.key[1], b.block_id


@settings(max_examples=600, deadline=None)
@given(
    num_blocks=st.integers(8, 40),
    max_batched=st.integers(4, 64),
    max_seqs=st.integers(1, 8),
    chunked=st.booleans(),
    prefix=st.booleans(),
    num_requests=st.integers(1, 12),
    seed=SEEDS,
)
def test_scheduler_random_arrivals_and_aborts(
    num_blocks: int,
    max_batched: int,
    max_seqs: int,
    chunked: bool,
    prefix: bool,
    num_requests: int,
    seed: int,
) -> None:
    rnd = random.Random(seed)
    max_model_len = num_blocks * BS  # one request always fits in the pool alone
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix)
    sched = Scheduler(kv, max_batched, max_seqs, max_model_len, enable_chunked_prefill=chunked)
    run = FakeRun(sched, rnd)
    # prompts are prefixes of a few base sequences (plus a random tail), so prefixes repeat
    bases = [[rnd.randint(0, 2) for _ in range(80)] for _ in range(3)]
    arrived = 0
    aborted = 0
    steps = 0
    while arrived < num_requests or sched.has_unfinished():
        steps += 1
        assert steps < 3000, "no progress: livelock"
        num_arrivals = rnd.choice([0, 0, 1, 2]) or int(not sched.has_unfinished())
        for _ in range(num_arrivals):
            if arrived == num_requests:
                break
            plen = rnd.randint(1, min(80, max_model_len - 1))
            prompt = rnd.choice(bases)[:plen]
            tail = rnd.randint(0, min(3, plen - 1))
            prompt[plen - tail :] = [rnd.randint(0, 2) for _ in range(tail)]
            # the last output token is never computed: prompt + max_tokens - 1 slots at most
            max_tokens = rnd.randint(1, min(24, max_model_len - plen + 1))
            req = Request(f"r{arrived}", prompt, SamplingParams(max_tokens=max_tokens))
            run.max_tokens[req.request_id] = max_tokens
            sched.add_request(req)
            run.live.append(req)
            arrived += 1
        if run.live and rnd.random() < 0.08:
            victim = rnd.choice(run.live)
            sched.finish(victim, RequestStatus.FINISHED_ABORTED)
            run.live.remove(victim)
            aborted += 1
            run.check_state()
        if sched.has_unfinished():
            run.step()
    assert len(run.finished) + aborted == num_requests
    for r in run.finished:
        assert len(r.output_token_ids) == run.max_tokens[r.request_id]
        assert r.status == RequestStatus.FINISHED_LENGTH
        if not prefix:
            assert r.num_cached_tokens == 0
    assert kv.num_free_blocks == num_blocks
    assert not kv.req_blocks and not kv.req_hashes
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    if prefix:
        assert kv.prefix_cache_hits <= kv.prefix_cache_queries
        assert kv.prefix_cache_hits % BS == 0
    else:
        assert kv.prefix_cache_hits == kv.prefix_cache_queries == 0


# -- prefix-cache specifics -----------------------------------------------------------------------
def _run_to_completion(run: FakeRun, req: Request, max_tokens: int = 1) -> None:
    run.max_tokens[req.request_id] = max_tokens
    run.s.add_request(req)
    run.live.append(req)
    for _ in range(100):
        if not run.s.has_unfinished():
            return
        run.step()
    raise AssertionError("request did not finish")


def _make_run(num_blocks: int = 64, prefix: bool = True) -> FakeRun:
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=prefix)
    return FakeRun(Scheduler(kv, 256, 8, num_blocks * BS), random.Random(0))


def test_prefix_cache_hits_in_tokens() -> None:
    run = _make_run()
    kv = run.kv
    base = list(range(10, 22))  # 3 full blocks
    first = Request("a", list(base), SamplingParams(max_tokens=1))
    _run_to_completion(run, first)
    assert first.num_cached_tokens == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (12, 0)
    assert kv.num_free_blocks == kv.num_blocks  # freed, but its blocks keep their hashes

    # identical prompt of exactly 3 blocks: the last token is recomputed, so 2 blocks hit
    same = Request("b", list(base), SamplingParams(max_tokens=1))
    _run_to_completion(run, same)
    assert same.num_cached_tokens == 8
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (24, 8)

    # 3 blocks + 1 token: all three blocks hit
    longer = Request("c", [*base, 99], SamplingParams(max_tokens=1))
    _run_to_completion(run, longer)
    assert longer.num_cached_tokens == 12
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (37, 20)

    # differs in the first block: hashes are chained, nothing hits even though blocks 2-3 match
    other = Request("d", [7, *base[1:]], SamplingParams(max_tokens=1))
    _run_to_completion(run, other)
    assert other.num_cached_tokens == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (49, 20)

    # differs in the last block only: the first two blocks hit
    tail = Request("e", [*base[:8], 1, 2, 3, 4, 5], SamplingParams(max_tokens=1))
    _run_to_completion(run, tail)
    assert tail.num_cached_tokens == 8
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (62, 28)


def test_output_tokens_are_cached_too() -> None:
    run = _make_run()
    a = Request("a", list(range(10, 16)), SamplingParams(max_tokens=8))
    _run_to_completion(run, a, max_tokens=8)
    # prompt (6) + the 7 computed output tokens = 13 tokens: blocks 0..2 are full and final
    b = Request("b", a.all_token_ids, SamplingParams(max_tokens=1))
    _run_to_completion(run, b)
    assert b.num_cached_tokens == 12


def test_hit_while_the_owner_is_still_running() -> None:
    run = _make_run()
    base = list(range(30, 42))
    a = Request("a", list(base), SamplingParams(max_tokens=5))
    run.max_tokens["a"] = 5
    run.s.add_request(a)
    run.live.append(a)
    run.step()  # a's prompt is computed; its blocks are hashed
    b = Request("b", [*base, 1], SamplingParams(max_tokens=2))
    run.max_tokens["b"] = 2
    run.s.add_request(b)
    run.live.append(b)
    run.step()
    assert b.num_cached_tokens == 12
    assert run.kv.block_ids("b")[:3] == run.kv.block_ids("a")[:3]
    assert all(run.kv.pool.blocks[i].ref_cnt == 2 for i in run.kv.block_ids("a")[:3])
    while run.s.has_unfinished():
        run.step()
    assert run.kv.num_free_blocks == run.kv.num_blocks


def test_freed_tail_blocks_are_evicted_first() -> None:
    run = _make_run(num_blocks=4)
    base = list(range(50, 62))  # 3 blocks of the 4
    _run_to_completion(run, Request("a", list(base), SamplingParams(max_tokens=1)))
    # free queue is now [never used, a's block 2, a's block 1, a's block 0]
    filler = Request("f", [0] * 8, SamplingParams(max_tokens=1))  # takes two blocks
    _run_to_completion(run, filler)
    again = Request("b", [*base, 5], SamplingParams(max_tokens=1))
    _run_to_completion(run, again)
    assert again.num_cached_tokens == 8  # a's third block was evicted, its first two survive


def test_no_prefix_caching_never_hits() -> None:
    run = _make_run(prefix=False)
    base = list(range(10, 22))
    _run_to_completion(run, Request("a", list(base), SamplingParams(max_tokens=1)))
    b = Request("b", [*base, 1], SamplingParams(max_tokens=1))
    _run_to_completion(run, b)
    assert b.num_cached_tokens == 0
    assert run.kv.prefix_cache_queries == run.kv.prefix_cache_hits == 0


# -- forks and copy-on-write ----------------------------------------------------------------------
class ForkModel:
    """A KV manager driven by random forks, writes and frees, beside a model of each block's
    contents (``block id -> {offset: (sequence, position)}``): copies are applied as the runner
    applies them, and each write records who wrote what where."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self.content: dict[int, dict[int, tuple[str, int]]] = {}
        self.live: dict[str, Request] = {}
        self.origin: dict[tuple[str, int], tuple[str, int]] = {}  # what each position holds
        self.count = 0

    def new(self, num_tokens: int) -> Request:
        self.count += 1
        req = Request(f"s{self.count}", [1] * num_tokens, SamplingParams())
        self.live[req.request_id] = req
        return req

    def apply_copies(self) -> None:
        """What the runner does before the next forward reads or writes anything."""
        for src, dst in self.kv.take_copies():
            assert self.kv.pool.blocks[dst].ref_cnt == 1
            self.content[dst] = dict(self.content.get(src, {}))

    def write(self, req: Request, n: int) -> bool:
        if not self.kv.allocate_slots(req, n):
            return False
        self.apply_copies()
        table = self.kv.req_blocks[req.request_id]
        for pos in range(req.num_computed_tokens, req.num_computed_tokens + n):
            block = table[pos // BS]
            assert block.ref_cnt == 1, "a write into a block another table holds"
            self.content.setdefault(block.block_id, {})[pos % BS] = (req.request_id, pos)
            self.origin[(req.request_id, pos)] = (req.request_id, pos)
        req.num_computed_tokens += n
        req.output_token_ids += [2] * max(0, req.num_computed_tokens - req.num_tokens)
        return True

    def fork(self, parent: Request) -> Request:
        child = self.new(0)
        child.prompt_token_ids = list(parent.prompt_token_ids)
        child.output_token_ids = list(parent.output_token_ids)
        self.kv.fork(parent, child)
        self.apply_copies()  # without copy-on-write the fork copies at once
        child.num_computed_tokens = parent.num_computed_tokens
        for pos in range(parent.num_computed_tokens):  # the child sees what the parent wrote
            self.origin[(child.request_id, pos)] = self.origin[(parent.request_id, pos)]
        return child

    def free(self, req: Request) -> None:
        self.kv.free(req)
        del self.live[req.request_id]

    def check(self) -> None:
        holders: dict[int, int] = {}
        for blocks in self.kv.req_blocks.values():
            for b in blocks:
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for b in self.kv.pool.blocks:
            assert b.ref_cnt == holders.get(b.block_id, 0), "count != tables holding it"
        shared = sum(1 for n in holders.values() if n > 1)
        assert self.kv.num_shared_blocks == shared
        assert len(holders) + self.kv.num_free_blocks == self.kv.num_blocks
        for rid, req in self.live.items():  # every sequence reads back what it should
            table = self.kv.req_blocks.get(rid, [])
            for pos in range(req.num_computed_tokens):
                got = self.content[table[pos // BS].block_id][pos % BS]
                assert got == self.origin[(rid, pos)], (rid, pos)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(4, 24), seed=SEEDS, cow=st.booleans())
def test_forks_share_blocks_and_copy_before_writes(num_blocks: int, seed: int, cow: bool) -> None:
    rnd = random.Random(seed)
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=False, copy_on_write=cow)
    model = ForkModel(kv)
    for _ in range(60):
        op = rnd.random()
        live = list(model.live.values())
        if op < 0.25 or not live:
            model.write(model.new(0), rnd.randint(1, 2 * BS))
        elif op < 0.5:
            parent = rnd.choice(live)
            if parent.request_id in kv.req_blocks and kv.can_fork(parent):
                model.fork(parent)
        elif op < 0.85:
            model.write(rnd.choice(live), rnd.randint(1, BS + 1))
        else:
            model.free(rnd.choice(live))
        model.check()
    for req in list(model.live.values()):
        model.free(req)
    assert kv.num_free_blocks == kv.num_blocks and kv.num_shared_blocks == 0
