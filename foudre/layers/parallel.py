"""Tensor parallelism as the layers see it: which rank of how many, and the two collectives a
sharded model needs (Megatron's layout).

A model sharded ``size`` ways holds, on each rank, a slice of every weight matrix:

- column-parallel (q|k|v, gate|up, the shared expert's gate|up): a slice of the output
  features, so each rank computes its own attention heads and its slice of the MLP, with no
  communication;
- row-parallel (``o_proj``, ``down_proj``): the matching slice of the input features, so each
  rank's output is a partial sum; ``all_reduce`` adds them (one per attention, one per MLP);
- vocabulary-parallel (embedding, ``lm_head``): a slice of the vocabulary; a token's embedding
  comes from the one rank that holds its row (the others give zeros, ``all_reduce`` adds), and
  the logits of every slice are concatenated (``all_gather``).

This module knows nothing of processes or launch (``foudre/distributed`` sets groups up); a
model without a ``TensorParallel`` runs alone, untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's ``rank`` among ``size`` tensor-parallel ranks, and their process
    ``group`` (NCCL on CUDA, gloo on the CPU)."""

    rank: int
    size: int
    group: Any  # torch.distributed.ProcessGroup

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks, in place (every rank gets it)."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` concatenated along the last dimension, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


def vocab_shard(vocab_size: int, size: int) -> int:
    """Rows of the embedding and ``lm_head`` per rank: the vocabulary split ``size`` ways,
    rounded up (the last rank's spare rows are zeros, and their logits are cut off)."""
    return -(-vocab_size // size)


def parallel_embedding(
    input_ids: torch.Tensor, weight: torch.Tensor, tp: TensorParallel
) -> torch.Tensor:
    """The embeddings of ``input_ids`` from a vocabulary-parallel table: ``weight`` holds rows
    ``rank * n .. (rank + 1) * n`` of the vocabulary; ids elsewhere look up zeros, and the
    ranks' results are summed."""
    n = weight.shape[0]
    local = input_ids - tp.rank * n
    mine = (local >= 0) & (local < n)
    x = torch.nn.functional.embedding(torch.where(mine, local, 0), weight)
    x = x * mine.unsqueeze(-1).to(x.dtype)
    return tp.all_reduce(x)
