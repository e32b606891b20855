"""Triton dequantize-matmul kernels for ``QuantLinear`` on CUDA (int8 per channel, int4 groups),
over plain tensors.

They read the canonical layouts directly (no repacking): int8 ``[N, K]`` with per-row scales;
uint8 ``[N, Kp / 2]`` nibbles (even column low) with group scales and zero points ``[N, Kp / G]``.
Each program computes a ``BLOCK_M x BLOCK_N`` tile of ``y = x @ W.T``, dequantizing a
``BLOCK_K x BLOCK_N`` slice of ``W`` to float32 in registers per step; accumulation is float32.
Imported lazily (Triton is optional); with ``TRITON_INTERPRET=1`` the same kernels run on CPU
tensors, which is how the tests check them without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int8_kernel(
    x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :],
            mask=(rm[:, None] < M) & (rk[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        q = tl.load(
            w_ptr + rn[None, :] * K + rk[:, None],
            mask=(rn[None, :] < N) & (rk[:, None] < K),
            other=0,
        ).to(tl.float32)
        if IEEE:
            acc += tl.dot(x, q, input_precision="ieee")
        else:
            acc += tl.dot(x, q)
    s = tl.load(s_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)
    acc = acc * s[None, :]
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


@triton.jit
def _int4_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, y_ptr, M, N, K, KP, G, stride_xm, stride_ym,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ngroups = KP // G
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(
            x_ptr + rm[:, None] * stride_xm + rk[None, :],
            mask=(rm[:, None] < M) & (rk[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        wmask = (rn[None, :] < N) & (rk[:, None] < K)
        b = tl.load(w_ptr + rn[None, :] * (KP // 2) + rk[:, None] // 2, mask=wmask, other=0)
        q = ((b.to(tl.int32) >> ((rk[:, None] % 2) * 4)) & 0xF).to(tl.float32)
        g = rn[None, :] * ngroups + rk[:, None] // G
        s = tl.load(s_ptr + g, mask=wmask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + g, mask=wmask, other=0.0).to(tl.float32)
        w = (q - z) * s
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    tl.store(
        y_ptr + rm[:, None] * stride_ym + rn[None, :],
        acc.to(y_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rn[None, :] < N),
    )


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int | None,
) -> torch.Tensor:
    """``x [M, K] @ W.T`` (no bias) for the canonical buffers of an 8-bit (``zeros`` None) or
    4-bit (``zeros`` and ``group_size`` given) weight ``[N, ...]``; x's dtype."""
    x = x.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 32
    block_n, block_k = 64, 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    ieee = x.dtype == torch.float32
    if zeros is None:
        _int8_kernel[grid](
            x, qweight, scales, y, m, n, k, x.stride(0), y.stride(0),
            IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )  # fmt: skip
    else:
        assert group_size is not None
        kp = qweight.shape[1] * 2
        _int4_kernel[grid](
            x, qweight, scales, zeros, y, m, n, k, kp, group_size,
            x.stride(0), y.stride(0),
            IEEE=ieee, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        )  # fmt: skip
    return y
