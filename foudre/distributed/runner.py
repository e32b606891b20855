"""One rank's runner: its shard, its share of the paged KV cache, its part of each step.

Every rank runs the same step from the same ``StepMessage`` (the scheduler's rows without their
samplers: block tables' changes, positions, tokens, how many logits, the copy-on-write copies),
so every rank holds its KV heads and its layers under the same block tables: rank 0 in its
persistent batch (``ModelRunner.execute``), each worker by request id (``ShardRunner.run``),
both updated by the rows' changes. The step's rows are cut
into micro-batches (when it has tokens enough: ``ParallelExecutor.num_micro_batches``),
consecutive rows of about equal tokens, one per stage, so that stage ``s`` computes
micro-batch ``m`` while stage ``s + 1`` computes ``m - 1``::

    stage 0      [mb0][mb1][mb2]
    stage 1           [mb0][mb1][mb2]          hidden states [tokens, hidden] sent rank to
    stage 2 (last)         [mb0][mb1][mb2]     rank (tensor rank t to tensor rank t)

Micro-batches keep the rows' order, and within a stage each runs through all the stage's
layers before the next, so a row that reads blocks another row of the same step writes (two
identical prompts admitted together) finds them written, as in one forward. The last stage
(the engine's) computes the logits; rank 0 samples them (``ModelRunner.execute``), with the
engine's generators, so seeded sampling draws what one device draws.
"""

from __future__ import annotations

import datetime
import itertools
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from foudre.attention import get_backend
from foudre.config import EngineConfig
from foudre.distributed.errors import WorkerFailedError
from foudre.distributed.groups import Groups
from foudre.models.llama import LlamaForCausalLM
from foudre.runner.model_runner import ModelRunner
from foudre.runner.step import ForwardStep, SchedulerOutput, Tables


@dataclass(slots=True)
class StepMessage:
    """What crosses from the engine to every worker at each step: ``ModelRunner.forward``'s
    arguments (padding rows included) and the block copies to make before it. The rows' block
    tables come as their changes (``table_starts``, ``block_tables``: the ids from there on;
    a padding row's table is whole), which each worker applies to the tables it keeps by
    request (``request_ids``, then the padding rows'), forgetting those of ``removed``."""

    block_tables: list[list[int]]
    starts: list[int]
    token_ids: list[list[int]]
    num_logits: list[int]
    num_padding_rows: int = 0
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    num_micro_batches: int = 1  # the engine's choice (ParallelExecutor.num_micro_batches)
    position_offsets: list[int] | None = None  # per row, added to its RoPE positions
    request_ids: list[str] = field(default_factory=list)  # the real rows'
    table_starts: list[int] = field(default_factory=list)  # per real row
    removed: list[str] = field(default_factory=list)  # requests that left the batch

    @classmethod
    def heartbeat(cls) -> StepMessage:
        """A step with no rows: sent while the engine idles, so that a lost or hung worker is
        noticed without a request (``ParallelExecutor.heartbeat``); workers skip it."""
        return cls([], [], [], [])

    @property
    def is_heartbeat(self) -> bool:
        return not self.token_ids

    @classmethod
    def of(cls, scheduled: SchedulerOutput, padding_block: int) -> StepMessage:
        """The message of a step, as ``ModelRunner.execute`` lays its forward out."""
        rows, pad = scheduled.rows, scheduled.num_padding_rows
        offsets = None
        if any(r.position_offset for r in rows):
            offsets = [r.position_offset for r in rows] + [0] * pad
        return cls(
            [r.block_ids for r in rows] + [[padding_block]] * pad,
            [r.start for r in rows] + [0] * pad,
            [r.token_ids for r in rows] + [[0]] * pad,
            [r.num_logits for r in rows] + [1] * pad,
            pad,
            list(scheduled.block_copies),
            position_offsets=offsets,
            request_ids=[r.request_id for r in rows],
            table_starts=[r.table_start for r in rows],
            removed=list(scheduled.removed),
        )

    def tables(self, held: dict[str, list[int]]) -> list[list[int]]:
        """The step's whole block tables: each row's change applied to its request's table in
        ``held`` (updated; those of ``removed`` dropped first), then the padding rows'."""
        for rid in self.removed:
            held.pop(rid, None)
        real = len(self.request_ids)
        rows = zip(self.request_ids, self.table_starts, self.block_tables[:real], strict=True)
        out: list[list[int]] = []
        for rid, start, ids in rows:
            table = held.setdefault(rid, [])
            if ids:
                if start > len(table):
                    raise ValueError(f"table_start {start} past the {len(table)} blocks of {rid!r}")
                table[start:] = ids
            out.append(table)
        return out + self.block_tables[real:]


def send_step(message: StepMessage | None, control: Any, timeout: datetime.timedelta) -> None:
    """Rank 0: ``message`` (None: stop) to every rank over the control group, as its pickled
    size then its bytes. Each broadcast waits at most ``timeout``: gloo's sender waits for every
    receiver, so a hung worker (stopped, deadlocked) makes this raise instead of blocking the
    engine for good."""
    payload = pickle.dumps(message)
    size = torch.tensor([len(payload)], dtype=torch.int64)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    for tensor in (size, data):
        work = dist.broadcast(tensor, 0, group=control, async_op=True)
        assert work is not None
        work.wait(timeout)


def receive_step(control: Any) -> StepMessage | None:
    """A worker: the next ``send_step`` message, waited for as long as the engine idles."""
    size = torch.empty(1, dtype=torch.int64)
    dist.broadcast(size, 0, group=control)
    data = torch.empty(int(size.item()), dtype=torch.uint8)
    dist.broadcast(data, 0, group=control)
    message = pickle.loads(data.numpy().tobytes())
    assert message is None or isinstance(message, StepMessage)
    return message


def micro_batches(sizes: Sequence[int], count: int) -> list[tuple[int, int]]:
    """``[start, end)`` row ranges cutting rows of ``sizes`` tokens into at most ``count``
    consecutive, non-empty groups of about equal tokens."""
    count = min(count, len(sizes))
    if count <= 1:
        return [(0, len(sizes))]
    total = sum(sizes)
    cuts = [0]
    seen = 0
    for i, n in enumerate(sizes[:-1]):
        seen += n
        groups_left = count - len(cuts)  # groups still to open after this row
        rows_left = len(sizes) - i - 1
        if groups_left and (seen * count >= total * len(cuts) or rows_left == groups_left):
            cuts.append(i + 1)
    cuts.append(len(sizes))
    return list(itertools.pairwise(cuts))


class ShardRunner(ModelRunner):
    """A ``ModelRunner`` over one rank's shard: ``forward`` runs this rank's stage over each
    micro-batch (receiving and sending hidden states between stages) and returns the logits on
    the last stage (None elsewhere). The fast decode paths (CUDA graphs, the native CPU layers)
    are off: they run a whole model on one device."""

    def __init__(
        self,
        groups: Groups,
        model: LlamaForCausalLM,
        config: EngineConfig,
        num_blocks: int,
        dtype: torch.dtype,
    ) -> None:
        device = groups.device
        super().__init__(
            model,
            get_backend(config.attention_backend, device, config.kv_cache_dtype),
            num_blocks,
            config.block_size,
            device,
            dtype,
            config.seed,
            config.kv_cache_dtype,
            decode_graphs=False,
        )
        self.groups = groups
        self.dtype = dtype
        # how many micro-batches the next forward cuts its rows into (each step's message says)
        self.step_micro_batches = 1
        self.held_tables: dict[str, list[int]] = {}  # a worker's: each request's block table
        plan = groups.plan
        self.prev_rank = plan.rank_of(plan.stage - 1, plan.tp_rank) if plan.stage else None
        self.next_rank = None if plan.is_last_stage else plan.rank_of(plan.stage + 1, plan.tp_rank)

    def run(self, message: StepMessage) -> torch.Tensor | None:
        """One step on this rank: the block copies, then the forward (a worker's whole step)."""
        self.step_micro_batches = message.num_micro_batches
        self.copy_blocks(message.block_copies)
        return self.forward(
            message.tables(self.held_tables),
            message.starts,
            message.token_ids,
            message.num_logits,
            message.num_padding_rows,
            message.position_offsets,
        )

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
        """``ModelRunner.forward`` across the ranks; any failure (a peer lost, a timeout) is a
        ``WorkerFailedError``: the ranks can no longer agree on where they are. The ranks keep
        one cache group (``group_tables`` stays empty) and no recurrent state; every row is
        laid out from its lists (``slots`` is not used: micro-batches cut the rows)."""
        assert not group_tables, "parallel ranks keep one KV cache group"
        assert not state_slots, "parallel ranks hold no recurrent state"
        try:
            return self._forward(
                block_tables, starts, token_ids, num_logits, num_padding_rows, position_offsets
            )
        except Exception as e:
            raise WorkerFailedError(
                f"rank {self.groups.plan.rank}: parallel step failed: {type(e).__name__}: {e}"
            ) from e

    def _forward(
        self,
        block_tables: Tables,
        starts: Sequence[int],
        token_ids: Sequence[list[int]],
        num_logits: Sequence[int],
        num_padding_rows: int,
        position_offsets: Sequence[int] | None = None,
    ) -> torch.Tensor | None:
        model = self.model
        sizes = [len(ids) for ids in token_ids]
        real = len(sizes) - num_padding_rows
        logits: list[torch.Tensor] = []
        sends = []
        for lo, hi in micro_batches(sizes, self.step_micro_batches):
            step = ForwardStep(
                block_tables[lo:hi],
                starts[lo:hi],
                token_ids[lo:hi],
                num_logits[lo:hi],
                None if position_offsets is None else position_offsets[lo:hi],
            )
            self.flatten(step)
            assert step.input_ids is not None and step.positions is not None
            model.count_moe_rows(sum(sizes[lo : max(lo, min(hi, real))]))
            if self.prev_rank is None:
                x = model.embed(step.input_ids)
            else:
                x = torch.empty(
                    sum(sizes[lo:hi]),
                    model.config.hidden_size,
                    dtype=self.dtype,
                    device=self.device,
                )
                dist.recv(x, self.prev_rank, group=self.groups.pipe)
            # plain or quantized caches, as ModelRunner.forward_hidden passes them
            caches = cast(list[torch.Tensor], self.kv_caches)
            x = model.forward_layers(x, step.positions, caches, self.backend, step.metadata)
            if self.next_rank is not None:
                sends.append(dist.isend(x, self.next_rank, group=self.groups.pipe))
                continue
            part = self.logits_of(model.model.norm(x), token_ids[lo:hi], num_logits[lo:hi])
            if part is not None:
                logits.append(part)
        for work in sends:
            if work is not None:
                work.wait()
        if not logits:
            return None
        return logits[0] if len(logits) == 1 else torch.cat(logits)
