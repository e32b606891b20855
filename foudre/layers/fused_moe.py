"""gpt-oss's routed experts at decode sizes in one native call (``native/cpu_moe.cpp``, the
driver ``native/cpu_moe_experts.h``; its MXFP4 twin is ``quant/mxfp4.native_experts``).

``ClampedSwiGLUExperts`` run as ``grouped_experts`` costs a dozen torch ops and two linear calls
per expert a token chose (the biases, the clamped SwiGLU, the weighted sum), most of a batch-1
decode step's time beside the weights' bytes. ``gpt_oss_experts`` does the same in one call:
only the chosen experts' weights read, each weight row once for all the rows routed to its
expert (4 at a time), float32 sums; the activation rounds as torch's ops do in x's dtype, and
the experts' outputs are added in float32 in increasing expert order, then rounded once, as
``grouped_experts`` adds them. The products sum in another order than ``layers/linear``'s
kernel: equal to the torch path within a rounding of x's dtype (bit for bit where no sum rounds
differently).
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import Any

import torch

from foudre.native import build as native

SOURCE = native.SOURCES / "cpu_moe.cpp"
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
# x, rows, hidden, inter, ids, weights, top_k, gate_up, gate_up_bias, down, down_bias, experts,
# alpha, limit, out
_ARGS = [_P, _I64, _I64, _I64, _P, _P, _I64, _P, _P, _P, _P, _I64, _F, _F, _P]
# x, rows, hidden, inter, ids, weights, top_k, table, scales_bf16, bias_bf16, experts, alpha,
# limit, out
_INT8_ARGS = [_P, _I64, _I64, _I64, _P, _P, _I64, _P, ctypes.c_int, ctypes.c_int, _I64, _F, _F, _P]
_FNS: dict[torch.dtype, Any] = {}
_INT8_FNS: dict[torch.dtype, Any] = {}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("FOUDRE_FUSED_CPU_OPS", "1") == "0":  # (as layers/fused.py: torch's ops)
        return None
    dll = native.load(SOURCE)
    if dll is None:
        return None
    for dtype, suffix in _SUFFIX.items():
        fn = getattr(dll, f"foudre_gpt_oss_experts_{suffix}")
        fn.argtypes, fn.restype = _ARGS, ctypes.c_int
        _FNS[dtype] = fn
        fn = getattr(dll, f"foudre_gpt_oss_int8_experts_{suffix}")
        fn.argtypes, fn.restype = _INT8_ARGS, ctypes.c_int
        _INT8_FNS[dtype] = fn
    return dll


def available(x: torch.Tensor, *tensors: torch.Tensor | None) -> bool:
    """Whether ``x`` and the ``tensors`` (None skipped) take the native call: CPU tensors of one
    dtype, float32 or bfloat16, the library built, nothing autograd records."""
    if x.device.type != "cpu" or x.dtype not in _SUFFIX:
        return False
    for t in tensors:
        if t is not None and (t.dtype != x.dtype or t.device.type != "cpu"):
            return False
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, *tensors)):
        return False
    return _library() is not None


def check_routing(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> None:
    """``ValueError`` naming the tensor unless ``x`` is ``[T, H]`` and ``weights``, ``ids``
    ``[T, k]``."""
    if x.dim() != 2:
        raise ValueError(f"experts: x [T, hidden] expected, got {tuple(x.shape)}")
    if ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(
            f"experts: ids and weights [{x.shape[0]}, k] expected, got ids {tuple(ids.shape)}, "
            f"weights {tuple(weights.shape)}"
        )


def gpt_oss_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down: torch.Tensor,
    down_bias: torch.Tensor | None,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """``sum_j weights[t, j] * expert(ids[t, j], x[t])`` of ``ClampedSwiGLUExperts`` for ``x``
    ``[T, H]``: ``gate_up`` ``[E, 2I, H]`` (gate rows, then up rows), ``down`` ``[E, H, I]``,
    biases ``[E, 2I]``, ``[E, H]`` or None, all of x's dtype on the CPU (``available``);
    ``weights`` ``[T, k]`` (float32 sums), ``ids`` ``[T, k]``. ``ValueError`` naming a tensor of
    the wrong shape, ``IndexError`` for an id outside ``0..E``."""
    check_routing(x, weights, ids)
    e, two_i, h = gate_up.shape
    if x.shape[1] != h or tuple(down.shape) != (e, h, two_i // 2):
        raise ValueError(
            f"experts: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down "
            f"{tuple(down.shape)} do not fit"
        )
    for name, b, size in (("gate_up_bias", gate_up_bias, two_i), ("down_bias", down_bias, h)):
        if b is not None and tuple(b.shape) != (e, size):
            raise ValueError(f"experts: {name} [{e}, {size}] expected, got {tuple(b.shape)}")
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    gub = None if gate_up_bias is None else gate_up_bias.contiguous()
    db = None if down_bias is None else down_bias.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    assert _library() is not None, "cpu_moe.cpp did not build (check available() first)"
    failed = _FNS[x.dtype](
        x.data_ptr(), x.shape[0], h, two_i // 2, ids.data_ptr(), weights.data_ptr(),
        ids.shape[1], gate_up.data_ptr(), None if gub is None else gub.data_ptr(),
        down.data_ptr(), None if db is None else db.data_ptr(), e, alpha, limit, out.data_ptr(),
    )  # fmt: skip
    if failed:
        raise IndexError(f"experts: an expert id outside 0..{e}")
    return out


def gpt_oss_int8_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    table: torch.Tensor,
    inter: int,
    scales_bf16: bool,
    bias_bf16: bool,
    alpha: float,
    limit: float,
) -> torch.Tensor:
    """``gpt_oss_experts`` over experts quantized to int8 per output channel (``w = q * s``),
    the codes widened to float32 (x not rounded). ``table`` int64 ``[E, 6]``: per expert the
    addresses of its gate_up codes ``[2I, H]`` int8, scales ``[2I]``, bias ``[2I]`` (or 0), down
    codes ``[H, I]``, scales ``[H]``, bias ``[H]`` (or 0), contiguous CPU tensors that the
    caller keeps alive, scales and biases bfloat16 where ``scales_bf16`` / ``bias_bf16``, else
    float32 (``quant/experts.QuantExperts`` builds it). ``IndexError`` for an id outside
    ``0..E``."""
    check_routing(x, weights, ids)
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != 6:
        raise ValueError(f"experts: table int64 [E, 6] expected, got {tuple(table.shape)}")
    x, ids = x.contiguous(), ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    assert _library() is not None, "cpu_moe.cpp did not build (check available() first)"
    e = table.shape[0]
    failed = _INT8_FNS[x.dtype](
        x.data_ptr(), x.shape[0], x.shape[1], inter, ids.data_ptr(), weights.data_ptr(),
        ids.shape[1], table.data_ptr(), int(scales_bf16), int(bias_bf16), e, alpha, limit,
        out.data_ptr(),
    )  # fmt: skip
    if failed:
        raise IndexError(f"experts: an expert id outside 0..{e}")
    return out
