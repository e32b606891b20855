"""The CPU paged-attention backend: decode rows and multi-token rows through C++ kernels.

``cpu_paged_decode.cpp`` is the CPU twin of the Triton decode kernel: it walks each decode row's
block table with an online softmax and reads K/V where they lie in the pool, so a decode step no
longer gathers every request's blocks into padded tensors for SDPA (a quarter of a bfloat16
decode step at 16 rows on the 2-core benchmark machine). Three paths, chosen at compile time:

- AVX512-BF16 (bfloat16 caches): ``vdpbf16ps`` dot products on the stored bf16 values, 16-token
  score tiles summed across lanes by a shuffle tree, P·V over interleaved token pairs, and the
  next block prefetched into L2 a share at a time while the current one is computed. It reads
  the cache at the machine's streaming bandwidth (about 20 GB/s on the 2-core box, where
  gather + SDPA managed 6).
- AVX-512 (float32, float16, and bfloat16 without AVX512-BF16): the same walk with float32 FMAs.
- portable C++ for other CPUs (vectorized by the compiler).

Rows of several new tokens (prompt chunks, verification) go to ``cpu_paged_prefill.cpp``, the
FlashAttention-2 counterpart: one task per (sequence, KV head, 32 query positions) walks the keys
its queries see in tiles of 32 straight from the blocks, with an online softmax in float32, the
causal limit and the sliding window applied by tile bounds (no mask tensor, no gather). With
AVX512-BF16 the two products are ``vdpbf16ps`` on bf16 pairs; AVX-512 float32 FMAs otherwise,
and a portable loop without AVX-512. Both kernels take a sliding window and never read the
blocks outside it.

The sources ship with the package and are compiled on first use (``foudre.layers.native``).
Where no compiler works, ``attention_backend="auto"`` keeps the SDPA backend.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from foudre.layers import native
from foudre.runner.attention.paged import PagedBackend, PrefillRows

SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")
PREFILL_SOURCE = Path(__file__).with_name("cpu_paged_prefill.cpp")
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_SYMBOLS = {dtype: f"paged_decode_{suffix}" for dtype, suffix in _SUFFIXES.items()}
_I64 = ctypes.c_int64
_ARGTYPES = [ctypes.c_void_p] * 7 + [_I64] * 10 + [ctypes.c_float]
_WINDOW_ARGTYPES = [*_ARGTYPES, _I64]
_PREFILL_ARGTYPES = [ctypes.c_void_p] * 8 + [_I64] * 11 + [ctypes.c_float]


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The compiled decode kernel library (see ``foudre.layers.native``), or None."""
    dll = native.load(SOURCE)
    if dll is not None:
        for symbol in _SYMBOLS.values():
            fn = getattr(dll, symbol)
            fn.argtypes = _ARGTYPES
            fn.restype = None
            fn = getattr(dll, f"{symbol}_window")
            fn.argtypes = _WINDOW_ARGTYPES
            fn.restype = None
    return dll


@lru_cache(maxsize=1)
def load_prefill_library() -> ctypes.CDLL | None:
    """The compiled prefill kernel library, or None."""
    dll = native.load(PREFILL_SOURCE)
    if dll is not None:
        for suffix in _SUFFIXES.values():
            fn = getattr(dll, f"paged_prefill_{suffix}")
            fn.argtypes = _PREFILL_ARGTYPES
            fn.restype = None
    return dll


def kernel(dtype: torch.dtype) -> Any:
    """The decode kernel's function for ``dtype`` (``cpu_decode.py`` passes its address to the
    fused layers), or None."""
    dll = load_library()
    symbol = _SYMBOLS.get(dtype)
    return None if dll is None or symbol is None else getattr(dll, symbol)


def available() -> bool:
    return load_library() is not None and load_prefill_library() is not None


def _check_layouts(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor
) -> None:
    if q.dtype not in _SUFFIXES or k_cache.dtype != q.dtype or out.dtype != q.dtype:
        raise ValueError(f"CPU paged attention supports float32, bfloat16, float16; got {q.dtype}")
    head_dim = q.shape[2]
    # the kernels assume these layouts: contiguous heads and head_dim, equal K and V strides
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    assert out.stride(2) == 1 and out.stride(1) == head_dim
    assert k_cache.stride() == v_cache.stride()
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == head_dim


def cpu_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    token_idx: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> None:
    """The decode rows of ``PagedBackend`` (see ``paged.py``) on CPU tensors."""
    dll = load_library()
    if dll is None:
        raise RuntimeError("the CPU paged-attention kernel is not available (no C++ compiler?)")
    _check_layouts(q, k_cache, v_cache, out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = block_tables.to(torch.int32).contiguous()
    tokens = token_idx.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    getattr(dll, f"{_SYMBOLS[q.dtype]}_window")(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        tokens.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        tokens.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        q.stride(0),
        out.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        scale,
        window or 0,
    )


def cpu_paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    rows: PrefillRows,
    scale: float,
    window: int | None = None,
) -> None:
    """The multi-token rows of ``PagedBackend`` (see ``paged.py``) on CPU tensors: row ``r``'s
    queries (``q[q_starts[r] : q_starts[r] + q_lens[r]]``, at the last positions of a context
    of ``seq_lens[r]``) attend causally to the keys of its blocks, the last ``window`` of them
    with a sliding window; results into ``out`` at the same flat indices."""
    dll = load_prefill_library()
    if dll is None:
        raise RuntimeError("the CPU prefill attention kernel is not available (no C++ compiler?)")
    _check_layouts(q, k_cache, v_cache, out)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = rows.block_tables.to(torch.int32).contiguous()
    starts = rows.q_starts.to(torch.int32).contiguous()
    q_lens = rows.q_lens.to(torch.int32).contiguous()
    lens = rows.seq_lens.to(torch.int32).contiguous()
    getattr(dll, f"paged_prefill_{_SUFFIXES[q.dtype]}")(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        starts.data_ptr(),
        q_lens.data_ptr(),
        lens.data_ptr(),
        tables.data_ptr(),
        starts.shape[0],
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        q.stride(0),
        out.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        window or 0,
        scale,
    )


class CPUPagedBackend(PagedBackend):
    name = "cpu"

    decode = staticmethod(cpu_paged_decode)
    prefill = staticmethod(cpu_paged_prefill)
