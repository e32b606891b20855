"""Paged KV-cache bookkeeping: blocks, reference counts, the LRU free queue and prefix caching.

This module only manages block *ids*; the tensors live in the runner. Invariants:

- A block is in the free queue exactly when its reference count is zero.
- A freed block keeps its hash (and so stays a prefix-cache hit) until it is handed out again;
  the free queue is LRU, so the least recently freed block is reused first.
- Only full blocks whose tokens are final are hashed. A block's hash chains its parent's hash and
  its own token ids; a lookup is verified against the stored parent hash and token ids, so a hash
  collision can never return the wrong K/V. The first block's parent is the request's
  ``cache_salt`` (hashed), so requests with different salts (tenants) never share a block.
- ``num_free_blocks + blocks held by requests == num_blocks`` (blocks shared by several requests
  counted once).
- A block's reference count is the number of block tables that hold it. Forked sequences (the
  samples of one prompt, the beams of a beam search) hold their parent's blocks, partly filled
  last block included; a step never writes into a block that another table holds: before it
  does, the block is copied (copy-on-write) and the writer's table takes the copy. The copies
  to make are handed to the runner with the step (``take_copies``), which applies them before
  the forward.
- The runner keeps its own copy of every running request's tables (``runner/slot_tables.py``),
  sent what changed since the scheduler last took it (``TableChanges``): appends, a copy that
  replaces a shared block, a window's released blocks becoming the placeholder, and a whole new
  table (admission, resumption after a preemption, a fork) from index 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from foudre.engine.request import Request
from foudre.engine.state_slots import StateSlots

BlockKey = tuple[int | None, tuple[int, ...]]  # (parent hash, token ids)


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    key: BlockKey | None = None
    group: int = 0  # the layer group whose K/V the block holds while it is cached
    snapshot: int = -1  # the recurrent state slot of its snapshot (recurrent models; -1: none)
    snapshot_step: int = 0  # the step that writes it (``StateSlots``)
    prev_free: Block | None = None
    next_free: Block | None = None


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) append, pop from the front and removal.

    The links live inside ``Block`` (an intrusive list) so that a prefix-cache hit on a free
    block can take it out of the middle of the queue without a search.
    """

    def __init__(self, blocks: Sequence[Block]) -> None:
        self._head = Block(-1)
        self._tail = Block(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for b in blocks:
            self.append(b)

    def append(self, block: Block) -> None:
        last = self._tail.prev_free
        assert last is not None and block.prev_free is None and block.next_free is None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def popleft(self) -> Block:
        block = self._head.next_free
        if block is None or block is self._tail:
            raise RuntimeError("no free block")
        self.remove(block)
        return block

    def remove(self, block: Block) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, "block is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def __iter__(self):  # type: ignore[no-untyped-def]
        b = self._head.next_free
        while b is not None and b is not self._tail:
            yield b
            b = b.next_free


class BlockPool:
    """All blocks of the cache, the free queue and the hash -> block map of cached blocks."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.cached: dict[int, Block] = {}
        self.num_shared = 0  # blocks whose reference count is above one
        # told of each block that leaves the cache (its recurrent state snapshot goes too)
        self.on_uncache: Callable[[Block], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    def allocate(self, n: int) -> list[Block]:
        """Take ``n`` free blocks (evicting their cached hashes); caller checked availability."""
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self.forget(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, block: Block) -> None:
        """Take another reference to a (possibly free) cached block."""
        if block.ref_cnt == 0:
            self.free_queue.remove(block)
        elif block.ref_cnt == 1:
            self.num_shared += 1
        block.ref_cnt += 1

    def release(self, blocks: Sequence[Block]) -> None:
        """Drop one reference to each block; blocks reaching zero join the free queue in order."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of block {block.block_id}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)
            elif block.ref_cnt == 1:
                self.num_shared -= 1

    def lookup(self, block_hash: int, key: BlockKey, group: int = 0) -> Block | None:
        block = self.cached.get(block_hash)
        if block is None or block.key != key or block.group != group:
            return None
        return block

    def cache(self, block: Block, block_hash: int, key: BlockKey, group: int = 0) -> None:
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.key = key
        block.group = group
        self.cached.setdefault(block_hash, block)

    def forget(self, block: Block) -> None:
        """Drop ``block``'s hash: it is no prefix-cache hit any more (its K/V is not trusted)."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.key = None
        if self.on_uncache is not None:
            self.on_uncache(block)

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            self.forget(block)
        self.cached.clear()


class TableChanges:
    """Where each request's block tables changed since the scheduler last took them (``take``):
    per layer group, the lowest index where a block was replaced (a copy-on-write, a window's
    released blocks becoming the placeholder) or appended (past the length when last taken).
    A request never taken (admitted, resumed after a preemption, forked) changed from 0; its
    owner ``forget``s a request whose tables are freed."""

    def __init__(self, num_groups: int) -> None:
        self.num_groups = num_groups
        self.replaced: dict[str, list[int]] = {}
        self.taken: dict[str, list[int]] = {}  # per request, per group: its length when taken

    def replace(self, request_id: str, group: int, index: int) -> None:
        """The request's table of ``group`` holds another block at ``index`` (and maybe on)."""
        replaced = self.replaced.setdefault(request_id, [1 << 62] * self.num_groups)
        replaced[group] = min(replaced[group], index)

    def take(
        self, request_id: str, tables: Sequence[list[int]] | None
    ) -> tuple[list[int], list[list[int]]]:
        """The change of the request's ``tables`` (its ids per group, None: it holds none):
        per group the first index changed and the ids from there to the table's end (empty
        where nothing changed). Writing each group's ids at its start into the copy taken last
        gives ``tables``."""
        taken = self.taken.get(request_id)
        if (  # the common decode row: its one table unchanged
            tables
            and taken is not None
            and len(taken) == 1
            and len(tables[0]) == taken[0]
            and request_id not in self.replaced
        ):
            return taken, [[]]
        if not tables:
            return [0] * self.num_groups, [[] for _ in range(self.num_groups)]
        replaced = self.replaced.pop(request_id, None)
        if taken is None:
            starts = [0] * len(tables)
        elif replaced is not None:
            starts = [min(a, b) for a, b in zip(taken, replaced, strict=True)]
        else:
            starts = taken
        self.taken[request_id] = [len(t) for t in tables]
        return starts, [t[s:] for s, t in zip(starts, tables, strict=True)]

    def forget(self, request_id: str) -> None:
        self.replaced.pop(request_id, None)
        self.taken.pop(request_id, None)


class KVCacheManager:
    """Maps requests to blocks: allocation for new tokens, prefix hits and freeing.

    Layer groups (``windows``, one entry per group of the runner's ``KVCacheGroup``s: None for
    full attention, ``W`` for a sliding window of ``W`` positions): each request holds one block
    table per group, all drawn from the one pool (a block id names one block of every layer
    of whichever group holds it). A full-attention group keeps every block of the context; a
    window group keeps only the blocks that a token still to compute can read::

        positions  0 ........................ c-W+1 ....... c-1 | c ... (new tokens)
        full       [b0][b1][b2][b3][b4][b5][b6][b7][b8][b9]
        window     [--][--][--][--][--][--][b6][b7][b8][b9]     (c = computed tokens)

    the blocks entirely before ``c - W + 1`` go back to the pool (keeping their hash, so they
    stay prefix-cache hits) and the table keeps a placeholder there, ``null_block`` (the
    runner's padding block: the positions still index it, no backend reads it). So a
    request's window group never holds more than ``ceil(W / block_size) + 1`` blocks in a
    decode step. One group of full attention is the manager of a model without windows.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        reserve_tokens: int | None = None,
        copy_on_write: bool = True,
        rope_offset: Callable[[int], int] | None = None,
        windows: Sequence[int | None] = (None,),
        states: StateSlots | None = None,
    ):
        """``reserve_tokens`` turns paging off: each request reserves room for that many tokens
        (``max_model_len``) when first admitted, as a contiguous per-request buffer would. It is
        the non-paged baseline that shows what paging buys; prefix caching is then off, and
        window groups keep their blocks. ``copy_on_write=False`` is the baseline of forking: a
        fork copies every block of its parent at once instead of sharing them. ``windows``:
        the layer groups (see the class docstring). ``states``: the recurrent state slots of a
        model with recurrent layers (``engine/state_slots.py``): a request holds one from its
        first blocks to its end, and a prefix hit restores a snapshot."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        if not windows:
            raise ValueError("a KV cache needs at least one layer group")
        self.reserve_tokens = reserve_tokens
        if reserve_tokens is not None:
            enable_prefix_caching = False
            windows = [None] * len(windows)
        self.windows: list[int | None] = list(windows)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # the placeholder of a window group's released blocks: the runner's padding block,
        # never in the pool nor counted
        self.null_block = Block(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_tables: dict[str, list[list[Block]]] = {}  # per request, per group
        self.req_table_ids: dict[str, list[list[int]]] = {}  # their ids, kept beside them
        self.table_changes = TableChanges(len(self.windows))  # (the scheduler forgets)
        self.req_hashes: dict[str, list[int]] = {}  # hashes of the request's full final blocks
        self.req_num_cached: dict[str, int] = {}  # leading blocks known to be in the cache
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.copy_on_write = copy_on_write
        self.num_copies = 0  # blocks copied for writers (or for forks, without copy-on-write)
        self._copies: list[tuple[int, int]] = []  # (source, destination) block ids, this step
        # the model's RoPE position offset of a sequence of n tokens (RotaryEmbedding's
        # position_offset; None: always 0): K/V rotated under different offsets never match
        self.rope_offset = rope_offset
        self.states = states
        if states is not None:
            self.pool.on_uncache = states.drop

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def req_blocks(self) -> dict[str, list[Block]]:
        """The blocks each request holds, every group's (placeholders left out): a snapshot."""
        null = self.null_block
        return {
            rid: [b for table in tables for b in table if b is not null]
            for rid, tables in self.req_tables.items()
        }

    def pin(self, blocks: Sequence[Block]) -> None:
        """Hold ``blocks`` (prefix hits planned for several requests admitted together) while
        they are allocated one by one: none is handed out fresh, nor loses its hash or its
        snapshot, before its request takes it. ``unpin`` after."""
        for b in blocks:
            if b is not self.null_block:
                self.pool.touch(b)

    def unpin(self, blocks: Sequence[Block]) -> None:
        self.pool.release([b for b in blocks if b is not self.null_block])

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now, over its groups (what it costs the pool)."""
        null = self.null_block
        tables = self.req_tables.get(request_id, ())
        return sum(1 for table in tables for b in table if b is not null)

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table of group 0 (the manager's own list, valid until its next
        change: read it, do not keep it)."""
        tables = self.req_table_ids.get(request_id)
        return tables[0] if tables else []

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The request's block tables of groups 1.. (empty for a model of one group)."""
        tables = self.req_table_ids.get(request_id)
        return tables[1:] if tables else [[] for _ in self.windows[1:]]

    # -- prefix cache --------------------------------------------------------------------------
    def position_offset(self, request: Request) -> int:
        """What the model shifts the RoPE positions of ``request``'s tokens by, as long as
        it holds its present tokens: 0 but for LongRoPE past the original context."""
        return 0 if self.rope_offset is None else self.rope_offset(request.num_tokens)

    def _root(self, request: Request) -> int | None:
        """The parent of a request's first block: its cache salt and its RoPE position offset
        (the same tokens rotated otherwise hold other K/V), hashed (None without either)."""
        salt, offset = request.cache_salt, self.position_offset(request)
        if not offset:
            return None if salt is None else hash(("cache_salt", salt))
        return hash(("cache_salt", salt, "rope_offset", offset))

    def _hash_blocks(self, request: Request, num_tokens: int) -> list[int]:
        """Chained hashes of the request's full blocks within its first ``num_tokens`` tokens."""
        hashes = self.req_hashes.setdefault(request.request_id, [])
        bs = self.block_size
        parent = hashes[-1] if hashes else self._root(request)
        for i in range(len(hashes), num_tokens // bs):
            key = (parent, tuple(request.token_ids_range(i * bs, (i + 1) * bs)))
            parent = hash(key)
            hashes.append(parent)
        return hashes

    @staticmethod
    def _group_hash(block_hash: int, group: int) -> int:
        """The pool's key of a block of ``group`` holding the block of ``block_hash``: a
        block's K/V in one group's layers is no hit for another group."""
        return block_hash if group == 0 else hash(("kv_group", group, block_hash))

    def _first_needed(self, group: int, num_computed: int) -> int:
        """The first block that tokens after ``num_computed`` read in ``group``."""
        window = self.windows[group]
        if window is None:
            return 0
        return max(0, num_computed - window + 1) // self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[list[Block]], int]:
        """The longest prefix of the request's leading full blocks that every group can serve
        from the cache: per group its blocks of that prefix (a window group's before its
        window: placeholders), and the prefix's tokens.

        A full-attention group serves ``m`` blocks when its first ``m`` are cached, a window
        group when the blocks that the token after them reads are (its last ``W - 1``
        positions). At most ``num_tokens - 1`` tokens are returned as computed: the last token
        is always recomputed so that there are logits to sample from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        found = _Lookups(self, request)
        m = (request.num_tokens - 1) // bs
        for g, window in enumerate(self.windows):
            if window is None:  # the leading run of cached blocks
                m = next((i for i in range(m) if found.get(g, i) is None), m)
        while True:  # the window groups (and states), until every one serves the same prefix
            m_before = m
            for g, window in enumerate(self.windows):
                if window is not None:
                    m = self._window_hit(found, g, m)
            if self.states is not None:  # back to the last block with a written snapshot
                m = self.states.hit(lambda i: found.get(0, i), m)
            if m == m_before:
                break
        hits: list[list[Block]] = []
        for g in range(self.num_groups):
            first = self._first_needed(g, m * bs)
            hits.append([self.null_block] * first + [found.block(g, i) for i in range(first, m)])
        return hits, m * bs

    def _window_hit(self, found: _Lookups, group: int, m: int) -> int:
        """The longest prefix of at most ``m`` blocks whose window ``group`` has cached: from
        ``m`` down, a miss at block ``i`` rules out every prefix past it whose window holds it,
        i.e. all between ``i`` and the present candidate (so it scans only windows)."""
        while m > 0:
            first = self._first_needed(group, m * self.block_size)
            miss = next((i for i in range(m - 1, first - 1, -1) if found.get(group, i) is None), -1)
            if miss < 0:
                return m
            m = miss
        return 0

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup (only admissions that succeed, so retries count once)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # -- allocation ----------------------------------------------------------------------------
    def _table(self, request_id: str, group: int) -> list[Block]:
        tables = self.req_tables.get(request_id)
        return tables[group] if tables else []

    def num_blocks_needed(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[Sequence[Block]] = (),
    ) -> int:
        """New blocks for ``num_new_tokens`` more tokens over every group, copies of shared
        blocks included (``computed_blocks``: the prefix hits of ``get_computed_blocks``)."""
        return sum(
            self._group_need(
                request, g, num_new_tokens, computed_blocks[g] if computed_blocks else ()
            )
            for g in range(self.num_groups)
        )

    def _group_need(
        self, request: Request, group: int, num_new_tokens: int, hits: Sequence[Block]
    ) -> int:
        held = len(self._table(request.request_id, group)) + len(hits)
        total = request.num_computed_tokens + num_new_tokens
        if hits:
            total = len(hits) * self.block_size + num_new_tokens
        if self.reserve_tokens is not None:
            total = max(total, self.reserve_tokens)
        fresh = max(0, -(-total // self.block_size) - held)
        return fresh + len(self._shared_written(request, group, num_new_tokens) if not hits else ())

    def num_free_hits(self, computed_blocks: Sequence[Sequence[Block]], counted: set[int]) -> int:
        """Prefix hits that sit in the free queue (taking them uses up free blocks), not yet in
        ``counted`` (block ids, updated)."""
        n = 0
        for hits in computed_blocks:
            for b in hits:
                if b is not self.null_block and b.ref_cnt == 0 and b.block_id not in counted:
                    counted.add(b.block_id)
                    n += 1
        return n

    def _shared_written(self, request: Request, group: int, num_new_tokens: int) -> list[int]:
        """Indices in the request's table of ``group`` of the blocks that the next
        ``num_new_tokens`` tokens write into and that another table holds too (they must be
        copied first)."""
        blocks = self._table(request.request_id, group)
        if not blocks or num_new_tokens <= 0:
            return []
        bs = self.block_size
        first = request.num_computed_tokens // bs
        last = min(len(blocks), -(-(request.num_computed_tokens + num_new_tokens) // bs))
        return [i for i in range(first, last) if blocks[i].ref_cnt > 1]

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's blocks (its tables; every reference count raised), as
        computed so far. Without copy-on-write, every block is copied at once instead."""
        assert child.request_id not in self.req_tables, "the child already holds blocks"
        null = self.null_block
        tables = self.req_tables.get(parent.request_id) or [[] for _ in self.windows]
        if self.copy_on_write:
            for table in tables:
                for b in table:
                    if b is not null:
                        self.pool.touch(b)
            self.req_tables[child.request_id] = [list(t) for t in tables]
            self.req_num_cached[child.request_id] = self.req_num_cached.get(parent.request_id, 0)
        else:
            if self.num_held_blocks(parent.request_id) > self.pool.num_free_blocks:
                raise MemoryError("no free blocks to copy the parent's")
            copied = []
            for table in tables:
                copies = [b if b is null else self.pool.allocate(1)[0] for b in table]
                self._copies += [
                    (b.block_id, c.block_id)
                    for b, c in zip(table, copies, strict=True)
                    if c is not b
                ]
                self.num_copies += sum(1 for c in copies if c is not null)
                copied.append(copies)
            self.req_tables[child.request_id] = copied
        self.req_table_ids[child.request_id] = [
            [b.block_id for b in t] for t in self.req_tables[child.request_id]
        ]
        self.req_hashes[child.request_id] = list(self.req_hashes.get(parent.request_id, []))
        if self.states is not None:  # a state is rewritten every token: copied at once
            self.states.fork(parent.request_id, child.request_id)

    def can_fork(self, parent: Request) -> bool:
        """Whether ``fork`` from ``parent`` can succeed now (always, with copy-on-write and,
        for a recurrent model, a free state slot)."""
        if self.states is not None and not self.states.free_slots:
            return False
        needed = self.num_held_blocks(parent.request_id)
        return self.copy_on_write or needed <= self.pool.num_free_blocks

    def take_copies(self) -> list[tuple[int, int]]:
        """The block copies (source, destination) made since the last call, in order; the
        runner must apply them before the step's forward writes or reads those blocks."""
        # a destination written twice (its first owner preempted in the step): the last wins
        latest = {dst: src for src, dst in self._copies}
        self._copies = []
        return [(src, dst) for dst, src in latest.items()]

    @property
    def num_shared_blocks(self) -> int:
        """Blocks held by more than one table right now."""
        return self.pool.num_shared

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[Sequence[Block]] = (),
    ) -> bool:
        """Whether ``allocate_slots`` with these arguments would succeed now."""
        if self.states is not None and not self.states.can_take(request.request_id):
            return False
        need = self.num_blocks_needed(request, num_new_tokens, computed_blocks)
        free_hits = self.num_free_hits(computed_blocks, set())
        return need + free_hits <= self.pool.num_free_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[Sequence[Block]] | None = None,
        num_final_tokens: int | None = None,
    ) -> bool:
        """Reserve blocks so that ``num_new_tokens`` more tokens of ``request`` have slots.

        ``computed_blocks`` are prefix-cache hits taken at admission. Returns False, changing
        nothing but releasing the window groups' blocks that no token still to compute reads,
        when the pool cannot supply the blocks (free cached blocks count as free, but hits
        that are themselves free are not double counted). Blocks that become full with final
        tokens in this step are hashed now, so that requests admitted in the same step
        already share them: their K/V is written before any attention reads it.
        """
        hits = computed_blocks if computed_blocks and any(computed_blocks) else ()
        self.release_outside_windows(request)
        if not hits and self._fits(request, num_new_tokens):
            self._cache_new_blocks(request, num_new_tokens, num_final_tokens, hits)
            return True
        if not self.can_allocate(request, num_new_tokens, hits):
            return False
        rid = request.request_id
        tables = self.req_tables.setdefault(rid, [[] for _ in self.windows])
        all_ids = self.req_table_ids.setdefault(rid, [[] for _ in self.windows])
        needs = [
            self._group_need(request, g, num_new_tokens, hits[g] if hits else ())
            for g in range(self.num_groups)
        ]
        for group_hits in hits:  # all groups' first: no free hit may be allocated as fresh
            for b in group_hits:
                if b is not self.null_block:
                    self.pool.touch(b)
        for g, (blocks, ids) in enumerate(zip(tables, all_ids, strict=True)):
            group_hits = hits[g] if hits else ()
            need = needs[g]
            for i in self._shared_written(request, g, num_new_tokens) if not group_hits else ():
                self.table_changes.replace(rid, g, i)
                shared = blocks[i]
                [copy] = self.pool.allocate(1)
                self._copies.append((shared.block_id, copy.block_id))
                self.num_copies += 1
                self.pool.release([shared])
                blocks[i] = copy
                ids[i] = copy.block_id
                need -= 1
            fresh = self.pool.allocate(need)
            blocks += group_hits
            blocks += fresh
            ids += [b.block_id for b in group_hits]
            ids += [b.block_id for b in fresh]
        if self.states is not None:  # zeros, or the state after the last hit block
            self.states.take(rid, hits[0][-1].snapshot if hits else None)
        self._cache_new_blocks(request, num_new_tokens, num_final_tokens, hits)
        return True

    def release_outside_windows(self, request: Request) -> None:
        """Return to the pool the blocks of ``request``'s window groups that lie entirely
        before its window (no token after its computed ones reads them); its tables keep the
        placeholder there. Safe at any time: ``num_computed_tokens`` only falls by preemption
        (which frees everything) or by rejected drafts (never below the count that scheduled
        them, which is the count this ran with)."""
        tables = self.req_tables.get(request.request_id)
        if tables is None:
            return
        null = self.null_block
        all_ids = self.req_table_ids[request.request_id]
        for g, window in enumerate(self.windows):
            if window is None:
                continue
            blocks, ids = tables[g], all_ids[g]
            first = min(self._first_needed(g, request.num_computed_tokens), len(blocks))
            start = first
            while start > 0 and blocks[start - 1] is not null:
                start -= 1
            if start == first:
                continue
            self.pool.release(blocks[start:first])
            self.table_changes.replace(request.request_id, g, start)
            blocks[start:first] = [null] * (first - start)
            ids[start:first] = [null.block_id] * (first - start)

    def _fits(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks already hold ``num_new_tokens`` more tokens, none of
        them shared (the common decode step: nothing to allocate nor copy)."""
        tables = self.req_tables.get(request.request_id)
        if not tables or self.reserve_tokens is not None:
            return False
        bs = self.block_size
        end = request.num_computed_tokens + num_new_tokens
        first, last = request.num_computed_tokens // bs, -(-end // bs)
        for blocks in tables:
            if end > len(blocks) * bs:
                return False
            if not all(blocks[i].ref_cnt == 1 for i in range(first, last)):
                return False
        return True

    def _cache_new_blocks(
        self,
        request: Request,
        num_new_tokens: int,
        num_final_tokens: int | None,
        computed_blocks: Sequence[Sequence[Block]] = (),
    ) -> None:
        """Hash the blocks that this step fills with final tokens (see ``allocate_slots``)."""
        if self.enable_prefix_caching:
            end = request.num_computed_tokens + num_new_tokens
            if computed_blocks:
                end = len(computed_blocks[0]) * self.block_size + num_new_tokens
            if num_final_tokens is not None:
                end = min(end, num_final_tokens)
            self._cache_full_blocks(request, min(end, request.num_tokens))

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        bs = self.block_size
        rid = request.request_id
        done = self.req_num_cached.get(rid, 0)
        if num_tokens // bs <= done:
            return
        hashes = self._hash_blocks(request, num_tokens)
        tables = self.req_tables[rid]
        self.req_num_cached[rid] = num_tokens // bs
        for i in range(done, num_tokens // bs):
            parent = hashes[i - 1] if i else self._root(request)
            key = (parent, tuple(request.token_ids_range(i * bs, (i + 1) * bs)))
            for g, blocks in enumerate(tables):
                block = blocks[i]
                if block.block_hash is None and block is not self.null_block:
                    self.pool.cache(block, self._group_hash(hashes[i], g), key, g)
                    if (
                        g == 0
                        and self.states is not None
                        and self.pool.cached.get(hashes[i]) is block
                    ):  # (the block its hash finds: a snapshot where one is due)
                        self.states.assign(block, rid, i, bs)

    def free(self, request: Request, uncache: bool = False) -> None:
        """Return all of the request's blocks, every group's; the tail is freed first so it is
        evicted first. ``uncache``: also drop the hashes of those that no other request holds
        (their K/V may not have been written, e.g. by a step that failed)."""
        tables = self.req_tables.pop(request.request_id, [])
        if self.states is not None:
            self.states.release(request.request_id)
        self.req_table_ids.pop(request.request_id, None)
        self.req_num_cached.pop(request.request_id, None)
        self.req_hashes.pop(request.request_id, None)
        null = self.null_block
        for blocks in tables:
            held = [b for b in blocks if b is not null]
            self.pool.release(held[::-1])
            if uncache:
                for block in held:
                    if block.ref_cnt == 0:
                        self.pool.forget(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no request holds blocks."""
        if self.pool.num_free_blocks != self.pool.num_blocks:
            return False
        self.pool.reset_prefix_cache()
        return True


class _Lookups:
    """A request's prefix-cache lookups, per (group, block index), each done once."""

    def __init__(self, kv: KVCacheManager, request: Request) -> None:
        self.kv = kv
        self.request = request
        self.hashes = kv._hash_blocks(request, request.num_tokens)
        self.done: dict[tuple[int, int], Block | None] = {}

    def get(self, group: int, i: int) -> Block | None:
        """Block ``i`` of the request as ``group`` has it cached (None: not cached)."""
        if (group, i) not in self.done:
            bs = self.kv.block_size
            parent = self.hashes[i - 1] if i else self.kv._root(self.request)
            key = (parent, tuple(self.request.token_ids_range(i * bs, (i + 1) * bs)))
            block_hash = self.kv._group_hash(self.hashes[i], group)
            self.done[group, i] = self.kv.pool.lookup(block_hash, key, group)
        return self.done[group, i]

    def block(self, group: int, i: int) -> Block:
        block = self.get(group, i)
        assert block is not None
        return block
