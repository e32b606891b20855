"""The packed matmul kernels of ``QuantLinear`` on the CPU, over plain tensors.

CPU: ``aten._weight_int8pack_mm`` (``x [M, K]``, int8 ``[N, K]``, scales ``[N]`` in x's dtype) and
``aten._weight_int4pack_mm_for_cpu`` (``x [M, K]``, the weight packed by
``aten._convert_weight_to_int4pack_for_cpu`` from int32 codes ``[N, K]`` (N a multiple of 16),
the group size (32/64/128/256), and ``scales_and_zeros [K / G, N, 2]`` in x's dtype meaning
``w = (q - 8) * scale + zero``). Both take float32, bfloat16 and float16 activations in torch 2.13
and return x's dtype. ``cpu_layout`` builds the kernel layout from the canonical buffers
(``foudre.quant.packing``); ``QuantLinear`` builds it on first use per (device, dtype) and caches
it on the module.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from foudre.quant.packing import unpack_int4


def cpu_layout(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """The CPU kernels' (weight, scales) for the canonical buffers of an 8-bit (``zeros`` None)
    or 4-bit weight, for activations in ``dtype``."""
    if zeros is None:
        # the bf16 kernel reads K in chunks of 16 and crashes otherwise: pad with zero columns
        k = qweight.shape[1]
        w8 = F.pad(qweight, (0, -k % 16)) if k % 16 else qweight
        return (w8.contiguous(), scales.to(dtype))
    n = qweight.shape[0]
    np_ = -(-n // 16) * 16
    q = unpack_int4(qweight).to(torch.int32)
    s, z = scales.float(), zeros.float()
    if np_ != n:
        q = F.pad(q, (0, 0, 0, np_ - n))
        s = F.pad(s, (0, 0, 0, np_ - n), value=1.0)
        z = F.pad(z, (0, 0, 0, np_ - n))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1)
    sz = torch.stack([s, (8.0 - z) * s], dim=-1)  # [N, G, 2]
    return (packed, sz.transpose(0, 1).contiguous().to(dtype))


def cpu_matmul(
    x: torch.Tensor,
    layout: tuple[torch.Tensor, ...],
    group_size: int | None,
    out_features: int,
) -> torch.Tensor:
    """``x [M, K] @ W.T`` (no bias; ``x`` contiguous, in the dtype ``layout`` was built for)
    through the native CPU packed kernels: int8 when ``group_size`` is None, else int4.
    ``[M, out_features]`` in x's dtype."""
    w, s = layout
    if group_size is None:
        if w.shape[1] != x.shape[1]:
            x = F.pad(x, (0, w.shape[1] - x.shape[1]))
        return torch.ops.aten._weight_int8pack_mm(x, w, s)
    kp = s.shape[0] * group_size
    if kp != x.shape[1]:
        x = F.pad(x, (0, kp - x.shape[1]))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, w, group_size, s)
    if y.shape[1] != out_features:
        y = y[:, :out_features]
    return y
