"""The CPU paged-attention backend: decode rows through a C++ kernel, the rest through SDPA.

``cpu_paged_decode.cpp`` is the CPU twin of the Triton decode kernel: it walks each decode row's
block table with an online softmax and reads K/V where they lie in the pool, so a decode step no
longer gathers every request's blocks into padded tensors for SDPA (a quarter of a bfloat16
decode step at 16 rows on the 2-core benchmark machine). Three paths, chosen at compile time:

- AVX512-BF16 (bfloat16 caches): ``vdpbf16ps`` dot products on the stored bf16 values, 16-token
  score tiles summed across lanes by a shuffle tree, P·V over interleaved token pairs, and the
  next block prefetched into L2 a share at a time while the current one is computed. It reads
  the cache at the machine's streaming bandwidth (about 20 GB/s on the 2-core box, where
  gather + SDPA managed 6).
- AVX-512 (float32, float16, and bfloat16 without AVX512-BF16): float32 FMAs per token.
- portable C++ for other CPUs (vectorized by the compiler).

The source ships with the package and is compiled on first use with the system's C++ compiler
(``$CXX``, else ``g++``, ``c++`` or ``clang++``; a few seconds) into ``$FOUDRE_CACHE`` (default
``~/.cache/foudre``)``/kernels``, keyed by the source, the flags and the CPU's feature flags,
then loaded with ``ctypes``; no PyTorch headers or build tools beyond the compiler are needed.
The library's OpenMP calls resolve to the libgomp that torch already loaded, so both share one
thread pool. Where no compiler works, ``attention_backend="auto"`` keeps the SDPA backend.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from foudre.runner.attention.paged import PagedDecodeBackend

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_paged_decode.cpp")
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared", "-std=c++17"]


def _flags() -> list[str]:
    """Compiler flags: the build targets this CPU unless ``FOUDRE_KERNEL_MARCH`` names another
    ``-march`` (``x86-64`` builds the portable path, ``skylake-avx512`` the AVX-512 one without
    AVX512-BF16: how the tests check the paths this machine would not take)."""
    return [*FLAGS, f"-march={os.environ.get('FOUDRE_KERNEL_MARCH', 'native')}"]


_SYMBOLS = {
    torch.float32: "paged_decode_f32",
    torch.bfloat16: "paged_decode_bf16",
    torch.float16: "paged_decode_f16",
}
_I64 = ctypes.c_int64
_ARGTYPES = [ctypes.c_void_p] * 7 + [_I64] * 10 + [ctypes.c_float]


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


@lru_cache(maxsize=1)
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library (built on first use, then cached on disk), or None with the
    reason logged when it cannot be built or loaded."""
    compiler = _compiler()
    if compiler is None:
        log.info("no C++ compiler found: CPU paged attention falls back to SDPA")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(
        source + " ".join([compiler, *_flags(), platform.machine(), _cpu_flags()]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("FOUDRE_CACHE", Path.home() / ".cache" / "foudre")) / "kernels"
    lib = cache / f"cpu_paged_decode-{key}.so"
    if not lib.is_file():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                built = Path(tmp) / lib.name
                subprocess.run(
                    [compiler, *_flags(), str(SOURCE), "-o", str(built)],
                    check=True,
                    capture_output=True,
                    text=True,
                    timeout=300,
                )
                built.replace(lib)  # atomic: a concurrent build never loads a partial file
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            log.warning("building the CPU paged-attention kernel failed: %s", detail.strip())
            return None
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError as e:
        log.warning("loading the CPU paged-attention kernel failed: %s", e)
        return None
    for symbol in _SYMBOLS.values():
        fn = getattr(dll, symbol)
        fn.argtypes = _ARGTYPES
        fn.restype = None
    return dll


def available() -> bool:
    return load_library() is not None


def cpu_paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    token_idx: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """The decode rows of ``PagedDecodeBackend`` (see ``paged.py``) on CPU tensors."""
    dll = load_library()
    if dll is None:
        raise RuntimeError("the CPU paged-attention kernel is not available (no C++ compiler?)")
    symbol = _SYMBOLS.get(q.dtype)
    if symbol is None or k_cache.dtype != q.dtype or out.dtype != q.dtype:
        raise ValueError(f"CPU paged attention supports float32, bfloat16, float16; got {q.dtype}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    # the kernel assumes these layouts: contiguous heads and head_dim, equal K and V strides
    assert q.stride(2) == 1 and q.stride(1) == head_dim
    assert out.stride(2) == 1 and out.stride(1) == head_dim
    assert k_cache.stride() == v_cache.stride()
    assert k_cache.stride(3) == 1 and k_cache.stride(2) == head_dim
    tables = block_tables.to(torch.int32).contiguous()
    tokens = token_idx.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    getattr(dll, symbol)(
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
    )


class CPUPagedBackend(PagedDecodeBackend):
    name = "cpu"

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        out: torch.Tensor,
        token_idx: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> None:
        cpu_paged_decode(q, k_cache, v_cache, out, token_idx, block_tables, seq_lens, scale)
