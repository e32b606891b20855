"""Typed errors of parallel execution: a configuration that cannot be sharded, a worker lost."""

from __future__ import annotations

from foudre.errors import InvalidParameterError


class ParallelConfigError(InvalidParameterError):
    """``tensor_parallel_size`` or ``pipeline_parallel_size`` cannot split this model on this
    machine (``param`` names the field); raised before any worker starts."""


class WorkerFailedError(RuntimeError):
    """A worker process died, hung past the collective timeout, or failed a step: the parallel
    engine cannot step any more (its requests fail, ``LLMEngine.healthy`` turns False)."""
