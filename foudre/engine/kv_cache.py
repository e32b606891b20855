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
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from foudre.engine.request import Request

BlockKey = tuple[int | None, tuple[int, ...]]  # (parent hash, token ids)


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None
    key: BlockKey | None = None
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
                if self.cached.get(block.block_hash) is block:
                    del self.cached[block.block_hash]
                block.block_hash = None
                block.key = None
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

    def lookup(self, block_hash: int, key: BlockKey) -> Block | None:
        block = self.cached.get(block_hash)
        if block is None or block.key != key:
            return None
        return block

    def cache(self, block: Block, block_hash: int, key: BlockKey) -> None:
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.key = key
        self.cached.setdefault(block_hash, block)

    def forget(self, block: Block) -> None:
        """Drop ``block``'s hash: it is no prefix-cache hit any more (its K/V is not trusted)."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None
        block.key = None

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
            block.key = None
        self.cached.clear()


class KVCacheManager:
    """Maps requests to blocks: allocation for new tokens, prefix hits and freeing."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        reserve_tokens: int | None = None,
        copy_on_write: bool = True,
        rope_offset: Callable[[int], int] | None = None,
    ):
        """``reserve_tokens`` turns paging off: each request reserves room for that many tokens
        (``max_model_len``) when first admitted, as a contiguous per-request buffer would. It is
        the non-paged baseline that shows what paging buys; prefix caching is then off.
        ``copy_on_write=False`` is the baseline of forking: a fork copies every block of its
        parent at once instead of sharing them."""
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.reserve_tokens = reserve_tokens
        if reserve_tokens is not None:
            enable_prefix_caching = False
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.enable_prefix_caching = enable_prefix_caching
        self.req_blocks: dict[str, list[Block]] = {}
        self.req_hashes: dict[str, list[int]] = {}  # hashes of the request's full final blocks
        self.req_block_ids: dict[str, list[int]] = {}  # req_blocks' ids, kept beside them
        self.req_num_cached: dict[str, int] = {}  # leading blocks known to be in the cache
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        self.copy_on_write = copy_on_write
        self.num_copies = 0  # blocks copied for writers (or for forks, without copy-on-write)
        self._copies: list[tuple[int, int]] = []  # (source, destination) block ids, this step
        # the model's RoPE position offset of a sequence of n tokens (RotaryEmbedding's
        # position_offset; None: always 0): K/V rotated under different offsets never match
        self.rope_offset = rope_offset

    # -- queries -------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table (the manager's own list, valid until its next change:
        read it, do not keep it)."""
        return self.req_block_ids.get(request_id, [])

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

    def get_computed_blocks(self, request: Request) -> tuple[list[Block], int]:
        """The longest run of cached blocks matching the request's leading tokens.

        At most ``num_tokens - 1`` tokens are returned as computed: the last token is always
        recomputed so that there are logits to sample from.
        """
        if not self.enable_prefix_caching:
            return [], 0
        limit = (request.num_tokens - 1) // self.block_size
        hashes = self._hash_blocks(request, request.num_tokens)
        hits: list[Block] = []
        parent = self._root(request)
        bs = self.block_size
        for i in range(limit):
            key = (parent, tuple(request.token_ids_range(i * bs, (i + 1) * bs)))
            block = self.pool.lookup(hashes[i], key)
            if block is None:
                break
            hits.append(block)
            parent = hashes[i]
        return hits, len(hits) * bs

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup (only admissions that succeed, so retries count once)."""
        if self.enable_prefix_caching:
            self.prefix_cache_queries += num_tokens
            self.prefix_cache_hits += num_hit_tokens

    # -- allocation ----------------------------------------------------------------------------
    def num_blocks_needed(self, request: Request, num_new_tokens: int, num_hit_blocks: int) -> int:
        """New blocks for ``num_new_tokens`` more tokens, copies of shared blocks included."""
        held = len(self.req_blocks.get(request.request_id, ())) + num_hit_blocks
        total = request.num_computed_tokens + num_new_tokens
        if num_hit_blocks:
            total = num_hit_blocks * self.block_size + num_new_tokens
        if self.reserve_tokens is not None:
            total = max(total, self.reserve_tokens)
        fresh = max(0, -(-total // self.block_size) - held)
        return fresh + len(
            self._shared_written(request, num_new_tokens) if not num_hit_blocks else ()
        )

    def _shared_written(self, request: Request, num_new_tokens: int) -> list[int]:
        """Indices in the request's table of the blocks that the next ``num_new_tokens`` tokens
        write into and that another table holds too (they must be copied first)."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks or num_new_tokens <= 0:
            return []
        bs = self.block_size
        first = request.num_computed_tokens // bs
        last = min(len(blocks), -(-(request.num_computed_tokens + num_new_tokens) // bs))
        return [i for i in range(first, last) if blocks[i].ref_cnt > 1]

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's blocks (its table; every reference count raised), as
        computed so far. Without copy-on-write, every block is copied at once instead."""
        assert child.request_id not in self.req_blocks, "the child already holds blocks"
        blocks = self.req_blocks.get(parent.request_id, [])
        if self.copy_on_write:
            for b in blocks:
                self.pool.touch(b)
            self.req_blocks[child.request_id] = list(blocks)
            self.req_num_cached[child.request_id] = self.req_num_cached.get(parent.request_id, 0)
        else:
            if len(blocks) > self.pool.num_free_blocks:
                raise MemoryError("no free blocks to copy the parent's")
            copies = self.pool.allocate(len(blocks))
            self._copies += [(b.block_id, c.block_id) for b, c in zip(blocks, copies, strict=True)]
            self.num_copies += len(copies)
            self.req_blocks[child.request_id] = copies
        self.req_block_ids[child.request_id] = [
            b.block_id for b in self.req_blocks[child.request_id]
        ]
        self.req_hashes[child.request_id] = list(self.req_hashes.get(parent.request_id, []))

    def can_fork(self, parent: Request) -> bool:
        """Whether ``fork`` from ``parent`` can succeed now (always, with copy-on-write)."""
        needed = len(self.req_blocks.get(parent.request_id, ()))
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
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[Block] = ()
    ) -> bool:
        """Whether ``allocate_slots`` with these arguments would succeed now."""
        need = self.num_blocks_needed(request, num_new_tokens, len(computed_blocks))
        free_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        return need + free_hits <= self.pool.num_free_blocks

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[Block] | None = None,
        num_final_tokens: int | None = None,
    ) -> bool:
        """Reserve blocks so that ``num_new_tokens`` more tokens of ``request`` have slots.

        ``computed_blocks`` are prefix-cache hits taken at admission. Returns False, changing
        nothing, when the pool cannot supply the blocks (free cached blocks count as free, but
        hits that are themselves free are not double counted). Blocks that become full with
        final tokens in this step are hashed now, so that requests admitted in the same step
        already share them: their K/V is written before any attention reads it.
        """
        computed_blocks = computed_blocks or []
        if not computed_blocks and self._fits(request, num_new_tokens):
            self._cache_new_blocks(request, num_new_tokens, num_final_tokens)
            return True
        if not self.can_allocate(request, num_new_tokens, computed_blocks):
            return False
        need = self.num_blocks_needed(request, num_new_tokens, len(computed_blocks))
        rid = request.request_id
        blocks = self.req_blocks.setdefault(rid, [])
        ids = self.req_block_ids.setdefault(rid, [])
        for i in self._shared_written(request, num_new_tokens):
            shared = blocks[i]
            [copy] = self.pool.allocate(1)
            self._copies.append((shared.block_id, copy.block_id))
            self.num_copies += 1
            self.pool.release([shared])
            blocks[i] = copy
            ids[i] = copy.block_id
            need -= 1
        for b in computed_blocks:
            self.pool.touch(b)
        fresh = self.pool.allocate(need)
        blocks += computed_blocks
        blocks += fresh
        ids += [b.block_id for b in computed_blocks]
        ids += [b.block_id for b in fresh]
        self._cache_new_blocks(request, num_new_tokens, num_final_tokens, computed_blocks)
        return True

    def _fits(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks already hold ``num_new_tokens`` more tokens, none of
        them shared (the common decode step: nothing to allocate nor copy)."""
        blocks = self.req_blocks.get(request.request_id)
        if not blocks or self.reserve_tokens is not None:
            return False
        bs = self.block_size
        end = request.num_computed_tokens + num_new_tokens
        if end > len(blocks) * bs:
            return False
        return all(
            blocks[i].ref_cnt == 1 for i in range(request.num_computed_tokens // bs, -(-end // bs))
        )

    def _cache_new_blocks(
        self,
        request: Request,
        num_new_tokens: int,
        num_final_tokens: int | None,
        computed_blocks: list[Block] | None = None,
    ) -> None:
        """Hash the blocks that this step fills with final tokens (see ``allocate_slots``)."""
        if self.enable_prefix_caching:
            end = request.num_computed_tokens + num_new_tokens
            if computed_blocks:
                end = len(computed_blocks) * self.block_size + num_new_tokens
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
        blocks = self.req_blocks[rid]
        self.req_num_cached[rid] = num_tokens // bs
        for i in range(done, num_tokens // bs):
            if blocks[i].block_hash is None:
                parent = hashes[i - 1] if i else self._root(request)
                key = (parent, tuple(request.token_ids_range(i * bs, (i + 1) * bs)))
                self.pool.cache(blocks[i], hashes[i], key)

    def free(self, request: Request, uncache: bool = False) -> None:
        """Return all of the request's blocks; the tail is freed first so it is evicted first.
        ``uncache``: also drop the hashes of those that no other request holds (their K/V may
        not have been written, e.g. by a step that failed)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.req_block_ids.pop(request.request_id, None)
        self.req_num_cached.pop(request.request_id, None)
        self.pool.release(blocks[::-1])
        self.req_hashes.pop(request.request_id, None)
        if uncache:
            for block in blocks:
                if block.ref_cnt == 0:
                    self.pool.forget(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed when no request holds blocks."""
        if self.pool.num_free_blocks != self.pool.num_blocks:
            return False
        self.pool.reset_prefix_cache()
        return True
