"""gpt-oss's parts of the native CPU decode step (``runner/cpu_decode.py``; the C++ is
``native/decode_gpt_oss.h``): what its layers add to Llama's, and what the step checks of them.

- attention: the sliding window of its alternate layers and each head's sink logit, applied by the
  paged kernel's windowed variant (``NAME_window`` over a float cache, ``NAME_CODES_sinks`` over
  a quantized one), the one its Python path calls, with the sinks widened to float32 as
  ``attention.base.check_sinks`` widens them (a copy made at the build, the parameter's address
  and version checked each step); the window's layers read their cache group's tables (kGroup);
- its sparse block: the router's bias, ``route``, the counts, then the experts' own kernel by
  address (``native/cpu_moe.cpp``'s float and int8 ones, ``native/cpu_mxfp4.cpp``'s MXFP4 one),
  with the arguments their modules' forward passes (``ClampedSwiGLUExperts``, ``QuantExperts``
  on its int8 table, ``MXFP4Experts``): the same kernels, so the same bits. Experts that their
  forward would not run natively (another activation, layout or dtype) leave the model in Python.
"""

from __future__ import annotations

import ctypes
import struct
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from foudre.attention import cpu_paged
from foudre.attention.kv_quant import STORAGE_DTYPES
from foudre.attention.quantized_cache import QuantizedKVCache
from foudre.layers import fused_moe
from foudre.layers.linear import Linear
from foudre.layers.moe import ClampedSwiGLUExperts, SparseMoeBlock, swiglu_params
from foudre.models.llama import DecodeParts
from foudre.quant import mxfp4
from foudre.quant.experts import QuantExperts
from foudre.quant.mxfp4 import MXFP4Experts
from foudre.quant.qlinear import QuantLinear

# the entries a layer adds (kWindow, kSinks, kOssAttention, kRouterBias, kOssExperts)
ENTRIES = 5
_KIND = {ClampedSwiGLUExperts: 0, QuantExperts: 1, MXFP4Experts: 2}  # OssKind


def experts_kinds() -> tuple[type[nn.Module], ...]:
    """The experts modules whose kernels the step calls (in gpt-oss's layers only)."""
    return tuple(_KIND)


def _experts(parts: DecodeParts) -> nn.Module | None:
    mlp = parts.mlp
    return mlp.experts if isinstance(mlp, SparseMoeBlock) else None


def inside(layers: Sequence[DecodeParts]) -> set[nn.Module]:
    """The modules inside gpt-oss's int8 experts (their projections, which ``supported`` checks:
    the step calls the experts' kernel, never them)."""
    found: set[nn.Module] = set()
    for parts in layers:
        experts = _experts(parts)
        if isinstance(experts, QuantExperts) and parts.attention_window:
            found.update(m for m in experts.modules() if m is not experts)
    return found


def supported(model: Any, layers: Sequence[DecodeParts], dtype: torch.dtype) -> bool:
    """Whether every layer's gpt-oss parts are what the C++ runs: experts of ``experts_kinds``
    only in gpt-oss's layers (``attention_window``), each of them as its forward runs natively
    at decode sizes (``_descriptor``), behind a float router (a ``Linear``) with softmax
    routing and no shared expert; float sinks of one per head."""
    cfg = model.config
    for parts in layers:
        experts = _experts(parts)
        windowed = parts.attention_window
        latent_int8 = parts.latent is not None and type(experts) is QuantExperts
        if type(experts) in _KIND and not windowed and not latent_int8:
            return False  # (another family's quantized experts: Python; DeepSeek's its own)
        if not windowed:
            continue
        attn = parts.attn
        heads = cfg.num_attention_heads
        if attn is None or (attn.sinks is not None and attn.sinks.shape != (heads,)):
            return False
        if _window_kernel(dtype, None) == 0:
            return False
        mlp = parts.mlp
        if not isinstance(mlp, SparseMoeBlock):
            return False
        if type(mlp.gate) is not Linear or mlp.scoring != "softmax" or mlp.shared_expert:
            return False
        if mlp.e_score_correction_bias is not None or experts is None:
            return False
        if _descriptor(experts, dtype, cfg.hidden_size, mlp.num_experts, None) is None:
            return False
    return True


def max_rows(layers: Sequence[DecodeParts]) -> int:
    """The most rows a step may take where the experts' forward runs them natively (MXFP4's:
    under ``mxfp4.GEMM_ROWS``); a large number without such experts."""
    if any(isinstance(_experts(p), MXFP4Experts) for p in layers if p.attention_window):
        return mxfp4.GEMM_ROWS - 1
    return 1 << 30


def expected_shapes(put: Callable[..., None], parts: DecodeParts, cfg: Any) -> None:
    """The shapes (``put``: module, name, shape) of what gpt-oss's layers hold besides Llama's:
    the sinks, o_proj's bias, the router's bias, the float experts' biases."""
    if not parts.attention_window:
        return
    attn, mlp = parts.attn, parts.mlp
    if attn is not None:
        put(attn, "sinks", cfg.num_attention_heads)
        put(attn.o_proj, "bias", cfg.hidden_size)
    if isinstance(mlp, SparseMoeBlock):
        e, inter = cfg.num_experts, cfg.moe_intermediate_size
        put(mlp.gate, "bias", e)
        put(mlp.experts, "gate_up_proj_bias", e, 2 * inter)
        put(mlp.experts, "down_proj_bias", e, cfg.hidden_size)


def layer_entries(
    parts: DecodeParts, cache: Any, checks: Any
) -> tuple[list[int], list[torch.Tensor]]:
    """A layer's ``ENTRIES`` (all 0 for another family's layer) and the tensors they name that
    the step keeps alive (the float32 sinks, the experts' descriptor); what they read held in
    ``checks`` (``cpu_decode._Checks``)."""
    attn, mlp = parts.attn, parts.mlp
    if not parts.attention_window or attn is None or not isinstance(mlp, SparseMoeBlock):
        return [0] * ENTRIES, []
    dtype = mlp.gate.weight.dtype
    kept: list[torch.Tensor] = []
    checks.entry(attn.__dict__, "sliding_window")
    sinks = attn.sinks
    checks.keep(attn._parameters, "sinks", sinks, 0 if sinks is None else sinks.data_ptr())
    wide = 0
    if sinks is not None:
        checks.versioned(sinks)
        kept.append(sinks.detach().to(torch.float32).clone())
        wide = kept[-1].data_ptr()
    codes = STORAGE_DTYPES[cache.kind] if isinstance(cache, QuantizedKVCache) else None
    bias = mlp.gate._parameters.get("bias")
    checks.keep(mlp.gate._parameters, "bias", bias, 0 if bias is None else bias.data_ptr())
    descriptor = _descriptor(_experts(parts), dtype, mlp.hidden_size, mlp.num_experts, checks)
    assert descriptor is not None, "checked by supported()"
    kept.append(torch.tensor(descriptor, dtype=torch.int64))
    entries = [attn.sliding_window or 0, wide, _window_kernel(dtype, codes)]
    return [*entries, 0 if bias is None else bias.data_ptr(), kept[-1].data_ptr()], kept


def _window_kernel(dtype: torch.dtype, codes: torch.dtype | None) -> int:
    """The address of the paged decode kernel with a window and sinks for ``dtype`` queries
    over a float cache (``codes`` None) or codes; 0 where there is none."""
    dll = cpu_paged.load_library()
    symbol = cpu_paged._SYMBOLS.get(dtype)
    if dll is None or symbol is None or (codes is not None and codes not in cpu_paged._CODES):
        return 0
    name = f"{symbol}_window" if codes is None else f"{symbol}_{cpu_paged._CODES[codes]}_sinks"
    return ctypes.cast(getattr(dll, name), ctypes.c_void_p).value or 0


def _bits(value: float) -> int:
    """A float32's bits (as ctypes passes a Python float to a c_float: nearest)."""
    return int.from_bytes(struct.pack("<f", value), "little")


def _descriptor(
    experts: nn.Module | None, dtype: torch.dtype, hidden: int, num_experts: int, checks: Any
) -> list[int] | None:
    """The experts' descriptor (``OssSlot`` in ``native/decode_gpt_oss.h``), or None where
    their forward would not run them natively; with ``checks``, what it reads held there."""
    if fused_moe._library() is None or dtype not in fused_moe._FNS:
        return None
    if isinstance(experts, ClampedSwiGLUExperts):
        return _float(experts, dtype, hidden, num_experts, checks)
    if isinstance(experts, QuantExperts):
        return _int8(experts, dtype, hidden, num_experts, checks)
    if isinstance(experts, MXFP4Experts):
        return _mxfp4(experts, dtype, hidden, num_experts, checks)
    return None


def _address(fn: Any) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value or 0


def _float(
    experts: ClampedSwiGLUExperts, dtype: torch.dtype, hidden: int, num_experts: int, checks: Any
) -> list[int] | None:
    """``fused_moe.gpt_oss_experts``' call: the four parameters in ``dtype``, contiguous."""
    names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    params = [experts._parameters.get(n) for n in names]
    inter = experts.intermediate_size
    shapes = [(num_experts, 2 * inter, hidden), (num_experts, 2 * inter)]
    shapes += [(num_experts, hidden, inter), (num_experts, hidden)]
    for p, shape in zip(params, shapes, strict=True):
        if p is None or p.dtype != dtype or not p.is_contiguous() or tuple(p.shape) != shape:
            return None
    if checks is not None:
        for name, p in zip(names, params, strict=True):
            checks.keep(experts._parameters, name, p, p.data_ptr())  # type: ignore[union-attr]
        for name in ("alpha", "limit", "intermediate_size"):
            checks.entry(experts.__dict__, name)
    head = [0, _address(fused_moe._FNS[dtype]), _bits(experts.alpha), _bits(experts.limit), inter]
    return head + [p.data_ptr() for p in params if p is not None] + [0, 0, 0, 0]


def _int8(
    experts: QuantExperts, dtype: torch.dtype, hidden: int, num_experts: int, checks: Any
) -> list[int] | None:
    """``fused_moe.gpt_oss_int8_experts``' call on the experts' int8 table, as
    ``QuantExperts.forward`` makes it (the clamped SwiGLU over ``[gate | up]``)."""
    params = swiglu_params(experts.activation)
    if params is None or params[2] or experts.num_experts != num_experts:
        return None
    up = experts.gate_up[0]
    if not isinstance(up, QuantLinear) or up.in_features != hidden:
        return None
    table = experts._int8_table()
    if table is None:
        return None
    if checks is not None:
        checks.entry(experts.__dict__, "activation")
        for modules in (experts.gate_up, experts.down):
            checks.children.append((modules._modules, dict(modules._modules)))
            for m in modules:
                for name in ("qweight", "scales", "bias"):
                    t = m._buffers.get(name)
                    checks.keep(m._buffers, name, t, 0 if t is None else t.data_ptr())
                for name in ("input_scale", "perm"):
                    checks.entry(m._buffers, name)
                for name in ("compute_dtype", "bits", "group_size", "interleaved"):
                    checks.entry(m.__dict__, name)
        checks.addresses.append((table, table.data_ptr()))
    scales_bf16 = int(up.scales.dtype == torch.bfloat16)
    bias_bf16 = int(up.bias is not None and up.bias.dtype == torch.bfloat16)
    fn = _address(fused_moe._INT8_FNS[dtype])
    head = [1, fn, _bits(params[0]), _bits(params[1]), up.out_features // 2, table.data_ptr()]
    return head + [0] * 5 + [scales_bf16, bias_bf16]


_MX_NAMES = (
    "gate_up_proj_blocks",
    "gate_up_proj_scales",
    "gate_up_proj_bias",
    "down_proj_blocks",
    "down_proj_scales",
    "down_proj_bias",
)


def _mxfp4(
    experts: MXFP4Experts, dtype: torch.dtype, hidden: int, num_experts: int, checks: Any
) -> list[int] | None:
    """``mxfp4.native_experts``' call, where ``MXFP4Experts.forward`` makes it (``_native``):
    the clamped SwiGLU, both biases of one dtype (float32 or bfloat16) or none; the packed
    tensors contiguous in their shapes."""
    params = swiglu_params(experts.activation)
    dll = mxfp4._library()
    suffix = mxfp4._DTYPES.get(dtype)
    if params is None or dll is None or suffix is None:
        return None
    e, h, i = experts.num_experts, experts.hidden_size, experts.intermediate_size
    if (e, h) != (num_experts, hidden):
        return None
    tensors = [experts._buffers.get(n) for n in _MX_NAMES]
    shapes = [(e, 2 * i, h // 32, 16), (e, 2 * i, h // 32), (e, 2 * i)]
    shapes += [(e, h, i // 32, 16), (e, h, i // 32), (e, h)]
    gb, db = tensors[2], tensors[5]
    if (gb is None) != (db is None):
        return None
    if gb is not None and (gb.dtype != db.dtype or gb.dtype not in (torch.float32, torch.bfloat16)):  # type: ignore[union-attr]
        return None
    for t, shape in zip(tensors, shapes, strict=True):
        if t is not None and (tuple(t.shape) != shape or not t.is_contiguous() or not t.is_cpu):
            return None
    if checks is not None:
        for name, t in zip(_MX_NAMES, tensors, strict=True):
            checks.keep(experts._buffers, name, t, 0 if t is None else t.data_ptr())
        checks.entry(experts.__dict__, "activation")
    fn = _address(getattr(dll, f"foudre_mxfp4_gpt_oss_experts_{suffix}"))
    pointers = [0 if t is None else t.data_ptr() for t in tensors]
    flags = [int(gb is not None and gb.dtype == torch.bfloat16), int(params[2])]
    return [2, fn, _bits(params[0]), _bits(params[1]), i, *pointers, *flags]
