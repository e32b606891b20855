"""Dispatch of ``QuantLinear`` to the packed matmul kernels.

CPU: ``aten._weight_int8pack_mm`` (``x [M, K]``, int8 ``[N, K]``, scales ``[N]`` in x's dtype) and
``aten._weight_int4pack_mm_for_cpu`` (``x [M, K]``, the weight packed by
``aten._convert_weight_to_int4pack_for_cpu`` from int32 codes ``[N, K]`` (N a multiple of 16),
the group size (32/64/128/256), and ``scales_and_zeros [K / G, N, 2]`` in x's dtype meaning
``w = (q - 8) * scale + zero``). Both take float32, bfloat16 and float16 activations in torch 2.13
and return x's dtype. The kernel layouts are built on first use per (device, dtype) and cached
on the module.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from foudre.quant.qlinear import QuantLinear


def _flat(mod: QuantLinear, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    lead = x.shape[:-1]
    x = mod._prepare_input(x).reshape(-1, x.shape[-1])
    return x, tuple(lead)


def _cpu_layout(mod: QuantLinear, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    key = (mod.qweight.device, dtype)
    cached = mod._packed.get(key)
    if cached is not None:
        return cached
    from foudre.quant.qlinear import unpack_int4

    if mod.bits == 8:
        # the bf16 kernel reads K in chunks of 16 and crashes otherwise: pad with zero columns
        k = mod.qweight.shape[1]
        w8 = F.pad(mod.qweight, (0, -k % 16)) if k % 16 else mod.qweight
        layout: tuple[torch.Tensor, ...] = (w8.contiguous(), mod.scales.to(dtype))
    else:
        assert mod.zeros is not None
        n = mod.out_features
        np_ = -(-n // 16) * 16
        q = unpack_int4(mod.qweight).to(torch.int32)
        scales, zeros = mod.scales.float(), mod.zeros.float()
        if np_ != n:
            q = F.pad(q, (0, 0, 0, np_ - n))
            scales = F.pad(scales, (0, 0, 0, np_ - n), value=1.0)
            zeros = F.pad(zeros, (0, 0, 0, np_ - n))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
        sz = torch.stack([scales, (8.0 - zeros) * scales], dim=-1)  # [N, G, 2]
        layout = (packed, sz.transpose(0, 1).contiguous().to(dtype))
    mod._packed[key] = layout
    return layout


def cpu_linear(mod: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """``QuantLinear`` forward through the native CPU packed kernels."""
    out_dtype = x.dtype
    x2, lead = _flat(mod, x)
    if mod.compute_dtype is not None:
        x2 = x2.to(mod.compute_dtype)
    x2 = x2.contiguous()
    w, s = _cpu_layout(mod, x2.dtype)
    if mod.bits == 8:
        if w.shape[1] != x2.shape[1]:
            x2 = F.pad(x2, (0, w.shape[1] - x2.shape[1]))
        y = torch.ops.aten._weight_int8pack_mm(x2, w, s)
    else:
        assert mod.group_size is not None
        kp = s.shape[0] * mod.group_size
        if kp != x2.shape[1]:
            x2 = F.pad(x2, (0, kp - x2.shape[1]))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w, mod.group_size, s)
        if y.shape[1] != mod.out_features:
            y = y[:, : mod.out_features]
    y = y.to(out_dtype)
    if mod.bias is not None:
        y = y + mod.bias.to(y.dtype)
    return y.reshape(*lead, mod.out_features)


def cuda_linear(mod: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """``QuantLinear`` forward on CUDA: the Triton dequantize-matmul when Triton imports,
    else the dequantize reference."""
    try:
        from foudre.quant import triton_kernels
    except ImportError:
        return mod.forward_reference(x)
    x2, lead = _flat(mod, x)
    y = triton_kernels.quant_matmul(mod, x2)
    if mod.bias is not None:
        y = y + mod.bias.to(y.dtype)
    return y.reshape(*lead, mod.out_features)
