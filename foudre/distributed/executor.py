"""The engine's side of a parallel engine: start the ranks, run each step on all of them, notice
when one is lost.

``LLMEngine`` calls ``ParallelExecutor.execute(scheduler_output)`` where a one-device engine
calls ``ModelRunner.execute``: one scheduler and one KV-cache manager, in the engine's process
(global rank 0, tensor rank 0 of the last pipeline stage). Each step crosses the ranks as::

    rank 0   broadcast StepMessage (control group, gloo: send_step) ──▶ every worker
    all      copy-on-write block copies, then the forward of its shard, micro-batch by
             micro-batch: all-reduce after o_proj and after the MLP (tensor group),
             hidden states to the next stage (pipeline group), logits all-gathered over the
             last stage's vocabulary slices
    rank 0   samples (its generators: seeded requests draw as on one device)

Faults are loud, never a hang: a worker that exits (its process sentinel, watched by a thread)
marks the executor failed at once, even while the engine idles; a step whose broadcast or
collectives fail (a peer's connection closed) or time out (``distributed_timeout_s``, a hung
peer) raises ``WorkerFailedError``. Either way ``healthy`` turns False and every later
``execute`` raises; the engine fails the requests in flight.
"""

from __future__ import annotations

import datetime
import logging
import multiprocessing.connection
import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from foudre.config import EngineConfig
from foudre.distributed.errors import ParallelConfigError, WorkerFailedError
from foudre.distributed.groups import (
    STARTUP_TIMEOUT,
    check_devices,
    destroy_groups,
    device_for,
    open_store,
    torchrun_env,
)
from foudre.distributed.plan import ParallelPlan
from foudre.distributed.runner import ShardRunner, StepMessage, send_step
from foudre.distributed.shard import read_config
from foudre.distributed.worker import build_rank, cpu_share, worker_main
from foudre.loading.loader import LoadedModel
from foudre.models.llama import LlamaForCausalLM
from foudre.runner.step import SchedulerOutput, StepOutput

logger = logging.getLogger("foudre")

_JOIN_TIMEOUT_S = 10.0  # how long a stopping worker may take to leave before it is killed
# a pipeline cuts a step into micro-batches of at least this many tokens (prefill chunks, large
# batches); a step of fewer runs whole, stage after stage
MICRO_BATCH_TOKENS = 256


class Executor(Protocol):
    """What the engine steps through: ``ModelRunner`` on one device (called directly, nothing
    added), ``ParallelExecutor`` across ranks. ``execute`` makes the step's block copies, runs
    the forward and samples; ``model`` is this process's model (its shard)."""

    model: LlamaForCausalLM

    def execute(self, scheduled: SchedulerOutput) -> StepOutput: ...


@dataclass(slots=True)
class _Workers:
    """The spawned worker processes (none under torchrun), the control group and the step
    timeout to reach them, whether they were told to stop, and what failed (None: nothing)."""

    processes: list[BaseProcess] = field(default_factory=list)
    control: Any = None
    timeout: datetime.timedelta = datetime.timedelta(seconds=25)  # distributed_timeout_s
    stopping: bool = False
    failure: str | None = None
    threads: int | None = None  # this process's torch threads before it became a CPU rank

    def fail(self, message: str) -> None:
        """Record the first failure (for good) and log it."""
        if self.failure is None:
            self.failure = message
            logger.error("parallel engine failed: %s", message)


class ParallelExecutor:
    """Runs each step on every rank; see the module's docstring. ``model`` is rank 0's shard."""

    def __init__(self, runner: ShardRunner, workers: _Workers, store: Any) -> None:
        self.runner = runner
        self.model: LlamaForCausalLM = runner.model
        self.num_blocks = runner.padding_block  # the pool's size, agreed by every rank
        self._workers = workers
        self._store = store  # rank 0 serves the ranks' store: kept alive with the engine
        # the fewest tokens worth a micro-batch of their own (see num_micro_batches)
        self.micro_batch_tokens = MICRO_BATCH_TOKENS
        if workers.processes:  # the thread holds the workers, not the executor: dropping an
            # engine without shutdown() still runs the finalizer below
            watcher = threading.Thread(
                target=_watch, args=(workers,), daemon=True, name="foudre-workers"
            )
            watcher.start()
        weakref.finalize(self, _stop, workers)  # an engine dropped without shutdown()

    @property
    def healthy(self) -> bool:
        """False once a worker is lost or a step failed across ranks (for good)."""
        return self._workers.failure is None

    @property
    def failure(self) -> str | None:
        """What went wrong, once something did."""
        return self._workers.failure

    def execute(self, scheduled: SchedulerOutput) -> StepOutput:
        """``ModelRunner.execute`` over every rank; ``WorkerFailedError`` when a rank is lost
        (then and at every later call)."""
        workers = self._workers
        if workers.failure is not None:
            raise WorkerFailedError(workers.failure)
        message = StepMessage.of(scheduled, self.runner.padding_block)
        message.num_micro_batches = self.num_micro_batches(message)
        self.runner.step_micro_batches = message.num_micro_batches
        try:
            send_step(message, workers.control, workers.timeout)
            return self.runner.execute(scheduled)
        except WorkerFailedError as e:
            self._fail(str(e))
            raise
        except RuntimeError as e:  # the broadcast: a worker's connection is gone, or it hangs
            self._fail(f"broadcasting the step failed: {type(e).__name__}: {e}")
            raise WorkerFailedError(workers.failure) from e

    def heartbeat(self) -> None:
        """Send a step with no rows to every worker (the engine calls it while idle): a worker
        that died or hangs fails it within the step timeout, so the engine turns unhealthy
        without a request to find out (under torchrun, where no process sentinel watches the
        other nodes, this is the only way)."""
        workers = self._workers
        if workers.failure is not None:
            return
        try:
            send_step(StepMessage.heartbeat(), workers.control, workers.timeout)
        except RuntimeError as e:
            self._fail(f"a worker did not answer while the engine idled: {type(e).__name__}: {e}")

    def num_micro_batches(self, message: StepMessage) -> int:
        """How many micro-batches a step is cut into: one per stage when each gets at least
        ``micro_batch_tokens`` tokens, else as many as do (at least one). A micro-batch too
        small to keep the device busy costs a stage a whole read of its weights, so cutting a
        decode step of a few rows would make it slower (``2P - 1`` reads of a stage's weights
        instead of ``P``); cutting pays where a step's time grows with its tokens."""
        p = self.runner.groups.plan.pipeline_parallel_size
        tokens = sum(len(ids) for ids in message.token_ids)
        return max(1, min(p, len(message.token_ids), tokens // self.micro_batch_tokens))

    def _fail(self, message: str) -> None:
        self._workers.fail(message)

    def shutdown(self) -> None:
        """Stop the workers (told to, then killed after a grace period) and leave the groups.
        Idempotent."""
        _stop(self._workers)


def _watch(workers: _Workers) -> None:
    """Wait on the workers' sentinels; a worker that ends before the engine stops them is a
    failure, seen at once (``healthy``), not at the next step."""
    alive = {p.sentinel: p for p in workers.processes}
    while alive:
        for sentinel in multiprocessing.connection.wait(list(alive)):
            proc = alive.pop(cast(int, sentinel))
            proc.join(1.0)  # reaped, so that its exit status is known
            if not workers.stopping:
                workers.fail(f"worker {proc.name} exited with status {proc.exitcode}")


def _stop(workers: _Workers) -> None:
    if workers.stopping:
        return
    workers.stopping = True
    if workers.failure is None and workers.control is not None:
        try:
            send_step(None, workers.control, workers.timeout)
        except RuntimeError:
            logger.warning("could not tell the workers to stop; ending them")
    # a failed engine's workers are not waited for: a hung one would only delay the exit
    deadline = time.monotonic() + (_JOIN_TIMEOUT_S if workers.failure is None else 0.0)
    for proc in workers.processes:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
            proc.join(1.0)
    try:
        destroy_groups()
    except RuntimeError:
        logger.warning("leaving the process groups failed", exc_info=True)
    if workers.threads is not None:
        torch.set_num_threads(workers.threads)


def start_parallel(
    config: EngineConfig, device: torch.device
) -> tuple[LoadedModel, ParallelExecutor]:
    """Start a ``tensor_parallel_size x pipeline_parallel_size`` engine from this process
    (rank 0): its workers spawned here (CPU: gloo; CUDA: NCCL, one GPU each), or, under
    ``torchrun``, the launcher's other ranks. Returns rank 0's shard (with the whole model's
    config) and the executor. ``ParallelConfigError`` for sizes the model or the machine cannot
    take, raised before any worker starts."""
    read_config(config)
    t, p = config.tensor_parallel_size, config.pipeline_parallel_size
    world = t * p
    if dist.is_initialized():
        raise ParallelConfigError(
            "tensor_parallel_size",
            "this process already holds a parallel engine (one per process): shut it down "
            "first (LLM.shutdown())",
        )
    plan = ParallelPlan(0, t, p)
    env = torchrun_env()
    workers = _Workers()
    if env is not None:
        if env != (0, world):
            raise ParallelConfigError(
                "tensor_parallel_size",
                f"torchrun started rank {env[0]} of {env[1]}; the engine runs on rank 0 of "
                f"tensor_parallel_size x pipeline_parallel_size = {world} ranks",
            )
        store = None
        groups, loaded, runner = build_rank(plan, config, device_for(device, plan), None)
    else:
        check_devices(device, world)
        if device.type == "cpu":  # this process is one of the machine's ranks: its share
            workers.threads = torch.get_num_threads()
            torch.set_num_threads(min(workers.threads, cpu_share(world)))
        store = open_store(world, STARTUP_TIMEOUT)
        ctx = mp.get_context("spawn")
        for rank in range(1, world):
            proc: BaseProcess = ctx.Process(
                target=worker_main,
                args=(rank, store.port, config, device.type, os.getpid()),
                name=f"foudre-worker-{rank}",
                daemon=True,
            )
            proc.start()
            workers.processes.append(proc)
        try:
            _wait_joined(store, workers.processes)
            groups, loaded, runner = build_rank(plan, config, device_for(device, plan), store)
        except BaseException:
            for proc in workers.processes:
                proc.kill()
                proc.join(1.0)
            destroy_groups()  # joined before the failure: a later engine must start afresh
            if workers.threads is not None:
                torch.set_num_threads(workers.threads)
            raise
    workers.control = groups.control
    workers.timeout = datetime.timedelta(seconds=config.distributed_timeout_s)
    return loaded, ParallelExecutor(runner, workers, store)


def _wait_joined(store: Any, processes: list[BaseProcess]) -> None:
    """Wait until every spawned worker reached the store; ``WorkerFailedError`` as soon as one
    exits before (an import error, a bad environment) rather than at the start-up timeout."""
    keys = [f"joined/{rank}" for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
    while not store.check(keys):
        for proc in processes:
            if not proc.is_alive():
                raise WorkerFailedError(
                    f"worker {proc.name} exited with status {proc.exitcode} while starting "
                    "(its log says why; a script that builds a parallel LLM needs "
                    '`if __name__ == "__main__":`, the workers re-import it)'
                )
        if time.monotonic() > deadline:
            raise WorkerFailedError("the workers did not start in time")
        time.sleep(0.05)
