"""Owns the model and the KV-cache tensors; turns a ``SchedulerOutput`` into sampled tokens.

One ``execute`` = one forward over the flattened new tokens of every scheduled request, then
logits only at the positions that sample (the last token of each request that has caught up with
its prompt and output, plus every draft position when it verifies speculative tokens), then one
batched ``sample`` (or ``verify`` when drafts are present).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from foudre.attention import AttentionBackend, BatchLayout
from foudre.attention.base import GroupedMetadata, slot_mapping, table_tensor
from foudre.attention.cache_spec import (
    AttentionSpec,
    CacheSpec,
    FullAttentionSpec,
    KVCacheGroup,
    LatentAttentionSpec,
    RecurrentCache,
    RecurrentStateSpec,
    attention_layers,
    element_size,
    pages_of,
    recurrent_layers,
    state_bytes_per_request,
)
from foudre.attention.latent import build_latent_metadata
from foudre.attention.paged import PagedBackend
from foudre.attention.quantized_cache import QuantizedKVCache, kv_bytes_per_token_head
from foudre.config import EngineConfig
from foudre.layers.mamba import RecurrentBatch
from foudre.models.llama import LlamaForCausalLM
from foudre.native import huge_pages
from foudre.runner.cpu_decode import NativeDecode
from foudre.runner.cuda_graphs import DecodeGraphs
from foudre.runner.input_batch import InputBatch, SamplingRows
from foudre.runner.step import (
    DecodePath,
    ForwardStep,
    ScheduledRow,
    SchedulerOutput,
    StepOutput,
    Tables,
)
from foudre.sample.rejection import verify
from foudre.sample.sampler import sample

_CPU_DEFAULT_KV_BYTES = 2 << 30


def kv_bytes_per_token(
    spec: AttentionSpec, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes one token takes in a layer of ``spec`` (scales included when quantized).
    ``ValueError`` for a quantized latent cache (only full attention's K/V are quantized)."""
    if kv_cache_dtype == "auto":
        return spec.bytes_per_token(dtype)
    if not isinstance(spec, FullAttentionSpec):
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} quantizes full-attention K/V only; this model "
            f"caches {type(spec).__name__} (multi-head latent attention): use kv_cache_dtype "
            "'auto'"
        )
    return 2 * spec.num_kv_heads * kv_bytes_per_token_head(spec.head_dim, kv_cache_dtype, dtype)


def kv_bytes_per_block(
    model: LlamaForCausalLM, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    """Bytes of one KV block across all of ``model``'s attention layers (the sum of their
    specs; 0 for a model of recurrent layers only)."""
    specs = attention_specs(model.kv_cache_specs())
    return block_size * sum(kv_bytes_per_token(s, dtype, kv_cache_dtype) for s in specs)


def attention_specs(specs: Sequence[CacheSpec]) -> list[AttentionSpec]:
    return [s for s in specs if not isinstance(s, RecurrentStateSpec)]


def describe_kv_cache(
    model: LlamaForCausalLM, dtype: torch.dtype, kv_cache_dtype: str, num_blocks: int
) -> str:
    """One line for the startup log: the pool's blocks and bytes per token over all layers;
    for a latent cache, what plain K/V of every head would take instead."""
    specs = attention_specs(model.kv_cache_specs())
    per_token = sum(kv_bytes_per_token(s, dtype, kv_cache_dtype) for s in specs)
    line = f"KV cache: {num_blocks} blocks, {per_token} bytes per token over {len(specs)} layers"
    latent = [s for s in specs if isinstance(s, LatentAttentionSpec)]
    if latent:
        cfg = model.config
        per_head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
        plain = len(latent) * cfg.num_attention_heads * per_head * element_size(dtype)
        own = sum(s.bytes_per_token(dtype) for s in latent)
        line += (
            f"; latent attention: {own} bytes per token where plain K/V of "
            f"{cfg.num_attention_heads} heads would take {plain} ({plain / own:.1f}x)"
        )
    return line


def _storage_bytes(caches: Sequence[Any]) -> int:
    """The bytes of the distinct storages that ``caches`` (tensors, quantized caches, recurrent
    state pools) lie in."""
    held: dict[int, int] = {}
    for cache in caches:
        if isinstance(cache, torch.Tensor):
            tensors: Sequence[torch.Tensor] = [cache]
        elif isinstance(cache, QuantizedKVCache):
            tensors = [cache.codes, cache.scales]
        else:
            tensors = list(cache)
        for t in tensors:
            storage = t.untyped_storage()
            held[storage.data_ptr()] = storage.nbytes()
    return sum(held.values())


def allocate_kv_caches(
    specs: Sequence[AttentionSpec],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> list[torch.Tensor] | list[QuantizedKVCache]:
    """One cache per layer, ``num_blocks`` blocks each, laid out by the layer's spec as the
    backends read it (``[2, blocks, block_size, heads, dim]``, or quantized K/V)."""
    if kv_cache_dtype == "auto":
        return [s.allocate(num_blocks, block_size, dtype, device) for s in specs]
    quantized = []
    for spec in specs:
        kv_bytes_per_token(spec, dtype, kv_cache_dtype)  # refuses what cannot be quantized
        assert isinstance(spec, FullAttentionSpec)
        quantized.append(
            QuantizedKVCache(
                num_blocks,
                block_size,
                spec.num_kv_heads,
                spec.head_dim,
                kv_cache_dtype,
                dtype,
                device,
            )
        )
    return quantized


def allocate_group_caches(
    specs: Sequence[CacheSpec],
    groups: Sequence[KVCacheGroup],
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
    num_state_slots: int = 0,
) -> list[Any]:
    """One cache per layer: for the attention layers, as ``allocate_kv_caches``, in cache
    ``groups`` of equal size (``size`` page tensors, layer ``j`` of every group on tensor
    ``j``: a block id holds the pages of the group that holds it; see
    ``attention/cache_spec.py``); for a recurrent layer, its ``RecurrentCache`` of
    ``num_state_slots`` slots."""
    first = groups[0].layers
    shared = allocate_kv_caches(
        [cast(AttentionSpec, specs[i]) for i in first],
        num_blocks,
        block_size,
        dtype,
        device,
        kv_cache_dtype,
    )
    caches: list[Any] = [None] * len(specs)
    for group in groups:
        assert len(group.layers) == len(first), "cache groups of unequal sizes"
        for j, layer in enumerate(group.layers):
            caches[layer] = shared[j]
    for i, spec in enumerate(specs):
        if isinstance(spec, RecurrentStateSpec):
            caches[i] = spec.allocate(num_state_slots, dtype, device)
    return caches


def device_memory(device: torch.device) -> int:
    """Total memory of ``device`` in bytes (the machine's RAM for the CPU)."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def kv_budget(config: EngineConfig, device: torch.device, share: int = 1) -> int | None:
    """The bytes the KV cache (and recurrent state) may take in one process: ``kv_cache_memory``
    (bytes, or a fraction of device memory), else a cap: 2 GiB (and a quarter of RAM) on the
    CPU, 80% of free memory on CUDA. ``share``: how many processes draw on the same memory
    (the CPU ranks of one machine), each taking that fraction. None when ``num_kv_blocks``
    is given (the blocks are then counted, not bytes)."""
    if config.num_kv_blocks is not None:
        return None
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
        if budget <= 1.0:
            budget *= device_memory(device)
        return int(budget) // share
    return default_kv_budget(device, share)


def default_kv_budget(device: torch.device, share: int = 1) -> int:
    """``kv_budget`` where no ``kv_cache_memory`` is given."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.8) // share
    return min(_CPU_DEFAULT_KV_BYTES, device_memory(device) // 4) // share


@dataclass(frozen=True, slots=True)
class StatePlan:
    """A recurrent model's state slots: one per running request, ``num_snapshots`` for the
    prefix cache (one every ``snapshot_every`` blocks of a cached prefix), and the bytes each
    slot takes over every recurrent layer."""

    num_slots: int
    num_snapshots: int
    snapshot_every: int
    bytes_per_slot: int
    # with speculative decoding, a slot per sequence where a verification leaves the state after
    # its first token (the runner's: rows whose drafts are rejected go back to it)
    num_scratch: int = 0

    @property
    def total_slots(self) -> int:
        """The engine's slots: the requests', the snapshots' and the padding rows' one."""
        return self.num_slots + self.num_snapshots + 1

    @property
    def bytes(self) -> int:
        return (self.total_slots + self.num_scratch) * self.bytes_per_slot


def state_plan(
    model: LlamaForCausalLM, config: EngineConfig, device: torch.device, share: int = 1
) -> StatePlan | None:
    """How many state slots a model with recurrent layers gets (None for a transformer): a
    slot per running request (``max_num_seqs``) and as many snapshots (``num_state_snapshots``,
    none without prefix caching), all within half of the KV budget (``kv_budget``; its default
    where ``num_kv_blocks`` counts the blocks), the other half left for the attention layers'
    blocks (all of it for a model without attention): fewer slots where the budget is short
    (the engine then runs at most that many sequences), ``ValueError`` naming
    ``kv_cache_memory`` where not even one fits."""
    dtype = next(model.parameters()).dtype
    per_slot = state_bytes_per_request(model.kv_cache_specs(), dtype)
    if per_slot == 0:
        return None
    slots = config.max_num_seqs
    snapshots = config.num_state_snapshots
    if snapshots is None:
        snapshots = slots if config.enable_prefix_caching else 0
    if not config.enable_prefix_caching:
        snapshots = 0
    per_seq = 2 if config.speculative_method is not None else 1  # (a scratch slot each)
    budget = kv_budget(config, device, share)
    if budget is None:  # blocks counted by num_kv_blocks: the states within the default
        budget = default_kv_budget(device, share)
    per_block = kv_bytes_per_block(model, config.block_size, dtype, config.kv_cache_dtype)
    budget //= 2 if per_block else 1  # (blocks of no bytes: the states take it all)
    if (per_seq * slots + snapshots + 1) * per_slot > budget:
        fit = budget // per_slot - 1
        if fit < per_seq:
            raise ValueError(
                f"kv_cache_memory: {budget} bytes cannot hold one request's recurrent state "
                f"({per_slot} bytes over the model's recurrent layers) beside its KV blocks"
            )
        share_snapshots = snapshots / (per_seq * slots + snapshots)
        snapshots = int(fit * share_snapshots)
        slots = max(1, (fit - snapshots) // per_seq)
    every = max(1, config.state_snapshot_interval // config.block_size)
    return StatePlan(slots, snapshots, every, per_slot, (per_seq - 1) * slots)


def num_kv_blocks(
    model: LlamaForCausalLM,
    config: EngineConfig,
    device: torch.device,
    max_model_len: int,
    share: int = 1,
    state_bytes: int = 0,
) -> int:
    """How many KV blocks to allocate: ``num_kv_blocks`` if given, else what ``kv_budget``
    leaves after ``state_bytes`` (the recurrent state slots), at most enough for
    ``max_num_seqs`` full-length sequences where no ``kv_cache_memory`` is given. A model of
    recurrent layers only has blocks of no bytes (they count its tokens for the prefix cache):
    enough for twice ``max_num_seqs`` full-length sequences, within 2^17 blocks."""
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    dtype = next(model.parameters()).dtype
    per_block = kv_bytes_per_block(model, config.block_size, dtype, config.kv_cache_dtype)
    wanted = config.max_num_seqs * -(-max_model_len // config.block_size)
    if per_block == 0:  # (Python objects only: at most 2^17 of them, if one sequence fits)
        return max(-(-max_model_len // config.block_size), min(2 * wanted, 1 << 17))
    budget = kv_budget(config, device, share)
    assert budget is not None
    blocks = max(1, (budget - state_bytes) // per_block)
    return blocks if config.kv_cache_memory is not None else min(wanted, blocks)


class ModelRunner:
    """The model, its KV-cache tensors and a decode path; ``execute`` runs one scheduled step."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        decode_graphs: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
        kv_groups: Sequence[KVCacheGroup] | None = None,
        num_state_slots: int = 0,
        num_scratch_state_slots: int = 0,
    ) -> None:
        """``num_blocks``: the pool's block ids; ``kv_groups``: the layers' cache groups, whose
        rows carry a block table each (None: one group of every attention layer, the windows
        applied by the backends over blocks kept whole); ``num_state_slots``: the slots of
        the recurrent layers' state pools that the engine hands out (``engine/state_slots.py``:
        the last one is the padding rows'), and past them ``num_scratch_state_slots`` of the
        runner's own (the states after a verification's first token: ``_verified_states``)."""
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        if device.type == "cpu":  # before anything holds their addresses
            huge_pages.place_in_huge_pages(model)
        cfg = model.config
        # one block past the pool, never handed out: the scratch K/V of padding rows
        self.padding_block = num_blocks
        self.cache_specs = model.kv_cache_specs()
        self.latent_cache = any(isinstance(s, LatentAttentionSpec) for s in self.cache_specs)
        self.kv_groups = list(
            kv_groups or [KVCacheGroup(None, tuple(attention_layers(self.cache_specs)))]
        )
        # recurrent layers read the step's RecurrentBatch, one "group" past the attention ones
        self.recurrent = bool(recurrent_layers(self.cache_specs))
        if self.recurrent and num_state_slots < 2:
            raise ValueError("a model with recurrent layers needs state slots")
        self.padding_state_slot = num_state_slots - 1
        self.scratch_state_slots = range(num_state_slots, num_state_slots + num_scratch_state_slots)
        self.group_of_layer = [len(self.kv_groups)] * len(self.cache_specs)
        for g, group in enumerate(self.kv_groups):
            for layer in group.layers:
                self.group_of_layer[layer] = g
        self.kv_caches: list[Any] = allocate_group_caches(
            self.cache_specs,
            self.kv_groups,
            num_blocks + 1,
            block_size,
            dtype,
            device,
            kv_cache_dtype,
            num_state_slots + num_scratch_state_slots,
        )
        self.state_caches = [c for c in self.kv_caches if isinstance(c, RecurrentCache)]
        if device.type == "cpu":
            huge_pages.warn_if_short(_storage_bytes(self.kv_caches), "the KV cache")
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.input_batch = InputBatch(cfg.vocab_size, device, max_num_seqs, len(self.kv_groups))
        # tests: check every gathered decode row against the row the scheduler sent
        self.check_slots = False
        self._decode_path_args = (max_num_seqs, max_model_len or cfg.max_position_embeddings)
        self._decode_graphs = decode_graphs
        self.decode_path: DecodePath | None = self._make_decode_path()

    def _make_decode_path(self) -> DecodePath | None:
        make = DECODE_PATHS.get(self.backend.name)
        if not self._decode_graphs or make is None:
            return None
        return make(self, *self._decode_path_args)

    def model_changed(self) -> None:
        """Call after replacing the model's weights or quantizing it in place: on the CPU its
        weights go into huge pages again (a new map: what was replaced is freed with the old
        one), and the decode path is rebuilt on the model as it is now (the one built before
        sends every step back to Python)."""
        self.decode_path = None  # (what it holds, the replaced modules too, goes first)
        if self.device.type == "cpu":
            huge_pages.place_in_huge_pages(self.model)
        self.decode_path = self._make_decode_path()

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks (K and V of every layer) from source to destination ids: the
        copy-on-write of shared blocks, before a step writes into them."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], device=self.device)
        dst = torch.tensor([d for _, d in copies], device=self.device)
        distinct = {id(c): c for c in self.kv_caches}  # cache groups share their tensors
        for cache in distinct.values():
            if isinstance(cache, RecurrentCache):
                continue
            if isinstance(cache, QuantizedKVCache):
                cache.codes[:, dst] = cache.codes[:, src]
                cache.scales[:, dst] = cache.scales[:, src]
            else:
                for pages in pages_of(cache):  # a latent cache's K and V are one memory
                    pages[dst] = pages[src]

    def copy_states(self, copies: Sequence[tuple[int | None, int]]) -> None:
        """Fill recurrent state slots before a step, in order: zeros (``None``: a fresh
        request) or a copy of another slot (a fork, a restored prefix-cache snapshot); one
        indexed op a pool where no copy reads a slot that another fills."""
        dsts = [d for _, d in copies]
        reads = {s for s, _ in copies if s is not None}
        if len(set(dsts)) < len(dsts) or reads & set(dsts):
            for one in copies:  # in order
                self._copy_states([one])
            return
        self._copy_states(copies)

    def _copy_states(self, copies: Sequence[tuple[int | None, int]]) -> None:
        def index(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        zeros = index([d for s, d in copies if s is None])
        src = index([s for s, _ in copies if s is not None])
        dst = index([d for s, d in copies if s is not None])
        for cache in self.state_caches:
            for pool in cache:
                if zeros.numel():
                    pool[zeros] = 0
                if dst.numel():
                    pool[dst] = pool[src]

    def flatten(self, step: ForwardStep) -> None:
        """Fill ``step``'s flattened tensors: token ids, positions, and the backend's metadata
        (each token's cache slot ``block_id * block_size + offset``, lengths, block tables).
        A step of continued decode rows (``step.slots``) takes its tokens and positions from
        the per-slot state by one gather; the others from the rows' lists."""
        token_rows = None  # each token's row (None: one token a row)
        if step.slots is not None:
            plain, input_ids = self._gathered(step)
            query_lens = [1] * len(step.token_ids)
            seq_lens = (plain + 1).tolist()
        else:
            plain, input_ids, query_lens, seq_lens = _listed(step.starts, step.token_ids)
            if len(query_lens) != len(plain):
                token_rows = np.repeat(np.arange(len(query_lens)), query_lens)
        rope = plain
        if step.position_offsets and any(step.position_offsets):  # (never in a gathered step)
            offsets = np.asarray(step.position_offsets, np.int64)
            rope = plain + (offsets if token_rows is None else offsets[token_rows])
        bs = self.block_size

        def layout(tables: Tables) -> BatchLayout:
            t = table_tensor(tables)
            return BatchLayout(query_lens, seq_lens, t, slot_mapping(t, plain, bs, token_rows), bs)

        # (a model of recurrent layers only has no attention to lay out)
        attention = bool(self.kv_groups[0].layers)
        step.metadata = self._metadata(layout(step.block_tables)) if attention else None
        if step.group_tables or self.recurrent:  # the other cache groups: their own tables
            groups = [step.metadata]
            groups += [self._metadata(layout(tables)) for tables in step.group_tables]
            if self.recurrent:
                groups.append(self._recurrent_batch(step, query_lens))
            step.metadata = GroupedMetadata(groups, self.group_of_layer)
        step.input_ids = torch.from_numpy(input_ids).to(self.device)
        step.positions = torch.from_numpy(rope).to(self.device)

    def _gathered(self, step: ForwardStep) -> tuple[np.ndarray, np.ndarray]:
        """Positions and token ids (int64) of a step of continued decode rows, from the
        per-slot state, then zeros for its padding rows; checked against the rows' own where
        ``check_slots`` is set (tests)."""
        assert step.slots is not None
        state = self.input_batch.tables
        index = step.slots.numpy()
        pad = len(step.token_ids) - len(index)
        positions = state.num_computed[index]
        input_ids = state.last_token[index]
        if pad:  # (padding rows: token 0 at position 0)
            positions = np.concatenate([positions, np.zeros(pad, np.int64)])
            input_ids = np.concatenate([input_ids, np.zeros(pad, np.int64)])
        if self.check_slots:
            want = [[s, ids[0]] for s, ids in zip(step.starts, step.token_ids, strict=True)]
            got = np.stack([positions, input_ids], axis=1).tolist()
            if got != want:
                raise AssertionError(f"per-slot state {got} != rows {want}")
        return positions, input_ids

    def _recurrent_batch(self, step: ForwardStep, query_lens: list[int]) -> RecurrentBatch:
        """The recurrent layers' view of the step: each row's slot and new tokens (padding
        rows on the scratch slot), and the snapshots to leave."""
        slots = list(step.state_slots)
        slots += [self.padding_state_slot] * (len(query_lens) - len(slots))
        return RecurrentBatch.of_lengths(query_lens, slots, self.device, list(step.state_snapshots))

    def _metadata(self, layout: BatchLayout) -> object:
        """The backend's metadata of ``layout`` (one cache group's)."""
        if self.latent_cache:  # the rows whose context is all new apart (attention/latent.py)
            return build_latent_metadata(self.backend, layout, self.device)
        return self.backend.build_metadata(layout, self.device)

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: object
    ) -> torch.Tensor:
        """The model's forward over this runner's caches and backend (what decode paths run)."""
        return self.model(input_ids, positions, self.kv_caches, self.backend, metadata)

    def graph_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: object
    ) -> torch.Tensor:
        """``forward_hidden`` for ``DecodeGraphs``, which runs it once eagerly to warm up, then
        captures it, then replays the capture for the same step: the warm-up run leaves the
        routers' statistics alone, so the step is counted once."""
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        with self.model.moe_counting(capturing):
            return self.forward_hidden(input_ids, positions, metadata)

    @torch.inference_mode()
    def forward(
        self,
        block_tables: Tables,
        starts: Sequence[int],
        token_ids: Sequence[list[int]],
        num_logits: Sequence[int],
        num_padding_rows: int = 0,
        position_offsets: Sequence[int] | None = None,
        group_tables: Sequence[Tables] = (),
        state_slots: Sequence[int] = (),
        state_snapshots: Sequence[tuple[int, int, int]] = (),
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Compute ``token_ids[i]`` at positions ``starts[i]...`` of sequence ``i`` (writing
        their K/V through ``block_tables[i]``); return float32 logits of the last
        ``num_logits[i]`` tokens of each sequence, in order (None when none are asked). The
        last ``num_padding_rows`` sequences pad the batch: the routers of mixture-of-experts
        layers do not count their tokens. ``position_offsets[i]`` (None: all 0) is added to
        the RoPE positions of row ``i`` (``ScheduledRow.position_offset``).
        ``group_tables[g - 1][i]``: row ``i``'s block table of cache group ``g`` (``g >= 1``;
        ``block_tables`` is group 0's). ``state_slots[i]``: row ``i``'s recurrent state slot
        (padding rows past them take the scratch slot); ``state_snapshots``: (row, offset,
        slot), the states to leave in snapshot slots. ``block_tables`` (and each of
        ``group_tables``): lists, or an int32 tensor ``[rows, width]``
        (``ForwardStep.block_tables``). ``slots``: where every row but the padding ones is a
        continued decode row, their persistent-batch slots (``ForwardStep.slots``).

        A step that the decode path can run (a replayed CUDA graph, the native CPU decoder
        layers) runs there; the rest runs the model op by op."""
        step = ForwardStep(
            block_tables,
            starts,
            token_ids,
            num_logits,
            position_offsets,
            group_tables,
            state_slots,
            state_snapshots,
            slots,
        )
        real = token_ids[: len(token_ids) - num_padding_rows]
        rows = sum(len(ids) for ids in real)
        self.model.count_moe_rows(rows)
        path = self.decode_path
        if path is not None and path.can_run(step):
            logits = path.run_logits(step)
            if logits is not None:
                return logits
            hidden = path.run(step)
        else:
            self.flatten(step)
            assert step.input_ids is not None and step.positions is not None
            hidden = self.forward_hidden(step.input_ids, step.positions, step.metadata)
        return self.logits_of(hidden, token_ids, num_logits)

    def logits_of(
        self, hidden: torch.Tensor, token_ids: Sequence[list[int]], num_logits: Sequence[int]
    ) -> torch.Tensor | None:
        """Float32 logits of the last ``num_logits[i]`` tokens of each row, from the final
        hidden states of the rows' tokens flattened in order (None when none are asked)."""
        if len(num_logits) == hidden.shape[0] and all(n == 1 for n in num_logits):
            return self.model.compute_logits(hidden)  # one token a row, each sampling
        rows: list[int] = []
        end = 0
        for ids, n_logits in zip(token_ids, num_logits, strict=True):
            end += len(ids)
            rows.extend(range(end - n_logits, end))
        if not rows:
            return None
        if len(rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(rows, device=self.device)]
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput) -> StepOutput:
        """Compute the scheduled tokens; return the rows that sampled and their tokens.

        First the persistent batch takes the step's deltas (requests leaving, then entering).
        ``num_padding_rows`` throw-away rows (one token each, logits included, K/V written to
        the scratch block) are added to the batch, as a rectangular batch computes the rows of
        its finished members; their results are dropped.
        """
        batch = self.input_batch
        batch.remove(scheduled.removed)
        batch.add(scheduled.new_requests)
        self.copy_blocks(scheduled.block_copies)
        if scheduled.state_copies:
            self.copy_states(scheduled.state_copies)
        rows = scheduled.rows
        pad = scheduled.num_padding_rows
        index = np.array(batch.apply_tables(rows), np.int64)
        state, padding = batch.tables, self.padding_block
        tables = state.gather(0, index, pad, padding)
        group_tables = [state.gather(g, index, pad, padding) for g in range(1, len(self.kv_groups))]
        starts = [r.start for r in rows]
        tokens = [r.token_ids for r in rows]
        num_logits = [r.num_logits for r in rows]
        offsets: list[int] | None = [r.position_offset for r in rows]
        if not any(offsets or ()):
            offsets = None
        continued = offsets is None and all(r.continued for r in rows)
        ends = None if continued else [s + len(t) for s, t in zip(starts, tokens, strict=True)]
        if pad:
            starts += [0] * pad
            tokens += [[0]] * pad
            num_logits += [1] * pad
            if offsets is not None:
                offsets += [0] * pad
        sampling = batch.sampling_rows(rows)
        slots: list[int] = []
        snapshots: list[tuple[int, int, int]] = []
        verifying: dict[str, tuple[int, int]] = {}
        if self.recurrent:
            slots = [r.state_slot for r in rows]
            snapshots = [(i, o, s) for i, r in enumerate(rows) for o, s in r.state_snapshots]
            verifying = self._verified_states(rows, snapshots)
        logits = self.forward(
            tables,
            starts,
            tokens,
            num_logits,
            pad,
            offsets,
            group_tables,
            slots,
            snapshots,
            slots=torch.from_numpy(index) if continued else None,
        )
        state.advance(index, ends)
        if logits is not None and pad:
            logits = logits[: logits.shape[0] - pad]
        if logits is None or logits.shape[0] == 0:
            return StepOutput()
        out = self.sample(logits, sampling)
        if verifying:  # a row that rejected drafts: its state after the first token
            rows_back = zip(out.request_ids, out.num_draft_tokens, out.num_accepted, strict=True)
            back = [verifying[r] for r, d, a in rows_back if a < d and r in verifying]
            if back:
                self.copy_states(back)
        return out

    def _keep_sampled(self, rows: SamplingRows, out: StepOutput) -> None:
        """Keep each verifying row's last token in its slot, and roll its count back by the
        drafts it rejected (a recurrent model's: by all its drafts, as ``Scheduler.update``)."""
        rollback = [
            d - a + (a if self.recurrent and a < d else 0)
            for d, a in zip(out.num_draft_tokens, out.num_accepted, strict=True)
        ]
        last = [t[-1] for t in out.token_ids]
        self.input_batch.tables.sampled(rows.slots, last, rollback)

    def _verified_states(
        self, rows: Sequence[ScheduledRow], snapshots: list[tuple[int, int, int]]
    ) -> dict[str, tuple[int, int]]:
        """A recurrent model's rows that verify drafts also leave their state after the row's
        first token (the last sampled one, always kept) in a scratch slot each (added to
        ``snapshots``); a row whose drafts are then rejected takes that state back, and the
        scheduler recomputes the drafts it accepted (``Scheduler.update``): (scratch, slot)
        by request."""
        verifying: dict[str, tuple[int, int]] = {}
        scratch = iter(self.scratch_state_slots)
        for i, row in enumerate(rows):
            if row.spec_token_ids:
                slot = next(scratch)  # (the engine drafts for at most max_num_seqs rows)
                snapshots.append((i, 0, slot))
                verifying[row.request_id] = (slot, row.state_slot)
        return verifying

    def sample(self, logits: torch.Tensor, rows: SamplingRows) -> StepOutput:
        """Sample (or verify drafts) from the logits of the step's sampling rows, in order;
        each row's last token (and rejected drafts) kept in its slot (``SlotTables``)."""
        if rows.has_drafts:  # each row's positions: its last token's, then its drafts'
            index = [r + j for r, d in zip(rows.logit_rows, rows.drafts) for j in range(len(d) + 1)]
            if len(index) != logits.shape[0]:  # forked samplers share their parent's row
                logits = logits[torch.tensor(index, device=logits.device)]
            batch = self.input_batch.sampling_batch(rows)
            v = verify(logits, batch, self.input_batch.draft_rows(rows), self.generator)
            self.input_batch.accept_drafts(rows, v.num_accepted)
            verified = StepOutput(
                rows.request_ids, v.token_ids, v.logprobs, v.num_draft_tokens, v.num_accepted
            )
            self._keep_sampled(rows, verified)
            return verified
        if len(rows.logit_rows) != logits.shape[0]:  # forked samplers share their parent's row
            logits = logits[torch.tensor(rows.logit_rows, device=logits.device)]
        out = sample(logits, self.input_batch.sampling_batch(rows), self.generator)
        self.input_batch.tables.sampled(rows.slots, out.token_ids)
        lps = [None if lp is None else [lp] for lp in out.logprobs]
        zeros = [0] * len(rows.slots)
        return StepOutput(rows.request_ids, [[t] for t in out.token_ids], lps, zeros, zeros)


def _listed(
    starts: Sequence[int], token_ids: Sequence[list[int]]
) -> tuple[np.ndarray, np.ndarray, list[int], list[int]]:
    """Rows given by lists: their tokens' positions and ids (int64, flattened in order), and
    per row its new tokens and its context length after them."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    for start, ids in zip(starts, token_ids, strict=True):
        n = len(ids)
        input_ids += ids
        if n == 1:
            positions.append(start)
        else:
            positions += range(start, start + n)
        query_lens.append(n)
        seq_lens.append(start + n)
    return np.array(positions, np.int64), np.array(input_ids, np.int64), query_lens, seq_lens


def _graphs(runner: ModelRunner, max_num_seqs: int, max_model_len: int) -> DecodePath | None:
    if runner.device.type != "cuda" or runner.recurrent or len(runner.kv_groups) > 1:
        return None  # (the graphs hold one block table a row, and no state slots)
    cfg = runner.model.config
    tiles = None
    if isinstance(runner.backend, PagedBackend):  # verification and mixed steps in graphs too
        kv_heads = attention_specs(runner.cache_specs)[0].num_kv_heads_seen  # 1: latent
        tiles = runner.backend.tile_positions(cfg.num_attention_heads, kv_heads)
    return DecodeGraphs(
        runner.graph_forward,
        runner.device,
        runner.block_size,
        runner.padding_block,
        max_num_seqs,
        max_model_len,
        tile_positions=tiles,
    )


def _native(runner: ModelRunner, max_num_seqs: int, max_model_len: int) -> DecodePath | None:
    if runner.device.type != "cpu":
        return None
    return NativeDecode.build(
        runner.model,
        runner.backend,
        runner.kv_caches,
        runner.block_size,
        runner.padding_state_slot if runner.recurrent else -1,
        runner.group_of_layer,
    )


# the decode path each attention backend offers: the decode kernels they are built around
DECODE_PATHS: dict[str, Callable[[ModelRunner, int, int], DecodePath | None]] = {
    "triton": _graphs,
    "cpu": _native,
}
