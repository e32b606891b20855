"""``QuantExperts``: the routed experts of a mixture-of-experts layer, each expert's two
projections a weight-only ``QuantLinear`` (8-bit per channel or 4-bit group-wise), with their
biases and activation where the experts have them (gpt-oss's clamped SwiGLU experts:
``layers/moe.ClampedSwiGLUExperts``).

It takes the place of ``layers/moe.Experts`` (same call: ``x``, routing weights and ids) and
runs ``grouped_experts``: tokens sorted by expert, each expert that got tokens runs its packed
kernels once over them, so a decode step reads only the chosen experts' codes. While a CUDA graph
is captured it runs ``every_expert`` instead (no host synchronisation; it reads every expert).
gpt-oss's int8 experts at decode sizes on the CPU run one native call instead
(``fused_moe.gpt_oss_int8_experts``), which widens the codes against x unrounded where the
per-expert kernels round x to int8: the two differ by that rounding (about 1%).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import cast

import torch
from torch import nn

from foudre.layers import fused_moe
from foudre.layers.linear import MAX_ROWS
from foudre.layers.moe import (
    ClampedSwiGLUExperts,
    Experts,
    capturing,
    clamped_swiglu,
    every_expert,
    grouped_experts,
    silu_mul,
    swiglu_params,
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
        # (the addresses it was built from, the table) for the native call: see _int8_table
        self._table: tuple[list[int], torch.Tensor] | None = None

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

    @property
    def intermediate_size(self) -> int:
        """The experts' intermediate size (``Experts``'; the native decode step reads it)."""
        return int(cast(QuantLinear, self.gate_up[0]).out_features) // 2

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` over the rows ``x`` ``[n, hidden]``."""
        return self.down[e](self.activation(self.gate_up[e](x)))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        params = swiglu_params(self.activation)
        if (
            params is not None
            and not params[2]
            and x.dim() == 2
            and x.shape[0] <= MAX_ROWS.get(x.dtype, 0)
            and x.shape[1] == self.gate_up[0].in_features
            and fused_moe.available(x)
            and not torch.is_autocast_enabled("cpu")
        ):
            table = self._int8_table()
            if table is not None:
                up = cast(QuantLinear, self.gate_up[0])
                return fused_moe.gpt_oss_int8_experts(
                    x, weights, ids, table, up.out_features // 2,
                    up.scales.dtype == torch.bfloat16,
                    up.bias is not None and up.bias.dtype == torch.bfloat16,
                    params[0], params[1],
                )  # fmt: skip
        if capturing(x):  # a CUDA graph: no sort on the host
            return every_expert(x, weights, ids, self.num_experts, self.expert)
        return grouped_experts(x, weights, ids, self.num_experts, self.expert)

    def _int8_table(self) -> torch.Tensor | None:
        """The addresses of every expert's codes, scales and biases (``fused_moe.
        gpt_oss_int8_experts``' table) where each projection is int8 per channel in its plain
        layout on the CPU (codes ``[N, K]``, scales ``[N]`` float32 or bfloat16, biases of one
        dtype or none, no input scale nor permutation; each expert's gate_up ``[2I, H]`` and
        down ``[H, I]``), else None. Kept while every tensor is where it was when it was built
        (a module's tensor replaced, or moved under the same object by ``set_``, as
        ``place_in_huge_pages`` moves them, or a copy of the module: built again)."""
        ups = cast(list[QuantLinear], list(self.gate_up))
        downs = cast(list[QuantLinear], list(self.down))
        tensors: list[torch.Tensor | None] = []
        for mods in zip(ups, downs, strict=True):
            for m in mods:
                tensors += [m.qweight, m.scales, m.bias]
        addresses = [0 if t is None else t.data_ptr() for t in tensors]
        held = self._table
        if held is not None and held[0] == addresses:
            return held[1]
        self._table = None
        first = ups[0]
        bias_dtype = None if first.bias is None else first.bias.dtype
        hidden, inner = first.in_features, first.out_features // 2
        shapes = [(2 * inner, hidden)] * len(ups) + [(hidden, inner)] * len(downs)
        for m, shape in zip([*ups, *downs], shapes, strict=True):
            if (
                (m.out_features, m.in_features) != shape
                or not m.scales.is_contiguous()
                or (m.bias is not None and not m.bias.is_contiguous())
                or m.bits != 8
                or m.group_size is not None
                or m.interleaved
                or m.input_scale is not None
                or m.perm is not None
                or m.compute_dtype is not None
                or m.qweight.device.type != "cpu"
                or m.qweight.dtype != torch.int8
                or not m.qweight.is_contiguous()
                or m.scales.dtype not in (torch.float32, torch.bfloat16)
                or m.scales.dtype != first.scales.dtype
                or (None if m.bias is None else m.bias.dtype) != bias_dtype
                or bias_dtype not in (None, torch.float32, torch.bfloat16)
            ):
                return None
        table = torch.tensor(addresses, dtype=torch.int64).view(self.num_experts, 6)
        self._table = (addresses, table)
        return table
