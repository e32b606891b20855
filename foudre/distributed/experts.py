"""Mixtures of experts under tensor parallelism: expert parallelism.

Each of the ``T`` ranks holds ``E / T`` whole experts (``experts``, a plain ``Experts`` of its
share, or the ``QuantExperts`` that quantization makes of it) and the whole router. Every rank
routes every token (the router is tiny and replicated, so the routing and the per-expert token
counts are the same everywhere), computes the (token, expert) pairs whose expert it holds, and
returns its partial sum; the decoder layer's one all-reduce after the MLP, the same as a dense
layer's row-parallel ``down_proj`` needs, adds the ranks' parts. A shared expert (Qwen2-MoE) is
split Megatron-style like a dense MLP, so its output is a partial sum too.

Why whole experts rather than a slice of every expert: the experts' matrices are already small
(``moe_intermediate_size`` is a few hundred to two thousand); cutting each ``T`` ways makes
every active expert's matmuls ``T`` times thinner on every rank, and each rank would still read
and launch all of a token's ``k`` experts. With whole experts a rank's matmuls keep their shape,
a rank only runs the pairs it holds (``k / T`` of them on average), and the communication is the
same single all-reduce of ``[tokens, hidden]``. The price is balance: a rank whose experts are
popular in a batch works more (the routers' counts, ``LLM.metrics()["moe_expert_tokens"]``, show
it), and ``T`` must divide the number of experts.
"""

from __future__ import annotations

import torch
from torch import nn


class ExpertShard(nn.Module):
    """The routed experts ``first .. first + n`` of a mixture of ``num_experts``: called with the
    routing of every token (``weights``, ``ids`` ``[T, k]``, global expert ids), it returns the
    weighted sum of each token's experts that this rank holds (zeros for the others)."""

    def __init__(self, experts: nn.Module, first: int, count: int, num_experts: int) -> None:
        super().__init__()
        self.experts = experts  # experts first .. first + count, as local ids 0 .. count
        self.first = first
        self.count = count
        self.num_experts = num_experts  # the router's: every expert of the layer

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        mine = (local >= 0) & (local < self.count)
        rows, slots = mine.nonzero(as_tuple=True)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # summed in float32
        if rows.numel():
            # one (token, expert) pair per row, each its own "token" with top-1 routing
            pairs = self.experts(
                x.index_select(0, rows),
                weights[rows, slots].unsqueeze(1),
                local[rows, slots].unsqueeze(1),
            )
            out.index_add_(0, rows, pairs.float())
        return out.to(x.dtype)
