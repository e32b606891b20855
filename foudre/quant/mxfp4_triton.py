"""Triton kernels for MXFP4 weights on CUDA: ``y [M, N] = x [M, K] @ W^T (+ bias)`` with ``W`` as
``quant.mxfp4`` holds it (``blocks [N, K / 32, 16]``, ``scales [N, K / 32]``, uint8), read
packed and dequantized in registers, never in memory.

A weight row is ``K / 2`` contiguous bytes: byte ``c`` holds columns ``2c`` (low nibble) and
``2c + 1`` (high nibble), its scale is ``scales[n, c // 16]``. So a tile of bytes meets x's
even columns with its low nibbles and x's odd columns with its high ones; no shuffle.
E2M1 codes become floats by arithmetic (twice the magnitude is ``m`` for exponent 0, else
``(2 + m) << (e - 1)``; bit 3 the sign), the scale by placing the E8M0 byte in a float32's
exponent field: both exact.

- ``_gemv_kernel`` (M up to ``GEMV_ROWS``): a program per x row and ``BLOCK_N`` weight rows,
  ``BLOCK_C`` bytes of each row a step, products summed in float32 (no ``tl.dot``).
- ``_gemm_kernel``: ``BLOCK_M x BLOCK_N`` tiles by two ``tl.dot`` a step (even and odd
  columns), the weight tile in x's dtype (exact for bfloat16 and float32; float16 can overflow
  for scales beyond its range), float32 accumulators (IEEE products for float32 x).

- ``fused_experts``: ``MXFP4Experts`` on CUDA, as ``layers.moe_triton`` runs float experts: the
  (token, expert) pairs sorted by expert on the device, a grouped ``tl.dot`` kernel per
  projection (each tile of rows one expert's), bias and routing weight applied in the kernel.

Bias added in float32 before the one rounding to x's dtype. Nothing depends on the data on the
host, so the calls can be captured in CUDA graphs. Imported lazily (Triton is optional); with
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors (how the tests check them without a
GPU: the interpreter's bfloat16 ``tl.dot`` multiplies raw bits, so its tests of the tiled
kernel use float32 and float16).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from foudre.layers.moe_triton import align

GEMV_ROWS = 4  # rows of x up to which the GEMV kernel runs


@triton.jit
def _e2m1(codes):
    """Float32 values of E2M1 codes (int32, 0..15)."""
    e = (codes >> 1) & 3
    m = codes & 1
    twice = tl.where(e == 0, m, (2 + m) << tl.maximum(e - 1, 0))
    value = twice.to(tl.float32) * 0.5
    return tl.where((codes & 8) != 0, -value, value)


@triton.jit
def _e8m0(s):
    """``2^(s - 127)`` in float32 for E8M0 bytes (int32)."""
    bits = tl.where(s > 0, s << 23, 0x00400000)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gemv_kernel(
    x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, N, KB, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    row = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for c0 in range(0, KB, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)  # byte columns: x's columns 2c and 2c + 1
        c_mask = c < KB
        mask = n_mask[:, None] & c_mask[None, :]
        q = tl.load(q_ptr + rn[:, None] * KB + c[None, :], mask=mask, other=0).to(tl.int32)
        s = tl.load(s_ptr + rn[:, None] * (KB // 16) + c[None, :] // 16, mask=mask, other=0)
        xe = tl.load(x_ptr + row * stride_xm + 2 * c, mask=c_mask, other=0.0).to(tl.float32)
        xo = tl.load(x_ptr + row * stride_xm + 2 * c + 1, mask=c_mask, other=0.0).to(tl.float32)
        w = _e2m1(q & 15) * xe[None, :] + _e2m1(q >> 4) * xo[None, :]
        acc += tl.sum(w * _e8m0(s.to(tl.int32)), axis=1)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _tile(
    x_rows, m_mask, q_ptr, s_ptr, rn, n_mask, KB,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """The float32 tile ``[BLOCK_M, BLOCK_N]`` of ``x @ W.T``: ``x_rows`` the tile's rows'
    addresses (``[BLOCK_M, 1]``, in x's dtype, ``m_mask`` the real ones), ``W`` the MXFP4
    weight's byte rows ``rn`` at ``q_ptr`` (``KB`` bytes a row) and their scales at ``s_ptr``;
    each step's block dequantized to x's dtype, one product for the even columns (low
    nibbles) and one for the odd (high)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c0 in range(0, KB, BLOCK_C):
        c = c0 + tl.arange(0, BLOCK_C)
        c_mask = c < KB
        w_mask = n_mask[:, None] & c_mask[None, :]
        q = tl.load(q_ptr + rn[:, None] * KB + c[None, :], mask=w_mask, other=0).to(tl.int32)
        s = tl.load(s_ptr + rn[:, None] * (KB // 16) + c[None, :] // 16, mask=w_mask, other=0)
        scale = _e8m0(s.to(tl.int32))
        lo = (_e2m1(q & 15) * scale).to(x_rows.dtype.element_ty)  # [BLOCK_N, BLOCK_C]
        hi = (_e2m1(q >> 4) * scale).to(x_rows.dtype.element_ty)
        x_mask = m_mask[:, None] & c_mask[None, :]
        xs = x_rows + 2 * c[None, :]
        xe = tl.load(xs, mask=x_mask, other=0.0)
        xo = tl.load(xs + 1, mask=x_mask, other=0.0)
        if IEEE:
            acc += tl.dot(xe, tl.trans(lo), input_precision="ieee")
            acc += tl.dot(xo, tl.trans(hi), input_precision="ieee")
        else:
            acc += tl.dot(xe, tl.trans(lo))
            acc += tl.dot(xo, tl.trans(hi))
    return acc


@triton.jit
def _gemm_kernel(
    x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, KB, stride_xm, stride_ym,
    HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    acc = _tile(
        x_ptr + rm[:, None] * stride_xm, m_mask, q_ptr, s_ptr, rn, n_mask, KB,
        IEEE, BLOCK_M, BLOCK_N, BLOCK_C,
    )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    y = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def matmul(
    x: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    gemv: bool | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W^T (+ bias [N])`` in x's dtype (float32, bfloat16 or float16) for
    ``blocks [N, K / 32, 16]`` and ``scales [N, K / 32]`` on x's device (checked by the caller,
    ``mxfp4.mxfp4_matmul``). ``gemv``: force one kernel (tests); default the GEMV kernel up to
    ``GEMV_ROWS`` rows, the tiled one beyond."""
    m, k = x.shape
    n, kb = blocks.shape[0], k // 2
    x, q, s = x.contiguous(), blocks.contiguous(), scales.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    b = bias.contiguous() if bias is not None else y  # (a pointer never read without bias)
    if gemv if gemv is not None else m <= GEMV_ROWS:
        block_n = 32
        grid = (triton.cdiv(n, block_n), m)
        _gemv_kernel[grid](
            x, q, s, b, y, n, kb, x.stride(0), y.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_C=64,
        )  # fmt: skip
        return y
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 64
    grid2 = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _gemm_kernel[grid2](
        x, q, s, b, y, m, n, kb, x.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_C=32,
    )  # fmt: skip
    return y


# ----------------------------------------------------------------------------- experts


@triton.jit
def _expert_kernel(
    a_ptr, q_ptr, s_ptr, bias_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, total_ptr,
    N, KB, num_rows, a_div, stride_am, stride_cm,
    HAS_BIAS: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """``c[r] = (w[r] *) (a[r // a_div] @ W[e].T (+ bias[e]))`` for the sorted rows ``r`` of
    this program's tile (``r < num_rows``; padding entries equal ``num_rows``), ``e`` the
    tile's expert, ``W[e]`` its MXFP4 weight (``[E, N, KB]`` bytes, ``[E, N, KB / 16]``
    scales)."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    a_rows = (rows // a_div).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    q_base = q_ptr + expert * N * KB
    s_base = s_ptr + expert * N * (KB // 16)
    acc = _tile(
        a_ptr + a_rows[:, None] * stride_am, valid, q_base, s_base, rn, n_mask, KB,
        IEEE, BLOCK_M, BLOCK_N, BLOCK_C,
    )  # fmt: skip
    if HAS_BIAS:
        acc += tl.load(bias_ptr + expert * N + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(
        c_ptr + rows.to(tl.int64)[:, None] * stride_cm + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & n_mask[None, :],
    )


def _expert_gemm(
    a: torch.Tensor,
    blocks: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    weights: torch.Tensor | None,
    routing: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    a_div: int,
    block_m: int,
) -> None:
    sorted_rows, experts, total = routing
    n_out, kb = blocks.shape[1], blocks.shape[2] * 16
    grid = (experts.numel(), triton.cdiv(n_out, 64))
    _expert_kernel[grid](
        a, blocks, scales, bias if bias is not None else out, out,
        weights if weights is not None else out, sorted_rows, experts, total,
        n_out, kb, out.shape[0], a_div, a.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, MUL_WEIGHT=weights is not None,
        IEEE=a.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=64, BLOCK_C=32,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    weights: torch.Tensor,
    ids: torch.Tensor,
    activation: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * (down[e](activation(gate_up[e](x[t]))))``, ``e = ids[t,
    j]``, each projection ``(blocks [E, N, K / 32, 16], scales [E, N, K / 32], bias [E, N] or
    None)`` in MXFP4 (``MXFP4Experts``' buffers), for ``x [T, H]``: the (token, expert) pairs
    sorted by expert on the device (``layers.moe_triton.align``, no host synchronisation: CUDA
    graphs capture it), two grouped launches, ``activation`` in torch between them; x's dtype
    (float32 sums)."""
    t, k = ids.shape
    gu_blocks, gu_scales, gu_bias = gate_up
    d_blocks, d_scales, d_bias = down
    num_experts, two_inter = gu_blocks.shape[0], gu_blocks.shape[1]
    hidden = d_blocks.shape[1]
    x = x.contiguous()
    block_m = 16 if t * k <= 256 else 64
    routing = align(ids, num_experts, block_m)
    h = torch.empty(t * k, two_inter, dtype=x.dtype, device=x.device)
    _expert_gemm(x, gu_blocks, gu_scales, gu_bias, h, None, routing, k, block_m)
    act = activation(h).to(x.dtype).contiguous()
    y = torch.empty(t * k, hidden, dtype=torch.float32, device=x.device)
    w = weights.reshape(-1).to(torch.float32).contiguous()
    _expert_gemm(act, d_blocks, d_scales, d_bias, y, w, routing, 1, block_m)
    return y.view(t, k, hidden).sum(dim=1).to(x.dtype)
