"""Triton dequantize-matmul kernels for ``QuantLinear`` and ``Fp8Linear`` on CUDA, over plain
tensors.

They read the canonical layouts directly (no repacking, ``foudre.quant.packing``): int8
``[N, K]`` with per-row scales; group-wise int8 ``[N, Kp]`` with scales and optional zero points
``[N, Kp / G]``; uint8 ``[N, Kp / 2]`` nibbles (even column low) with group scales and zero
points ``[N, Kp / G]``; float8 e4m3 ``[N, K]`` with per-row scales (``foudre.quant.fp8``).

Two kernels, chosen by the number of activation rows M (``choose_config``):

- ``_gemv_kernel`` (M = 1, decode at batch 1): each program owns ``BLOCK_N`` output rows and one
  of ``SPLIT_K`` slices of K, and streams its weight bytes once, ``BLOCK_KB`` bytes of each row
  per step (coalesced along K). A step is viewed as ``[BLOCK_N, NGT, GT]`` (``NGT`` sub-tiles of
  ``GT`` bytes, each inside one quantization group), so scales and zero points are loaded once
  per row and group, not per element, and applied after the group's dot product:
  ``sum_k x_k (q_k - z) s = s (sum_k x_k q_k - z sum_k x_k)``. Nibbles are not interleaved: the
  low nibbles meet the even columns of x, the high ones the odd columns. Per-row scales (int8,
  fp8) are applied once at the end. Codes become float32 by OR-ing them into the mantissa of
  2^23 and subtracting (``_byte_to_f32``), not by integer-to-float conversions, which run at a
  quarter of the FMA rate and would bound a memory-bound GEMV. Accumulation is float32.
- ``_gemm_kernel`` (M > 1): ``BLOCK_M x BLOCK_N`` tiles of ``y`` by ``tl.dot``, the weight tile
  dequantized in registers (same ``[BLOCK_N, NGT, GT]`` view; int4's nibbles joined back into
  column order) to the activations' dtype (bfloat16 / float16; float32 with IEEE products),
  with the same optional K split. With ``BLOCK_M = 16`` the weights of a small batch (M <= 16)
  are still read once.

With ``SPLIT_K > 1`` every slice writes float32 partial sums ``[SPLIT_K, M, N]`` and
``_reduce_kernel`` adds them in a fixed order (deterministic, unlike atomics), then the bias,
and casts. Nothing depends on the data on the host (no syncs, shapes-only allocations), so the
calls can be captured in CUDA graphs. Imported lazily (Triton is optional); with
``TRITON_INTERPRET=1`` the same kernels run on CPU tensors, which is how the tests check them
without a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes of one call: ``block_m`` 1 runs the GEMV kernel (M must be 1), else the
    ``tl.dot`` kernel. ``block_kb`` counts weight bytes per row per step (two columns per byte
    for int4). ``split_k`` slices of K run in parallel and are reduced in a second pass."""

    block_m: int
    block_n: int
    block_kb: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int | None = None

    def __post_init__(self) -> None:
        sizes = (self.block_m, self.block_n, self.block_kb)
        if any(v < 1 or v & (v - 1) for v in sizes) or self.split_k < 1:
            raise ValueError(f"tile sizes must be powers of two and split_k >= 1: {self}")
        if self.block_m != 1 and min(sizes) < 16:
            raise ValueError(f"tl.dot tiles need block_m, block_n, block_kb >= 16: {self}")


@triton.jit
def _load_weight(ptrs, mask, FP8: tl.constexpr):
    """Weight codes, 0 where masked (float8 as float32: its 0 cannot be an ``other``)."""
    if FP8:
        w = tl.where(mask, tl.load(ptrs, mask=mask).to(tl.float32), 0.0)
    else:
        w = tl.load(ptrs, mask=mask, other=0)
    return w


@triton.jit
def _byte_to_f32(u, offset: tl.constexpr):
    """``u - offset`` as float32 for int32 ``u`` in 0..255, without an integer-to-float
    conversion (a quarter-rate instruction on NVIDIA GPUs, which would bound the GEMV): ``u``
    OR-ed into the mantissa of 2^23 is 2^23 + u exactly."""
    return (u | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + offset)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, p_ptr,
    N, K, KB, stride_wn, stride_sn, TILES,
    BITS: tl.constexpr, GROUP_B: tl.constexpr, GT: tl.constexpr, NGT: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, FP8: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    j = tl.arange(0, NGT)
    t = tl.arange(0, GT)
    acc_rows = tl.zeros((BLOCK_N, NGT, GT), dtype=tl.float32)  # per-row scales: summed at end
    acc_groups = tl.zeros((BLOCK_N, NGT), dtype=tl.float32)  # group scales: applied per step
    for step in range(TILES):
        kb0 = (pid_k * TILES + step) * BLOCK_KB
        kb = kb0 + j[:, None] * GT + t[None, :]  # [NGT, GT] byte columns of the weight
        w_mask = n_mask[:, None, None] & (kb < KB)[None, :, :]
        b = _load_weight(w_ptr + rn[:, None, None] * stride_wn + kb[None, :, :], w_mask, FP8)
        if BITS == 4:
            xe = tl.load(x_ptr + 2 * kb, mask=2 * kb < K, other=0.0).to(tl.float32)
            xo = tl.load(x_ptr + 2 * kb + 1, mask=2 * kb + 1 < K, other=0.0).to(tl.float32)
            bi = b.to(tl.int32)
            lo = _byte_to_f32(bi & 0xF, 0.0)
            hi16 = _byte_to_f32(bi & 0xF0, 0.0)  # 16 * the high nibble: meets x / 16
            d = tl.sum(lo * xe[None, :, :] + hi16 * (xo * 0.0625)[None, :, :], axis=2)
            xs = tl.sum(xe + xo, axis=1)
        else:
            x = tl.load(x_ptr + kb, mask=kb < K, other=0.0).to(tl.float32)
            if FP8:
                w = b
            else:  # int8 q as the byte q + 128, then back
                w = _byte_to_f32(b.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80, 128.0)
            prod = w * x[None, :, :]
            if GROUP_B == 0:
                acc_rows += prod
            else:
                d = tl.sum(prod, axis=2)
                xs = tl.sum(x, axis=1)
        if GROUP_B != 0:
            kg = kb0 + j * GT  # first byte column of each sub-tile
            g = rn[:, None] * stride_sn + kg[None, :] // GROUP_B
            g_mask = n_mask[:, None] & (kg < KB)[None, :]
            s = tl.load(s_ptr + g, mask=g_mask, other=0.0).to(tl.float32)
            if HAS_ZEROS:
                z = tl.load(z_ptr + g, mask=g_mask, other=0.0).to(tl.float32)
                d = d - z * xs[None, :]
            acc_groups += s * d
    if GROUP_B == 0:
        out = tl.sum(tl.sum(acc_rows, axis=2), axis=1)
        out = out * tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    else:
        out = tl.sum(acc_groups, axis=1)
    if PARTIAL:
        tl.store(p_ptr + pid_k * N + rn, out, mask=n_mask)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rn, out.to(y_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _gemm_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, b_ptr, y_ptr, p_ptr,
    M, N, K, KB, stride_xm, stride_ym, stride_wn, stride_sn, TILES,
    BITS: tl.constexpr, GROUP_B: tl.constexpr, GT: tl.constexpr, NGT: tl.constexpr,
    HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, FP8: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KB: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    j = tl.arange(0, NGT)
    cdt = tl.float32 if IEEE else x_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(TILES):
        kb0 = (pid_k * TILES + step) * BLOCK_KB
        kb = kb0 + tl.arange(0, BLOCK_KB)
        w_mask = n_mask[:, None] & (kb < KB)[None, :]
        b = _load_weight(w_ptr + rn[:, None] * stride_wn + kb[None, :], w_mask, FP8)
        b = tl.reshape(b, (BLOCK_N, NGT, GT))
        if GROUP_B != 0:
            kg = kb0 + j * GT
            g = rn[:, None] * stride_sn + kg[None, :] // GROUP_B
            g_mask = n_mask[:, None] & (kg < KB)[None, :]
            s = tl.load(s_ptr + g, mask=g_mask, other=0.0).to(tl.float32)[:, :, None]
            if HAS_ZEROS:
                z = tl.load(z_ptr + g, mask=g_mask, other=0.0).to(tl.float32)[:, :, None]
        x_rows = x_ptr + rm[:, None] * stride_xm
        if BITS == 4:
            bi = b.to(tl.int32)
            lo = _byte_to_f32(bi & 0xF, 0.0)
            hi = _byte_to_f32(bi >> 4, 0.0)
            if HAS_ZEROS:
                lo = lo - z
                hi = hi - z
            # interleaved back to column order: [BLOCK_N, 2 * BLOCK_KB] against contiguous x
            w = tl.reshape(tl.join(lo * s, hi * s), (BLOCK_N, 2 * BLOCK_KB)).to(cdt)
            kc = 2 * kb0 + tl.arange(0, 2 * BLOCK_KB)
            x_mask = m_mask[:, None] & (kc < K)[None, :]
            x = tl.load(x_rows + kc[None, :], mask=x_mask, other=0.0).to(cdt)
        else:
            if FP8:
                w = b
            else:
                w = _byte_to_f32(b.to(tl.uint8, bitcast=True).to(tl.int32) ^ 0x80, 128.0)
            if GROUP_B != 0:
                if HAS_ZEROS:
                    w = w - z
                w = w * s
            w = tl.reshape(w, (BLOCK_N, BLOCK_KB)).to(cdt)
            x_mask = m_mask[:, None] & (kb < K)[None, :]
            x = tl.load(x_rows + kb[None, :], mask=x_mask, other=0.0).to(cdt)
        if IEEE:  # both layouts: x [BLOCK_M, columns] against w [BLOCK_N, columns]
            acc += tl.dot(x, tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    if GROUP_B == 0:
        acc = acc * tl.load(s_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    mn_mask = m_mask[:, None] & n_mask[None, :]
    if PARTIAL:
        tl.store(p_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mn_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        out = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], out, mask=mn_mask)


@triton.jit
def _reduce_kernel(
    p_ptr, b_ptr, y_ptr, M, N, stride_ym, SPLIT_K,
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_mask = rn < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(p_ptr + (s * M + pid_m) * N + rn, mask=n_mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + pid_m * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=n_mask)


# Rows up to which the dot kernel keeps BLOCK_M = 16 (every weight read once per call).
SMALL_BATCH = 16


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: a few programs are plenty
    return torch.cuda.get_device_properties(device).multi_processor_count


def choose_config(m: int, n: int, kb: int, device: torch.device) -> KernelConfig:
    """The tiles for ``M x N`` outputs over ``kb`` weight bytes per row: GEMV at one row, 16-row
    dot tiles up to ``SMALL_BATCH`` rows, larger tiles beyond; K split until the grid fills the
    device about four times over (a split keeps at least two steps). First guesses, not yet
    timed on a GPU: ``benchmarks/quant_gemv_cuda.py --sweep`` times the alternatives."""
    if m == 1:
        cfg = KernelConfig(1, 16, 256)
    elif m <= SMALL_BATCH:
        cfg = KernelConfig(16, 64, 128)
    elif m <= 64:
        cfg = KernelConfig(32 if m <= 32 else 64, 64, 64)
    else:
        cfg = KernelConfig(128, 128, 64, num_warps=8, num_stages=3)
    tiles = triton.cdiv(kb, cfg.block_kb)
    programs = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
    split = min(triton.cdiv(4 * _num_sms(device), programs), max(1, tiles // 2))
    if m > 64:  # prefill-sized: enough tiles already; split-K would only add a pass
        split = 1
    return KernelConfig(
        cfg.block_m, cfg.block_n, cfg.block_kb, max(1, split), cfg.num_warps, cfg.num_stages
    )


def _check_group(group_size: int) -> None:
    if group_size < 2 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two, got {group_size}")


def _check_operands(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int | None,
    bias: torch.Tensor | None,
) -> tuple[int, int, int]:
    """``(bits, group_b, columns)``: the weight's bits, its group in bytes (0 per channel) and
    its columns padded to the groups, once ``x`` and the buffers are checked against it."""
    _, k = x.shape
    n, kb = qweight.shape
    bits = 4 if qweight.dtype == torch.uint8 else 8
    group_b = 0
    if group_size is not None:
        group_b = group_size // 2 if bits == 4 else group_size
        _check_group(group_size)
    elif bits == 4:
        raise ValueError("a 4-bit qweight needs group_size")
    if bits == 4 and zeros is None:
        raise ValueError("a 4-bit qweight needs zeros")
    columns = kb * (2 if bits == 4 else 1)  # Kp: K rounded up to the group size
    if not columns - (group_size or 1) < k <= columns:
        raise ValueError(f"x has {k} columns; the weight holds {columns} (padded to its groups)")
    want = (n,) if group_size is None else (n, columns // group_size)
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t is not None and tuple(t.shape) != want:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, the weight needs {want}")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}, the weight needs ({n},)")
    return bits, group_b, columns


def _launch(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bias: torch.Tensor | None,
    bits: int,
    group_b: int,
    cfg: KernelConfig,
) -> torch.Tensor:
    """Run the GEMV (``block_m`` 1) or GEMM kernel with ``cfg``'s tiles, and the reduction of
    the split-K partial sums when K is split."""
    m, k = x.shape
    n, kb = qweight.shape
    gt = cfg.block_kb if group_b == 0 else min(group_b, cfg.block_kb)
    tiles = triton.cdiv(triton.cdiv(kb, cfg.block_kb), cfg.split_k)
    split = triton.cdiv(triton.cdiv(kb, cfg.block_kb), tiles)  # no empty slices
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    partial = split > 1
    p = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if partial else y
    z = zeros if zeros is not None else scales
    b = bias if bias is not None else scales
    s_stride = scales.stride(0) if group_b else 1
    opts = {"num_warps": cfg.num_warps}
    if cfg.num_stages is not None:
        opts["num_stages"] = cfg.num_stages
    common = dict(
        BITS=bits, GROUP_B=group_b, GT=gt, NGT=cfg.block_kb // gt, HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None, PARTIAL=partial, FP8=qweight.dtype == torch.float8_e4m3fn,
        BLOCK_N=cfg.block_n, BLOCK_KB=cfg.block_kb,
    )  # fmt: skip
    if cfg.block_m == 1:
        _gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
            x, qweight, scales, z, b, y, p, n, k, kb, qweight.stride(0), s_stride, tiles,
            **common, **opts,
        )  # fmt: skip
    else:
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), split)
        _gemm_kernel[grid](
            x, qweight, scales, z, b, y, p, m, n, k, kb, x.stride(0), y.stride(0),
            qweight.stride(0), s_stride, tiles,
            IEEE=x.dtype == torch.float32, BLOCK_M=cfg.block_m, **common, **opts,
        )  # fmt: skip
    if partial:
        block = 256
        _reduce_kernel[(m, triton.cdiv(n, block))](
            p, b, y, m, n, y.stride(0), split, HAS_BIAS=bias is not None, BLOCK=block
        )
    return y


def quant_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int | None,
    bias: torch.Tensor | None = None,
    config: KernelConfig | None = None,
) -> torch.Tensor:
    """``x [M, K] @ W.T + bias`` in x's dtype for the canonical buffers of a weight ``[N, ...]``:
    int8 ``qweight`` per channel (``group_size`` None) or group-wise (``zeros`` optional),
    uint8 ``qweight`` 4-bit packed (``zeros`` required), float8 e4m3 ``qweight`` per channel.
    ``config`` fixes the tiles (default ``choose_config``)."""
    if qweight.dtype not in (torch.int8, torch.uint8, torch.float8_e4m3fn) or qweight.dim() != 2:
        raise ValueError(f"qweight must be 2-D int8, uint8 or float8_e4m3fn, got {qweight.dtype}")
    x, qweight, scales = x.contiguous(), qweight.contiguous(), scales.contiguous()
    zeros = zeros.contiguous() if zeros is not None else None  # indexed as the scales are
    bias = bias.contiguous() if bias is not None else None
    bits, group_b, columns = _check_operands(x, qweight, scales, zeros, group_size, bias)
    m, n, kb = x.shape[0], qweight.shape[0], qweight.shape[1]
    if m == 0 or n == 0:
        return torch.zeros(m, n, dtype=x.dtype, device=x.device)
    # the kernels' offsets are int32: cut a batch whose [M, N] or [M, K] would overflow them
    rows = (2**31 - 1) // max(n, columns)
    if m > rows:
        return torch.cat(
            [
                quant_matmul(x[i : i + rows], qweight, scales, zeros, group_size, bias, config)
                for i in range(0, m, rows)
            ]
        )
    cfg = config or choose_config(m, n, kb, x.device)
    if cfg.block_m == 1 and m != 1:
        raise ValueError(f"the GEMV config (block_m 1) takes one row, got {m}")
    return _launch(x, qweight, scales, zeros, bias, bits, group_b, cfg)
