"""The gated MLP of the Llama family: ``down(silu(gate(x)) * up(x))``, gate and up fused."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from foudre.layers import fused
from foudre.layers.linear import Linear


class GatedMLP(nn.Module):
    """``down_proj(silu(gate) * up)`` with ``gate | up = gate_up_proj(x)`` (one matmul)."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused.enabled(gate_up) and gate_up.dim() == 2:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)
