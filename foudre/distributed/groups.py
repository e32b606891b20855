"""Process groups of a parallel engine.

- the default group (every rank; NCCL on CUDA, gloo on the CPU): start-up (loading status,
  the KV pool's size), with a timeout that covers loading;
- the pipeline group (every rank, same backend) for the hidden states sent between stages, and
  one tensor-parallel group per stage for the sharded layers' all-reduces and all-gathers: both
  with the step timeout, so that a rank that dies or hangs mid-step fails the step;
- the control group (gloo, every rank): each step's inputs, broadcast from rank 0
  (``runner.send_step``). Workers wait on it between steps, for as long as the engine idles,
  so its timeout is long (a dead engine breaks its connections instead); rank 0 waits on each
  broadcast at most the step timeout, so a hung worker fails the step.

Ranks meet through a ``TCPStore``: rank 0 opens it on a free port that the system picks (no
fixed port, no race between picking and binding) when it spawns its workers, or at
``MASTER_ADDR:MASTER_PORT`` under ``torchrun``.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from foudre.distributed.errors import ParallelConfigError
from foudre.distributed.plan import ParallelPlan
from foudre.layers.parallel import TensorParallel

# how long the ranks may take to start, join and load their shards
STARTUP_TIMEOUT = datetime.timedelta(minutes=10)
# how long a worker may wait for the next step while the engine has nothing to do
IDLE_TIMEOUT = datetime.timedelta(days=365)


@dataclass(slots=True)
class Groups:
    """This rank's process groups (``tp`` None without tensor parallelism)."""

    plan: ParallelPlan
    device: torch.device
    control: Any  # gloo ProcessGroup over every rank: the steps' inputs
    pipe: Any  # every rank, the step timeout: hidden states between stages (None: one stage)
    tp: TensorParallel | None


def torchrun_env() -> tuple[int, int] | None:
    """``(rank, world_size)`` when this process was started by ``torchrun`` (or any launcher
    that sets ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``) for more than one
    rank; else None."""
    keys = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not all(k in os.environ for k in keys):
        return None
    world = int(os.environ["WORLD_SIZE"])
    return (int(os.environ["RANK"]), world) if world > 1 else None


def open_store(world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Rank 0's store on 127.0.0.1 and a port the system chose (``store.port``)."""
    return dist.TCPStore("127.0.0.1", 0, world_size, True, timeout=timeout, wait_for_workers=False)


def join_store(port: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, world_size, False, timeout=timeout)


def device_for(device: torch.device, plan: ParallelPlan) -> torch.device:
    """This rank's device: its own GPU on CUDA (``LOCAL_RANK`` under torchrun, else the global
    rank), the CPU otherwise."""
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", plan.rank))
    return torch.device("cuda", local)


def check_devices(device: torch.device, world_size: int) -> None:
    """``ParallelConfigError`` when one machine's ranks would outnumber its GPUs."""
    if device.type == "cuda" and world_size > torch.cuda.device_count():
        raise ParallelConfigError(
            "tensor_parallel_size",
            f"{world_size} ranks need {world_size} CUDA devices; "
            f"{torch.cuda.device_count()} are visible",
        )


def init_groups(
    plan: ParallelPlan,
    device: torch.device,
    timeout: datetime.timedelta,
    store: dist.Store | None,
) -> Groups:
    """Join the default group (through ``store``, or ``env://`` when None; its timeout,
    ``STARTUP_TIMEOUT``, covers the workers' start and loading), then make every group, in the
    same order on every rank (``new_group`` is collective); the step's groups time out after
    ``timeout``."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if store is not None:
        dist.init_process_group(
            backend,
            store=store,
            rank=plan.rank,
            world_size=plan.world_size,
            timeout=STARTUP_TIMEOUT,
        )
    else:
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=plan.rank,
            world_size=plan.world_size,
            timeout=STARTUP_TIMEOUT,
        )
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    pipe = dist.new_group(timeout=timeout) if plan.pipeline_parallel_size > 1 else None
    tp = None
    for stage in range(plan.pipeline_parallel_size):
        ranks = plan.tp_ranks(stage)
        group = dist.new_group(ranks=ranks, timeout=timeout) if len(ranks) > 1 else None
        if plan.rank in ranks and group is not None:
            tp = TensorParallel(plan.tp_rank, plan.tensor_parallel_size, group)
    return Groups(plan, device, control, pipe, tp)


def destroy_groups() -> None:
    """Leave every group (the process may start another parallel engine after)."""
    if dist.is_initialized():
        dist.destroy_process_group()
