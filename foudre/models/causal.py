"""A model's forward over whole sequences without a KV cache (training, evaluation,
quantization calibration), through ``CausalBackend`` (``foudre/attention/causal.py``)."""

from __future__ import annotations

import torch

from foudre.attention.causal import CausalBackend
from foudre.attention.kv_quant import KV_CACHE_DTYPES
from foudre.models.llama import LlamaForCausalLM

_BACKENDS = {kind: CausalBackend(kind) for kind in KV_CACHE_DTYPES}


def causal_hidden(
    model: LlamaForCausalLM, ids: torch.Tensor, kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """Final hidden states ``[B, T, hidden]`` of ``ids`` ``[B, T]`` (each row from position 0)."""
    b, t = ids.shape
    # a LongRoPE sequence past the original context is rotated by the long factors throughout
    offset = model.model.rotary.position_offset(t)
    positions = (torch.arange(t, device=ids.device) + offset).repeat(b)
    caches = [torch.empty(0, device=ids.device)] * len(model.model.layers)
    hidden = model(ids.reshape(-1), positions, caches, _BACKENDS[kv_cache_dtype], (b, t))
    return hidden.view(b, t, -1)
