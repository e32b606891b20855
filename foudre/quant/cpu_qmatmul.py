"""Our native CPU kernels for weight-only quantized linears at decode-sized batches
(``cpu_qmatmul.cpp``): ``y [M, N] = x [M, K] @ dequant(W)^T`` for the int8 (per channel, or
group-wise with one scale per group of columns as GGUF's Q8_0) and int4 group-wise weights of
``foudre.quant.packing``, x float32 or bfloat16, y in x's dtype.

Each task streams a few packed weight rows once for every row of x. With AVX512-VNNI the
activations are quantized to int8 per block of 32 columns (as llama.cpp's Q8_0) and multiplied
by vpdpbusd, so results differ from dequantize-then-matmul by that rounding (each x within half
its block's ``max|x| / 127``); the AVX-512 path without VNNI and the portable one multiply in
float32. ``layout`` repacks the canonical buffers once (``QuantLinear`` caches it); ``matmul``
runs it. ``path()`` names the path the library was built with, None where it did not build.
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from foudre.layers import native
from foudre.quant.packing import unpack_int4

SOURCE = Path(__file__).with_name("cpu_qmatmul.cpp")
PATHS = ("portable", "avx512", "vnni")
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    dll = native.load(SOURCE)
    if dll is None:
        return None
    for suffix in DTYPES.values():
        getattr(dll, f"foudre_qmm_int8_{suffix}").argtypes = [_P, _P, _P, _P, *[_I64] * 3]
        int8g = [_P, _P, _P, _I64, _I64, _P, *[_I64] * 3]
        getattr(dll, f"foudre_qmm_int8g_{suffix}").argtypes = int8g
        getattr(dll, f"foudre_qmm_int4_{suffix}").argtypes = [
            *[_P] * 4,
            _I64,
            _I64,
            _P,
            *[_I64] * 3,
        ]
    return dll


def path() -> str | None:
    """``"vnni"``, ``"avx512"`` or ``"portable"``: the path the library was built for; None
    where it did not build."""
    dll = _library()
    return None if dll is None else PATHS[dll.foudre_qmm_path()]


def layout(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int | None
) -> tuple[torch.Tensor, ...]:
    """The kernels' layout of the canonical buffers: int8 ``(q [N, K64], s [N])``, K padded
    with zero columns to a multiple of 64 (group-wise int8: ``s`` float32 ``[N, ceil(K64 / G)]``,
    zero-padded); int4 ``(paired nibbles [N, K128 / 2], s, s * z)`` (float32
    ``[N, ceil(K128 / G)]``, zero-padded), each 128 columns as 64 bytes, column ``i`` in the low
    nibble of byte ``i`` and column ``64 + i`` in its high nibble. Where K is already a multiple
    of 64 and the scales float32, the int8 layouts are the buffers themselves (no copy)."""
    if zeros is None:
        k = qweight.shape[1]
        q8 = F.pad(qweight, (0, -k % 64)) if k % 64 else qweight
        s = scales.float()
        if s.dim() == 2:
            assert group_size is not None
            groups = -(-q8.shape[1] // group_size)
            s = F.pad(s, (0, groups - s.shape[1])) if groups != s.shape[1] else s
        return (q8.contiguous(), s.contiguous())
    assert group_size is not None
    q = unpack_int4(qweight)
    n, kp = q.shape
    k128 = -(-kp // 128) * 128
    q = F.pad(q, (0, k128 - kp)).reshape(n, k128 // 128, 2, 64)
    paired = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k128 // 2)
    groups = -(-k128 // group_size)
    s, z = scales.float(), zeros.float()
    pad = (0, groups - s.shape[1])
    return (paired.contiguous(), F.pad(s, pad).contiguous(), F.pad(s * z, pad).contiguous())


def error_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A bound ``[M, N]`` on ``|matmul(x, layout(W)) - x @ w.T|`` for float32 ``x [M, K]`` and
    the dequantized weight ``w [N, K]``, float32 outputs: the float32 sums' order
    (``1e-5 sum |x| |w|``) and, on the VNNI path, the rounding of x to int8 per block of 32
    columns (each x within ``d / 2``, ``d = max|x| / 127`` over its block)."""
    x, aw = x.float(), w.float().abs()
    bound = 1e-5 * (x.abs() @ aw.t()) + 1e-6
    if path() == "vnni":
        k = x.shape[1]
        d = F.pad(x, (0, -k % 32)).abs().reshape(x.shape[0], -1, 32).amax(-1) / 127
        bound = bound + (d.repeat_interleave(32, dim=1)[:, :k] / 2) @ aw.t()
    return bound


def matmul(
    x: torch.Tensor, packed: tuple[torch.Tensor, ...], group_size: int | None
) -> torch.Tensor:
    """``x [M, K] @ W^T`` (no bias) for a ``layout``; ``x`` float32 or bfloat16 on the CPU.
    ``[M, N]`` in x's dtype. The layout says which weight: int8 per channel (two tensors, 1-D
    scales), int8 group-wise (two, 2-D scales, ``group_size`` the group) or int4 (three)."""
    dll = _library()
    if dll is None:
        raise RuntimeError(f"{SOURCE.name} did not build: use the aten kernels (quant.kernels)")
    if x.dtype not in DTYPES or x.device.type != "cpu" or x.dim() != 2:
        raise ValueError(f"x must be a 2-D float32 or bfloat16 CPU tensor, got {x.dtype} {x.shape}")
    w = packed[0]
    int8 = len(packed) == 2
    k = w.shape[1] if int8 else w.shape[1] * 2
    if x.shape[1] > k:
        raise ValueError(f"x has {x.shape[1]} columns, the weight {k} (padded)")
    x = (F.pad(x, (0, k - x.shape[1])) if x.shape[1] != k else x).contiguous()
    m, out_features = x.shape[0], w.shape[0]
    y = torch.empty(m, out_features, dtype=x.dtype)
    if m == 0:
        return y
    fn: Any
    suffix = DTYPES[x.dtype]
    if int8 and packed[1].dim() == 1:
        fn = getattr(dll, f"foudre_qmm_int8_{suffix}")
        fn(x.data_ptr(), w.data_ptr(), packed[1].data_ptr(), y.data_ptr(), m, out_features, k)
    elif int8:
        s = packed[1]
        if group_size is None or group_size % 32 or s.shape[1] * group_size < k:
            raise ValueError(
                f"group-wise int8 scales {tuple(s.shape)} do not cover {k} columns in groups "
                f"of {group_size} (a multiple of 32)"
            )
        fn = getattr(dll, f"foudre_qmm_int8g_{suffix}")
        fn(
            x.data_ptr(), w.data_ptr(), s.data_ptr(), s.shape[1], group_size, y.data_ptr(),
            m, out_features, k,
        )  # fmt: skip
    else:
        s, sz = packed[1], packed[2]
        fn = getattr(dll, f"foudre_qmm_int4_{suffix}")
        fn(
            x.data_ptr(),
            w.data_ptr(),
            s.data_ptr(),
            sz.data_ptr(),
            s.shape[1],
            group_size,
            y.data_ptr(),
            m,
            out_features,
            k,
        )
    return y
