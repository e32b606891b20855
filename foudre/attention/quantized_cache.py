"""The paged KV cache in 8 bits: K and V stored with one scale per (token, KV head), rounded by
``foudre.attention.kv_quant``.

A block costs ``head_dim + 4`` bytes per token and head instead of ``2 * head_dim`` (bf16) or
``4 * head_dim`` (fp32): 1.9x (bf16) to 3.8x (fp32) more tokens in the same memory. The paged
kernels (C++ on the CPU, Triton) read the codes and scales as stored (``stored``); the SDPA
backend, the fallback, gathers blocks dequantized to the model's dtype (``gather``). New tokens
are written first and read back like every other token, so a step sees exactly what later steps
will see.
"""

from __future__ import annotations

import torch

from foudre.attention.base import gather_blocks
from foudre.attention.cache_spec import zeroed_pages
from foudre.attention.kv_quant import KV_CACHE_DTYPES, STORAGE_DTYPES, dequantize_kv, quantize_kv


def kv_bytes_per_token_head(head_dim: int, kind: str, dtype: torch.dtype) -> int:
    """Bytes of K or V for one token and one KV head."""
    if kind == "auto":
        return head_dim * torch.empty((), dtype=dtype).element_size()
    return head_dim + 4  # one byte per value and a float32 scale


class QuantizedKVCache:
    """One layer's paged K/V in 8 bits: ``codes`` ``[2, blocks, block_size, kv_heads, head_dim]``
    and ``scales`` ``[2, blocks, block_size, kv_heads]`` (float32)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        kind: str,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if kind not in STORAGE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kind!r}")
        self.kind = kind
        self.dtype = dtype  # what attention computes in
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        # stored as raw bytes: index_copy_ has no float8 kernel on every device
        self.codes = zeroed_pages(shape, torch.uint8, device)
        self.scales = zeroed_pages(shape[:-1], torch.float32, device).fill_(1.0)

    def write(self, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new K/V ``[T, kv_heads, head_dim]`` at their cache slots (K and V quantized in
        one pass)."""
        heads, dim = k.shape[1], k.shape[2]
        codes, scale = quantize_kv(torch.stack([k, v]), self.kind)  # [2, T, H, D], [2, T, H]
        self.codes.view(2, -1, heads, dim).index_copy_(1, slot_mapping, codes.view(torch.uint8))
        self.scales.view(2, -1, heads).index_copy_(1, slot_mapping, scale)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """K codes, V codes (``[blocks, block_size, kv_heads, head_dim]``, viewed as int8 or
        float8_e4m3fn), K scales, V scales (``[blocks, block_size, kv_heads]``): views, what the
        paged kernels read."""
        codes = self.codes.view(STORAGE_DTYPES[self.kind])
        return codes[0], codes[1], self.scales[0], self.scales[1]

    def gather(self, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks ``[B, n]``: ``[B, n, block_size, kv_heads, head_dim]``."""
        codes = gather_blocks(self.codes, block_tables, dim=1).view(STORAGE_DTYPES[self.kind])
        kv = dequantize_kv(codes, gather_blocks(self.scales, block_tables, dim=1), self.dtype)
        return kv[0], kv[1]
