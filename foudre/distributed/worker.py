"""A rank's start and, on every rank but 0, the worker loop.

Every rank, the engine's included, starts the same way (``build_rank``): join the groups, load
its shard, agree on the KV pool's size (the smallest any rank can hold), build its
``ShardRunner``. Workers then wait for each step's ``StepMessage`` on the control group and run
it; a None message ends them. A worker that cannot run a step exits with a non-zero status at
once: its peers' collectives then fail instead of waiting.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from foudre.config import EngineConfig
from foudre.distributed.errors import ParallelConfigError, WorkerFailedError
from foudre.distributed.groups import (
    STARTUP_TIMEOUT,
    Groups,
    destroy_groups,
    device_for,
    init_groups,
    join_store,
    torchrun_env,
)
from foudre.distributed.plan import ParallelPlan
from foudre.distributed.runner import ShardRunner, receive_step
from foudre.distributed.shard import load_shard
from foudre.loading.loader import LoadedModel
from foudre.native import huge_pages
from foudre.runner.host_memory import freeze_startup_objects, keep_freed_host_memory
from foudre.runner.model_runner import num_kv_blocks

logger = logging.getLogger("foudre")


def build_rank(
    plan: ParallelPlan, config: EngineConfig, device: torch.device, store: dist.Store | None
) -> tuple[Groups, LoadedModel, ShardRunner]:
    """Join the groups, load this rank's shard and build its runner. Every rank learns whether
    all loaded: a rank's own failure is raised as is, another's as ``WorkerFailedError``."""
    timeout = datetime.timedelta(seconds=config.distributed_timeout_s)
    groups = init_groups(plan, device, timeout, store)
    own: Exception | None = None
    loaded = None
    try:
        loaded = load_shard(config, device, plan, groups.tp)
    except Exception as e:
        own = e
    errors: list[str | None] = [None] * plan.world_size
    mine = None if own is None else f"rank {plan.rank}: {type(own).__name__}: {own}"
    dist.all_gather_object(errors, mine)
    failed = [e for e in errors if e is not None]
    if failed:
        destroy_groups()
        if own is not None:
            raise own
        raise WorkerFailedError(f"a worker failed to load its shard: {failed[0]}")
    assert loaded is not None
    model = loaded.model
    max_len = config.max_model_len or loaded.config.max_position_embeddings
    # the CPU ranks of one machine share its memory (spawned: all of them; torchrun: its
    # processes per node); a GPU is each rank's own
    local = int(os.environ.get("LOCAL_WORLD_SIZE", plan.world_size))
    share = local if device.type == "cpu" else 1
    blocks = torch.tensor([num_kv_blocks(model, config, device, max_len, share)], device=device)
    dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
    dtype = next(model.parameters()).dtype
    runner = ShardRunner(groups, model, config, int(blocks.item()), dtype)
    return groups, loaded, runner


def serve_steps(groups: Groups, runner: ShardRunner) -> None:
    """Run the engine's steps until it says stop (a None message)."""
    while True:
        message = receive_step(groups.control)
        if message is None:
            return
        if not message.is_heartbeat:
            runner.run(message)
            huge_pages.promote_later()


def run_worker(
    plan: ParallelPlan, config: EngineConfig, device: torch.device, store: dist.Store | None
) -> None:
    """A worker's whole life: start, serve steps, then end the process: with status 0 when the
    engine stops it, 1 on any failure, logged (a worker that stays after failing would only
    hang its peers)."""
    freeze_startup_objects()  # (every step waits for every rank: none may stall on a collection)
    try:
        groups, _, runner = build_rank(plan, config, device, store)
        serve_steps(groups, runner)
    except BaseException:
        logger.exception("foudre worker rank %d failed", plan.rank)
        sys.stderr.flush()
        os._exit(1)
    # told to stop: leave at once (the engine leaves the groups; tearing torch down is slow)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def worker_main(rank: int, port: int, config: EngineConfig, device_type: str, parent: int) -> None:
    """The entry point of a worker process that the engine spawned on its machine."""
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(levelname)s %(message)s")
    _exit_with_parent(parent)
    plan = ParallelPlan(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    device = device_for(torch.device(device_type), plan)
    if device.type == "cpu":
        keep_freed_host_memory()
        torch.set_num_threads(min(torch.get_num_threads(), cpu_share(plan.world_size)))
    store = join_store(port, plan.world_size, STARTUP_TIMEOUT)
    store.set(f"joined/{rank}", "1")
    run_worker(plan, config, device, store)


def run_worker_from_env(config: EngineConfig) -> None:
    """A worker started by ``torchrun`` (rank > 0; rank 0 runs the engine): check that the
    launcher's world is ``T x P``, then serve steps until the engine stops."""
    env = torchrun_env()
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    if env is None or env[1] != world:
        found = "no torchrun environment" if env is None else f"WORLD_SIZE={env[1]}"
        raise ParallelConfigError(
            "tensor_parallel_size",
            f"tensor_parallel_size x pipeline_parallel_size = {world} ranks, but {found}",
        )
    rank = env[0]
    if rank == 0:
        raise ParallelConfigError("tensor_parallel_size", "rank 0 runs the engine, not a worker")
    plan = ParallelPlan(rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    wanted = config.device
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = device_for(torch.device(auto if wanted == "auto" else wanted), plan)
    if device.type == "cpu":
        keep_freed_host_memory()
    run_worker(plan, config, device, None)


def cpu_share(world_size: int) -> int:
    """Threads for one of ``world_size`` ranks on this machine's CPU: the cores shared between
    them, rather than each rank taking them all (and all of them waiting on each other)."""
    return max(1, (os.cpu_count() or 1) // world_size)


def _exit_with_parent(parent: int) -> None:
    """End this process when the engine's process is gone (killed without a chance to stop
    its workers): a daemon thread watches the parent's pid."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="foudre-parent-watch").start()
