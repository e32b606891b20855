"""KV-cache quantization: K and V stored in 8 bits with one scale per (token, KV head).

``--kv-cache-dtype int8`` stores ``round(x / s)`` in int8 with ``s = max|x| / 127`` over the
head's ``head_dim`` values; ``fp8`` stores ``x / s`` as float8 e4m3 with ``s = max|x| / 448``.
These are the rounding functions; the paged cache that stores the codes is
``foudre.attention.quantized_cache.QuantizedKVCache``, and ``fake_quantize_kv`` gives what it
reads back (how ``CausalBackend`` measures the quality cost without a cache). The native CPU
decode step quantizes its new K/V in C++ (``quantize_kv`` in ``native/cpu_ops.cpp``) to the same
codes and scales, bit for bit; the paged attention kernels read the codes and scales as stored.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8")
_QMAX = {"int8": 127.0, "fp8": 448.0}
STORAGE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}  # the codes' dtype per kind


def quantize_kv(x: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[..., head_dim]`` to (codes in the storage dtype, float32 scales ``[...]``)."""
    x = x.float()
    scale = x.abs().amax(dim=-1).clamp(min=1e-8) / _QMAX[kind]
    y = x / scale.unsqueeze(-1)
    if kind == "int8":
        return y.round_().clamp_(-127, 127).to(torch.int8), scale
    return y.to(torch.float8_e4m3fn), scale


def dequantize_kv(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (codes.float() * scale.unsqueeze(-1)).to(dtype)


def fake_quantize_kv(x: torch.Tensor, kind: str) -> torch.Tensor:
    """What ``x`` reads back as after a round trip through the quantized cache."""
    codes, scale = quantize_kv(x, kind)
    return dequantize_kv(codes, scale, x.dtype)
