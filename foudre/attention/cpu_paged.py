"""The CPU paged-attention backend: decode rows and multi-token rows through C++ kernels.

``cpu_paged_decode.cpp`` is the CPU twin of the Triton decode kernel: it walks each decode row's
block table with an online softmax and reads K/V where they lie in the pool, so a decode step no
longer gathers every request's blocks into padded tensors for SDPA (a quarter of a bfloat16
decode step at 16 rows on the 2-core benchmark machine). Four paths, chosen at compile time:

- AVX512-BF16 (bfloat16 caches): ``vdpbf16ps`` dot products on the stored bf16 values, 16-token
  score tiles summed across lanes by a shuffle tree, P·V over interleaved token pairs, and the
  next block prefetched into L2 a share at a time while the current one is computed. It reads
  the cache at the machine's streaming bandwidth (about 20 GB/s on the 2-core box, where
  gather + SDPA managed 6).
- AVX-512 (float32, float16, and bfloat16 without AVX512-BF16): the same walk with float32 FMAs.
- AVX2 (no AVX-512: AMD Zen 2 and 3, Intel's client cores): the same walk on 8 lanes, in tiles
  of 16 tokens, K and V read into registers 16 values at a time (bfloat16 split into its even
  and odd positions by a shift and a mask: no conversion pass).
- portable C++ for other CPUs (vectorized by the compiler).

A quantized KV cache (``kv_cache_dtype`` int8 / fp8: 8-bit codes and one float32 scale per token
and KV head) is read as it lies by both kernels, the codes converted to float32 as they are used
(int8 by sign extension and ``vcvtdq2ps``, e4m3 by moving its bits into a float16's for
``vcvtph2ps``) and each scale folded into what it multiplies anyway: a key's into its score, a
value's into its softmax weight. A step reads a byte per value instead of two or four.

Rows of several new tokens (prompt chunks, verification) go to ``cpu_paged_prefill.cpp``, the
FlashAttention-2 counterpart: one task per (sequence, KV head, 32 query positions) walks the keys
its queries see in tiles of 32 straight from the blocks, with an online softmax in float32, the
causal limit and the sliding window applied by tile bounds (no mask tensor, no gather). With
AVX512-BF16 the two products are ``vdpbf16ps`` on bf16 pairs; AVX-512 float32 FMAs otherwise,
float32 FMAs on 8 lanes with AVX2, and a portable loop without either. Both kernels take a
sliding window and never read the blocks outside it.

The sources ship with the package and are compiled on first use (``foudre.native.build``).
Where no compiler works, ``attention_backend="auto"`` keeps the SDPA backend.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any

import torch

from foudre.attention.paged import PagedBackend, PrefillRows
from foudre.native import build as native

SOURCE = native.SOURCES / "cpu_paged_decode.cpp"
PREFILL_SOURCE = native.SOURCES / "cpu_paged_prefill.cpp"
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_SYMBOLS = {dtype: f"paged_decode_{suffix}" for dtype, suffix in _SUFFIXES.items()}
# a quantized cache's codes, by the dtype its codes are viewed as (QuantizedKVCache.stored)
_CODES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}
_I64 = ctypes.c_int64
_ARGTYPES = [ctypes.c_void_p] * 7 + [_I64] * 10 + [ctypes.c_float]
# NAME_window: the window and the sinks (a float32 pointer or None) after the scale
_WINDOW_ARGTYPES = [*_ARGTYPES, _I64, ctypes.c_void_p]
# NAME_store: and the new tokens' K and V, and their token strides in elements
_STORE_ARGTYPES = [*_WINDOW_ARGTYPES, ctypes.c_void_p, ctypes.c_void_p, _I64, _I64]
# with codes: the scales of K and V after the caches' pointers (NAME_sinks: and the sinks)
_CODES_ARGTYPES = [ctypes.c_void_p] * 9 + [_I64] * 10 + [ctypes.c_float, _I64]
_CODES_SINKS_ARGTYPES = [*_CODES_ARGTYPES, ctypes.c_void_p]
_PREFILL_ARGTYPES = [ctypes.c_void_p] * 8 + [_I64] * 11 + [ctypes.c_float, ctypes.c_void_p]
_PREFILL_CODES_ARGTYPES = [ctypes.c_void_p] * 10 + [_I64] * 11 + [ctypes.c_float, ctypes.c_void_p]


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The compiled decode kernel library (see ``foudre.native.build``), or None."""
    dll = native.load(SOURCE)
    if dll is not None:
        for symbol in _SYMBOLS.values():
            fn = getattr(dll, symbol)
            fn.argtypes = _ARGTYPES
            fn.restype = None
            fn = getattr(dll, f"{symbol}_window")
            fn.argtypes = _WINDOW_ARGTYPES
            fn.restype = None
            fn = getattr(dll, f"{symbol}_store")
            fn.argtypes = _STORE_ARGTYPES
            fn.restype = None
            for codes in _CODES.values():
                fn = getattr(dll, f"{symbol}_{codes}")
                fn.argtypes = _CODES_ARGTYPES
                fn.restype = None
                fn = getattr(dll, f"{symbol}_{codes}_sinks")
                fn.argtypes = _CODES_SINKS_ARGTYPES
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
            for codes in _CODES.values():
                fn = getattr(dll, f"paged_prefill_{suffix}_{codes}")
                fn.argtypes = _PREFILL_CODES_ARGTYPES
                fn.restype = None
    return dll


def kernel(dtype: torch.dtype, codes: torch.dtype | None = None) -> Any:
    """The decode kernel's function for queries of ``dtype`` over a cache of ``dtype``, or of
    ``codes`` (int8, float8_e4m3fn: a quantized cache) where given (``cpu_decode.py`` passes its
    address to the fused layers); None where there is none."""
    dll = load_library()
    symbol = _SYMBOLS.get(dtype)
    if codes is not None and symbol is not None:
        symbol = f"{symbol}_{_CODES[codes]}" if codes in _CODES else None
    return None if dll is None or symbol is None else getattr(dll, symbol)


def available() -> bool:
    return load_library() is not None and load_prefill_library() is not None


def _check_layouts(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> list[int]:
    """The scales' addresses to pass after the caches' (none for a float cache)."""
    if q.dtype not in _SUFFIXES or out.dtype != q.dtype:
        raise ValueError(f"CPU paged attention supports float32, bfloat16, float16; got {q.dtype}")
    quantized = k_cache.dtype in _CODES
    if (k_cache.dtype != q.dtype and not quantized) or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"the KV cache ({k_cache.dtype}, {v_cache.dtype}) is neither the queries' dtype "
            f"({q.dtype}) nor int8 / float8_e4m3fn codes"
        )
    if quantized != (k_scale is not None and v_scale is not None):
        raise ValueError("k_scale and v_scale come with a quantized KV cache, and only with one")
    head_dim = q.shape[2]
    # the kernels assume these layouts: contiguous heads and head_dim, equal K and V strides
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    assert out.stride(2) == 1 and out.stride(1) == head_dim
    assert k_cache.stride() == v_cache.stride()
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == head_dim
    if k_scale is None or v_scale is None:
        return []
    # scales [blocks, block_size, kv_heads] laid out as the codes without head_dim
    assert k_scale.dtype == v_scale.dtype == torch.float32
    assert k_scale.shape == k_cache.shape[:3] and k_scale.stride() == v_scale.stride()
    assert [s * head_dim for s in k_scale.stride()] == list(k_cache.stride()[:3])
    return [k_scale.data_ptr(), v_scale.data_ptr()]


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
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> None:
    """The decode rows of ``PagedBackend`` (see ``paged.py``) on CPU tensors; a quantized cache
    as int8 / float8_e4m3fn codes with their scales ``[num_blocks, block_size, kv_heads]``;
    ``sinks``: float32 ``[num_heads]``, each head's sink logit in its softmax denominator.
    ``k_new`` / ``v_new`` ``[T, kv_heads, head_dim]`` (a float cache only): the rows' new tokens
    (row ``i``'s at ``token_idx[i]``), not yet in the cache: each is written into its row's
    last slot (position ``seq_lens[i] - 1``) before any row reads (a row may read another's:
    a prefix-cache hit on a block that a row of the same step fills)."""
    dll = load_library()
    if dll is None:
        raise RuntimeError("the CPU paged-attention kernel is not available (no C++ compiler?)")
    scales = _check_layouts(q, k_cache, v_cache, out, k_scale, v_scale)
    fresh = _fresh(k_new, v_new, k_cache, bool(scales))
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = block_tables.to(torch.int32).contiguous()
    tokens = token_idx.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    symbol = _SYMBOLS[q.dtype] + (f"_{_CODES[k_cache.dtype]}_sinks" if scales else "_store")
    getattr(dll, symbol)(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        *scales,
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
        _sinks_pointer(sinks, num_heads),
        *fresh,
    )


def _fresh(
    k_new: torch.Tensor | None, v_new: torch.Tensor | None, k_cache: torch.Tensor, quantized: bool
) -> list[int | None]:
    """``cpu_paged_decode``'s trailing arguments for its new tokens: their K and V addresses and
    token strides (none for a quantized cache, which takes no new tokens)."""
    if quantized:
        if k_new is not None or v_new is not None:
            raise ValueError("k_new / v_new go into a float cache (write a quantized one first)")
        return []
    if k_new is None or v_new is None:
        if k_new is not None or v_new is not None:
            raise ValueError("k_new and v_new come together")
        return [None, None, 0, 0]
    if not new_tokens_fit(k_new, v_new, k_cache):
        raise ValueError(
            f"k_new and v_new must be [T, {k_cache.shape[2]}, {k_cache.shape[3]}] of "
            f"{k_cache.dtype} on its device, each token's heads contiguous"
        )
    return [k_new.data_ptr(), v_new.data_ptr(), k_new.stride(0), v_new.stride(0)]


def new_tokens_fit(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the kernel can write a step's new ``k`` / ``v`` into the float ``k_cache``
    ``[blocks, block_size, kv_heads, head_dim]`` itself: the cache's dtype and device, the same
    tokens, each token's heads contiguous."""
    shape = (k_cache.shape[2], k_cache.shape[3])
    return k.shape[0] == v.shape[0] and all(
        t.dtype == k_cache.dtype
        and t.device == k_cache.device
        and t.dim() == 3
        and tuple(t.shape[1:]) == shape
        and t.stride(2) == 1
        and t.stride(1) == shape[1]
        for t in (k, v)
    )


def _sinks_pointer(sinks: torch.Tensor | None, num_heads: int) -> int | None:
    """The address of ``sinks`` (float32 ``[num_heads]``, contiguous on the CPU), or None."""
    if sinks is None:
        return None
    if sinks.dtype != torch.float32 or sinks.shape != (num_heads,) or not sinks.is_contiguous():
        raise ValueError(f"sinks must be a contiguous float32 [{num_heads}], got {sinks.shape}")
    return sinks.data_ptr()


def cpu_paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    rows: PrefillRows,
    scale: float,
    window: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """The multi-token rows of ``PagedBackend`` (see ``paged.py``) on CPU tensors: row ``r``'s
    queries (``q[q_starts[r] : q_starts[r] + q_lens[r]]``, at the last positions of a context
    of ``seq_lens[r]``) attend causally to the keys of its blocks, the last ``window`` of them
    with a sliding window; results into ``out`` at the same flat indices. A quantized cache and
    ``sinks`` as in ``cpu_paged_decode``."""
    dll = load_prefill_library()
    if dll is None:
        raise RuntimeError("the CPU prefill attention kernel is not available (no C++ compiler?)")
    scales = _check_layouts(q, k_cache, v_cache, out, k_scale, v_scale)
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    tables = rows.block_tables.to(torch.int32).contiguous()
    starts = rows.q_starts.to(torch.int32).contiguous()
    q_lens = rows.q_lens.to(torch.int32).contiguous()
    lens = rows.seq_lens.to(torch.int32).contiguous()
    codes = f"_{_CODES[k_cache.dtype]}" if scales else ""
    getattr(dll, f"paged_prefill_{_SUFFIXES[q.dtype]}{codes}")(
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        *scales,
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
        _sinks_pointer(sinks, num_heads),
    )


class CPUPagedBackend(PagedBackend):
    name = "cpu"

    def stores_new_tokens(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor) -> bool:
        return new_tokens_fit(k, v, k_cache)

    decode = staticmethod(cpu_paged_decode)
    prefill = staticmethod(cpu_paged_prefill)
