"""Fused CPU versions of the layers' elementwise chains (``cpu_ops.cpp``): RMSNorm, SiLU(gate) *
up and RoPE, for float32 and bfloat16 tensors on an AVX-512 CPU; and ``linear``, the
decode-sized matrix product that ``layers/linear.py`` routes to.

Each replaces several torch ops (RMSNorm alone is eight, each a pass over memory and a dispatch)
and rounds where those ops round (RoPE bit for bit, the others within a few float32 ulps before
the final rounding: a sum in another order, a reciprocal for a division). In a bf16 decode step
of the 500M benchmark model at 64 rows, the torch chains took about 0.4 ms per layer and the
fused ops 0.15; the 64-request throughput run gains about 3.5%. ``enabled(x)`` says whether a
tensor takes the fused path: on the CPU, float32 or bfloat16, the library built, not switched
off with ``FOUDRE_FUSED_CPU_OPS=0``, and no autograd recording. The torch code stays beside each
call as the reference and the fallback.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from foudre.layers import native

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "foudre_rms_norm": [_P, _P, _P, _I64, _I64, _I64, _F],
    "foudre_silu_mul": [_P, _P, _I64, _I64, _I64],
    "foudre_rope": [_P, _P, _P, _P, _I64, _I64, _I64, _I64],
    "foudre_linear": [_P, _I64, _P, _P, _P, _I64, _I64, _I64],
    # x, rows, layers, num_layers, hidden, heads, kv_heads, head_dim, intermediate, eps;
    # cos, sin, max_positions, positions, slots, num_slots;
    # attention, tokens, tables, lens, table_width, block_size, scale
    "foudre_decode_layers": [
        *[_P, _I64, _P, *[_I64] * 6, _F],
        *[_P, _P, _I64, _P, _P, _I64],
        *[*[_P] * 4, _I64, _I64, _F],
    ],
}


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("FOUDRE_FUSED_CPU_OPS", "1") == "0":
        return None
    dll = native.load(SOURCE)
    if dll is None or not dll.foudre_cpu_ops_available():
        return None  # no compiler, or a CPU without AVX-512
    for name, argtypes in _SIGNATURES.items():
        for dtype, suffix in _SUFFIX.items():
            fn = getattr(dll, f"{name}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int if name == "foudre_decode_layers" else None
            _FNS[name, dtype] = fn
    return dll


# (name, dtype) -> the library's function, filled when it loads: one dict lookup per call, as
# these run between the weight reads of a decode step, when little of Python's state is cached
_FNS: dict[tuple[str, torch.dtype], Any] = {}


def enabled(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether ``x`` (and the ``others`` it is combined with, CPU tensors of its dtype; None
    entries are skipped) take the fused path: never where autograd records (training and
    distillation run the torch ops)."""
    if not x.is_cpu or x.dtype not in _SUFFIX:
        return False
    for o in others:
        if o is not None and (o.dtype != x.dtype or not o.is_cpu):
            return False
    return not records_grad(x, *others) and _library() is not None


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on ``tensors`` (None entries skipped): then only torch's
    ops, which it can differentiate, may run them."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fn(name: str, dtype: torch.dtype) -> Any:
    assert _library() is not None, "the fused CPU ops are not available"
    return _FNS[name, dtype]


def decode_layers_fn(dtype: torch.dtype) -> Any:
    """``foudre_decode_layers`` for ``dtype`` (``runner/cpu_decode.py`` calls it), or None."""
    return None if _library() is None else _FNS.get(("foudre_decode_layers", dtype))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    _fn("foudre_rms_norm", x.dtype)(
        rows.data_ptr(), w.data_ptr(), out.data_ptr(), rows.shape[0], n, rows.stride(0), eps
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` (a ``[T, 2n]`` matrix)."""
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype)
    _fn("foudre_silu_mul", gate_up.dtype)(
        gate_up.data_ptr(), out.data_ptr(), rows, n, gate_up.stride(0)
    )
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotates ``x [T, heads, head_dim]`` in place ("rotate half" convention) at ``positions``,
    with float32 tables ``cos``/``sin`` of ``[max_positions, head_dim]``. The caller checks that
    the positions lie in the tables (``RotaryEmbedding`` does, once per positions tensor)."""
    t, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim, "heads must be contiguous rows"
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    pos = positions if positions.dtype == torch.int64 else positions.to(torch.int64)
    pos = pos.contiguous()
    _fn("foudre_rope", x.dtype)(
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        pos.data_ptr(),
        t,
        heads,
        head_dim,
        x.stride(0),
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x`` (``[rows, k]``) of a decode-sized batch,
    reading each weight row once for all the rows; float32 sums, one rounding to the dtype at the
    end. ``x``, ``weight`` and ``bias`` must share a dtype and be CPU tensors (``enabled(x,
    weight, bias)`` says so)."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"linear: x of shape {tuple(x.shape)} for a weight of [{n}, {k}]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear: bias of shape {tuple(bias.shape)} for {n} outputs")
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(t.dtype != x.dtype or t.device.type != "cpu" for t in tensors):
        raise ValueError("linear: x, weight and bias must be CPU tensors of one dtype")
    return linear_unchecked(
        x if x.stride(-1) == 1 else x.contiguous(),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
    )


def linear_unchecked(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``linear`` without its checks, for callers that made them (``Linear.forward``): ``x``
    ``[rows, k]`` with unit column stride, ``weight`` ``[n, k]`` and ``bias`` ``[n]`` contiguous,
    all CPU tensors of one dtype that ``enabled`` accepts. Anything else reads out of bounds."""
    rows, n = x.shape[0], weight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype)
    if rows:
        _FNS["foudre_linear", x.dtype](
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            rows,
            n,
            weight.shape[1],
        )
    return y
