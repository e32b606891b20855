"""``QuantExperts``: the routed experts of a mixture-of-experts layer, each expert's two
projections a weight-only ``QuantLinear`` (8-bit per channel or 4-bit group-wise).

It takes the place of ``layers/moe.Experts`` (same call: ``x``, routing weights and ids) and
runs ``grouped_experts``: tokens sorted by expert, each expert that got tokens runs its packed
kernels once over them, so a decode step reads only the chosen experts' codes. While a CUDA graph
is captured it runs ``every_expert`` instead (no host synchronisation; it reads every expert).
"""

from __future__ import annotations

import torch
from torch import nn

from foudre.layers.moe import Experts, capturing, every_expert, grouped_experts, silu_mul
from foudre.quant.qlinear import QuantLinear


class QuantExperts(nn.Module):
    """Quantized experts: ``gate_up[e]`` (``[2I, hidden]``) and ``down[e]`` (``[hidden, I]``)."""

    def __init__(self, gate_up: list[QuantLinear], down: list[QuantLinear]) -> None:
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError("QuantExperts needs one gate_up and one down projection per expert")
        self.num_experts = len(gate_up)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)

    @classmethod
    @torch.no_grad()
    def from_experts(cls, experts: Experts, bits: int, group_size: int | None) -> QuantExperts:
        """Round-to-nearest quantization of every expert of ``experts`` (kept in its dtype and
        device for the activations)."""
        dtype, device = experts.gate_up_proj.dtype, experts.gate_up_proj.device

        def quantize(w: torch.Tensor) -> QuantLinear:
            q = QuantLinear.from_float(w.float(), None, bits, group_size)
            return q.to(dtype=dtype, device=device)

        return cls(
            [quantize(w) for w in experts.gate_up_proj],
            [quantize(w) for w in experts.down_proj],
        )

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` over the rows ``x`` ``[n, hidden]``."""
        return self.down[e](silu_mul(self.gate_up[e](x)))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if capturing(x):  # a CUDA graph: no sort on the host
            return every_expert(x, weights, ids, self.num_experts, self.expert)
        return grouped_experts(x, weights, ids, self.num_experts, self.expert)
