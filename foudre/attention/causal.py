"""Dense causal attention without a KV cache, for whole sequences (training, evaluation,
quantization calibration).

The same model modules run through ``CausalBackend`` as through the paged backends, so the model
that is trained, evaluated or calibrated is exactly the one that is served
(``foudre.models.causal.causal_hidden`` runs a model through it).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from foudre.attention.base import AttentionBackend, BatchLayout
from foudre.attention.kv_quant import fake_quantize_kv
from foudre.attention.torch_sdpa import with_sinks


class CausalBackend(AttentionBackend):
    """Dense causal attention over rows of equal length; ``metadata`` is ``(batch, seq_len)``.

    Token ``t`` of a row attends to tokens ``0..t`` of the same row and nothing else (to
    ``t - window + 1..t`` with a sliding window). The KV
    cache argument is ignored. Differentiable, so it serves training as well as evaluation.
    ``kv_cache_dtype`` int8 / fp8 rounds K and V exactly as the quantized paged cache stores
    them, so evaluation measures the quality cost of KV-cache quantization.
    """

    name = "causal"

    def __init__(self, kv_cache_dtype: str = "auto") -> None:
        self.kv_cache_dtype = kv_cache_dtype

    def build_metadata(self, layout: BatchLayout, device: torch.device) -> Any:
        raise TypeError("CausalBackend takes (batch, seq_len) metadata, not a paged layout")

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: tuple[int, int],
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        b, t = metadata
        if self.kv_cache_dtype != "auto":
            k = fake_quantize_kv(k, self.kv_cache_dtype)
            v = fake_quantize_kv(v, self.kv_cache_dtype)
        heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
        qh = q.view(b, t, heads, dim).transpose(1, 2)
        kh = k.view(b, t, kv_heads, dim).transpose(1, 2)
        vh = v.view(b, t, kv_heads, dim).transpose(1, 2)
        if heads != kv_heads:
            kh = kh.repeat_interleave(heads // kv_heads, dim=1)
            vh = vh.repeat_interleave(heads // kv_heads, dim=1)
        if sinks is not None:  # (differentiable in the sinks too)
            if tuple(sinks.shape) != (heads,):
                raise ValueError(f"attention sinks must be [{heads}], got {tuple(sinks.shape)}")
            i = torch.arange(t, device=q.device)
            mask = i.view(-1, 1) >= i.view(1, -1)
            if window is not None:
                mask &= i.view(-1, 1) - i.view(1, -1) < window
            kh, vh, bias = with_sinks(kh, vh, mask.view(1, 1, t, t), sinks.view(1, heads, 1))
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=bias, scale=scale)
        elif window is None or window >= t:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=scale)
        else:  # a sliding window: token i sees tokens i - window + 1 .. i
            i = torch.arange(t, device=q.device)
            mask = (i.view(-1, 1) >= i.view(1, -1)) & (i.view(-1, 1) - i.view(1, -1) < window)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
        return o.transpose(1, 2).reshape(b * t, heads, dim)
