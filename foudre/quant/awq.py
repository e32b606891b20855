"""AWQ (Lin et al., 2023): scale each input channel of a weight by ``s`` before rounding, so the
channels that carry large activations lose less precision, and divide the input by ``s``.

``s = mean|x|^alpha`` (normalised), with ``alpha`` searched on a grid to minimise the layer's
output error on calibration inputs; ``alpha = 0`` is plain round-to-nearest, so the search never
does worse than RTN on the calibration set. ``1 / s`` is folded into the op that produces the
input where that is exact: the RMSNorm weight before ``qkv_proj`` and ``gate_up_proj``, the ``v``
rows of ``qkv_proj`` before ``o_proj`` (one scale per kv channel, shared by the query heads of a
group), the ``up`` rows of ``gate_up_proj`` before ``down_proj``. Elsewhere (``lm_head``) the
module keeps an explicit ``input_scale``.
"""

from __future__ import annotations

import torch

from foudre.quant.packing import dequantize_int4, quantize_int4, quantize_int8


def fake_quantize(w: torch.Tensor, bits: int, group_size: int | None) -> torch.Tensor:
    """Round-to-nearest quantize-dequantize of ``w`` ``[N, K]`` (float32 out)."""
    if bits == 8:
        q, s = quantize_int8(w)
        return q.float() * s[:, None]
    assert group_size is not None
    q4, s4, z4 = quantize_int4(w, group_size)
    return dequantize_int4(q4, s4, z4, group_size)[:, : w.shape[1]]


def search_scale(
    w: torch.Tensor,
    x: torch.Tensor,
    bits: int,
    group_size: int | None,
    x_mean: torch.Tensor | None = None,
    grid: int = 20,
) -> torch.Tensor:
    """The per-input-channel scale ``s`` ``[K]`` minimising ``|x W^T - x (Q(W s) / s)^T|^2``.

    ``x_mean`` overrides the activation statistic (used to tie channels that must share ``s``).
    """
    w, x = w.float(), x.float()
    ref = x @ w.t()
    stat = (x.abs().mean(0) if x_mean is None else x_mean.float()).clamp(min=1e-8)
    best_s, best_loss = torch.ones_like(stat), float("inf")
    for r in range(grid):
        s = stat.pow(r / grid).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = fake_quantize(w * s[None, :], bits, group_size) / s[None, :]
        loss = (x @ wq.t() - ref).pow(2).mean().item()
        if loss < best_loss:
            best_loss, best_s = loss, s
    return best_s


def shared_kv_stat(x_mean: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Average ``x_mean`` of o_proj's inputs over the query heads of each kv group, so that one
    scale per v channel serves every head that reads it."""
    head_dim = x_mean.shape[0] // num_heads
    grouped = x_mean.view(num_kv_heads, num_heads // num_kv_heads, head_dim)
    return grouped.mean(1, keepdim=True).expand_as(grouped).reshape(-1)
