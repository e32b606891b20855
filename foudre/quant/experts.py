"""``QuantExperts``: the routed experts of a mixture-of-experts layer, each expert's two
projections a weight-only ``QuantLinear`` (8-bit per channel or 4-bit group-wise), with their
biases and activation where the experts have them (gpt-oss's clamped SwiGLU experts:
``layers/moe.ClampedSwiGLUExperts``).

It takes the place of ``layers/moe.Experts`` (same call: ``x``, routing weights and ids) and
runs ``grouped_experts``: tokens sorted by expert, each expert that got tokens runs its packed
kernels once over them, so a decode step reads only the chosen experts' codes. While a CUDA graph
is captured it runs ``every_expert`` instead (no host synchronisation; it reads every expert).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from foudre.layers.moe import (
    ClampedSwiGLUExperts,
    Experts,
    capturing,
    clamped_swiglu,
    every_expert,
    grouped_experts,
    silu_mul,
)
from foudre.quant.qlinear import QuantLinear


class QuantExperts(nn.Module):
    """Quantized experts: ``gate_up[e]`` (``[2I, hidden]``, gate rows then up rows) and
    ``down[e]`` (``[hidden, I]``), each with its bias if any, and ``activation`` ``[n, 2I] ->
    [n, I]`` between them (``silu_mul`` unless given)."""

    def __init__(
        self,
        gate_up: list[QuantLinear],
        down: list[QuantLinear],
        activation: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        if len(gate_up) != len(down) or not gate_up:
            raise ValueError("QuantExperts needs one gate_up and one down projection per expert")
        self.num_experts = len(gate_up)
        self.gate_up = nn.ModuleList(gate_up)
        self.down = nn.ModuleList(down)
        self.activation = activation or silu_mul

    @classmethod
    @torch.no_grad()
    def from_experts(
        cls, experts: Experts | ClampedSwiGLUExperts, bits: int, group_size: int | None
    ) -> QuantExperts:
        """Round-to-nearest quantization of every expert of ``experts`` (kept in its dtype and
        device for the activations): ``Experts``, or gpt-oss's ``ClampedSwiGLUExperts`` with
        their biases (in the experts' dtype) and clamped SwiGLU."""
        dtype, device = experts.gate_up_proj.dtype, experts.gate_up_proj.device
        activation = None
        gate_up_bias: list[torch.Tensor | None] = [None] * experts.num_experts
        down_bias: list[torch.Tensor | None] = [None] * experts.num_experts
        if isinstance(experts, ClampedSwiGLUExperts):
            activation = partial(clamped_swiglu, alpha=experts.alpha, limit=experts.limit)
            gate_up_bias = list(experts.gate_up_proj_bias.detach())
            down_bias = list(experts.down_proj_bias.detach())

        def quantize(w: torch.Tensor, bias: torch.Tensor | None) -> QuantLinear:
            q = QuantLinear.from_float(w.detach().float(), bias, bits, group_size)
            return q.to(dtype=dtype, device=device)

        return cls(
            [quantize(w, b) for w, b in zip(experts.gate_up_proj, gate_up_bias, strict=True)],
            [quantize(w, b) for w, b in zip(experts.down_proj, down_bias, strict=True)],
            activation,
        )

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` over the rows ``x`` ``[n, hidden]``."""
        return self.down[e](self.activation(self.gate_up[e](x)))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if capturing(x):  # a CUDA graph: no sort on the host
            return every_expert(x, weights, ids, self.num_experts, self.expert)
        return grouped_experts(x, weights, ids, self.num_experts, self.expert)
