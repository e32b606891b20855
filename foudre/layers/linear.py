"""The models' linear layer: ``nn.Linear`` with the CPU kernel for decode-sized batches.

A decode step multiplies every weight matrix by one row per running request. At a few rows its time
is the time to read the weights. ``fused.linear`` (``cpu_ops.cpp``) reads them at the speed of the
fastest matrix-vector product we measure here; oneDNN's bfloat16 path reads at 60-80% of it, and
MKL's float32 path at two to 64 rows at a quarter to a third (the figures: ``docs/performance.md``).
At more rows the kernel is bound by its multiply-adds; it stays ahead of oneDNN's bfloat16 GEMM up
to about 16 rows and of MKL's float32 GEMM to 64 (this project's 2-core AVX-512 host, all 16 layers'
weights streamed from DRAM). More rows than ``MAX_ROWS`` go to torch, as do inputs under autocast
(whose dtype rules the kernel does not apply) and anything autograd records. In float32, torch's
GEMM gets the wide weights in chunks of output features up to ``FP32_CHUNK_ROWS`` rows, where MKL
runs them faster (a 128-token float32 prefill of the 500M model: 12.6% less time). On a CPU without
bfloat16 arithmetic (no AVX512-BF16 nor AMX: AMD Zen 2 and 3, Intel's client cores) oneDNN's
bfloat16 GEMM widens as it goes and ran at 11-20 GFLOP/s where MKL's float32 GEMM ran at 86-117 (a
Zen 3 host, 2 threads, 16-512 rows): there a bfloat16 product of more rows runs in float32
(``gemm_dtype``): up to ``GEMM_ROWS`` rows in the AVX2 build's own GEMM (``fused.gemm_unchecked``),
which widens the weight in registers (a 494.7M Llama's 128-token prefill 1.32x as fast; its
32-request decode steps, which had widened every weight each step, 1.4-2.4x), past them in MKL's,
the weight widened ``BF16_CHUNK`` output features at a time (cache-sized); the result rounded once
to bfloat16."""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from foudre.layers import fused

# the most rows that the kernel takes, by dtype: where it stays faster than torch's GEMM here
MAX_ROWS = {torch.float32: 64, torch.bfloat16: 16}

# MKL's float32 GEMM from MAX_ROWS to about a thousand rows runs 15-40% faster over chunks of
# this many output features than over a wide weight (8192 at 128 rows: 153 GFLOP/s against 111
# on this project's 2-core host; no gain at 2048 rows, a loss for oneDNN's bfloat16)
FP32_CHUNK = 1024
FP32_CHUNK_ROWS = 1024
# output features widened to float32 at a time where bfloat16 GEMMs run in float32 (gemm_dtype):
# a few MiB, inside the last-level cache
BF16_CHUNK = 256
# the most rows that the AVX2 build's bfloat16 GEMM takes where bfloat16 GEMMs run in float32: a
# 494.7M Llama's prefill, in turns with MKL's over the widened chunks (whose widening costs less
# beside more rows' products), ran 1.32x as fast at 128 tokens, 1.08x at 256, 0.97x at 512
GEMM_ROWS = 256


@cache
def gemm_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype torch's CPU GEMM should compute a ``dtype`` product in: float32 for bfloat16 on
    a CPU without bfloat16 arithmetic (no AVX512-BF16, no AMX), where oneDNN's bfloat16 GEMM is
    5-8x slower than MKL's float32 one; else ``dtype`` itself."""
    if dtype != torch.bfloat16:
        return dtype
    fast = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    return dtype if fast else torch.float32


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``, through the kernel that is fastest here for ``x``'s rows (what
    ``Linear`` runs; the experts of ``layers/moe.py`` call it on slices of their weights)."""
    if (
        x.dim() == 2
        and x.shape[0] <= MAX_ROWS.get(x.dtype, 0)
        and _kernels_read(x, w, b)
        and not torch.is_autocast_enabled("cpu")
    ):
        return fused.linear_unchecked(x, w, b)
    if (
        x.dtype == torch.float32
        and x.dim() == 2
        and x.shape[0] <= FP32_CHUNK_ROWS
        and w.shape[0] > FP32_CHUNK
        and x.is_cpu
        and not fused.records_grad(x, w, b)
        and not torch.is_autocast_enabled("cpu")
    ):
        return _chunked(x, w, b, FP32_CHUNK, x.dtype)
    if (
        gemm_dtype(x.dtype) != x.dtype
        and x.dim() == 2
        and x.is_cpu
        and w.dtype == torch.bfloat16
        and not fused.records_grad(x, w, b)
        and not torch.is_autocast_enabled("cpu")
    ):
        if x.shape[0] <= GEMM_ROWS and _kernels_read(x, w, b) and fused.has_gemm():
            return fused.gemm_unchecked(x, w, b)
        return _chunked(x, w, b, BF16_CHUNK, gemm_dtype(x.dtype))
    return F.linear(x, w, b)


def _kernels_read(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the library's products (``fused.linear_unchecked``, ``fused.gemm_unchecked``)
    can read a 2-D ``x``, ``w`` and ``b`` as they lie: the fused path on for them, matching
    shapes, unit column stride, a contiguous weight and bias."""
    return (
        fused.enabled(x, w, b)
        and x.shape[1] == w.shape[1]
        and x.stride(1) == 1
        and w.is_contiguous()
        and (b is None or (b.shape == (w.shape[0],) and b.is_contiguous()))
    )


def _chunked(
    x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, chunk: int, dtype: torch.dtype
) -> torch.Tensor:
    """``F.linear(x, w, b)``, ``chunk`` output features per GEMM, each into its columns of one
    output: in x's dtype, MKL writing at the output's row stride (no copy); in a wider ``dtype``
    (``gemm_dtype``), x widened once and each chunk of the weight as its GEMM comes, the chunk's
    product (and bias) rounded once into its columns."""
    y = torch.empty(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    xg = x.to(dtype)
    for a in range(0, w.shape[0], chunk):
        z = a + chunk
        if dtype != x.dtype:
            part = torch.mm(xg, w[a:z].to(dtype).t())
            if b is not None:
                part += b[a:z].to(dtype)
            y[:, a:z] = part
        elif b is None:
            torch.mm(x, w[a:z].t(), out=y[:, a:z])
        else:
            torch.addmm(b[a:z], x, w[a:z].t(), out=y[:, a:z])
    return y
