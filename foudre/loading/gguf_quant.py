"""GGUF weights kept quantized: the Q4_0, Q4_1 and Q4_K linears as 4-bit and the Q8_0 ones as
8-bit ``QuantLinear`` modules with groups of 32 columns (and the stacked experts of
mixture-of-experts layers as ``QuantExperts`` of them), re-expressed exactly in foudre's
canonical layouts (``foudre.quant.packing``) rather than expanded to floats:

- Q8_0 ``w = d q``: int8 codes ``q``, scale ``d`` per block of 32 (group-wise int8).
- Q4_0 ``w = d (q - 8)``: codes ``q``, ``s = d``, ``z = 8``.
- Q4_1 ``w = d q + m``: ``s = d``, ``z = -m / d``.
- Q4_K, per 256 values ``d``, ``dmin`` and per sub-block of 32 6-bit ``sc`` and ``m``,
  ``w = d sc q - dmin m``: ``s = d sc``, ``z = dmin m / s``.

A block whose scale is zero holds one value ``v`` (``m``, ``-dmin m``, or 0): it becomes codes 0,
``s = |v|``, ``z = -sign(v)``, which gives ``v`` exactly. Scales keep their exact values: float16
for Q4_0 (``d`` is a float16, ``z = 8``), float32 otherwise; so a Q4_0 module takes 20 bytes per
32 weights (the file 18) and a Q8_0 one 36 (the file 34).

Decoding is vectorised numpy over the file's memory map, one tensor at a time. The parts of a
fused linear (q/k/v, gate/up) or of a layer's experts are kept only when all of them are of kept
types of the same bits; everything else is dequantized at load as before: other types (Q5_*,
Q6_K, ...), the parts beside one of them, the embedding table (looked up, not multiplied),
routers, and experts stored one tensor per expert (older files). One log line names them with
the reason. ``FOUDRE_GGUF_DEQUANTIZE=1`` (or ``load_model(gguf_dequantize=True)``) dequantizes
everything, as before.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K
from torch import nn

from foudre.layers.moe import Experts
from foudre.loading.gguf import (
    _ROPE_FREQS,
    GGUFFile,
    GGUFTensor,
    _hf_name,
    _unpermute_rope,
    dequantize_tensor,
)
from foudre.models.config import ModelConfig
from foudre.quant.experts import QuantExperts
from foudre.quant.qlinear import QuantLinear

log = logging.getLogger(__name__)

_QT = GGMLQuantizationType
# ggml type -> bits of the QuantLinear that holds it
KEPT_TYPES: dict[int, int] = {_QT.Q8_0: 8, _QT.Q4_0: 4, _QT.Q4_1: 4, _QT.Q4_K: 4}
GROUP = 32
_FLOATS = (_QT.F32, _QT.F16, _QT.BF16)
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_ROUTERS = ("mlp.gate", "mlp.shared_expert_gate")
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.\{\}\.(gate_proj|up_proj|down_proj)\.weight$")
ENV = "FOUDRE_GGUF_DEQUANTIZE"


@dataclass(slots=True)
class Codes:
    """One tensor's codes in QuantLinear's canonical (unpacked) form: ``codes`` int8 ``[N, K]``
    (8 bits) or uint8 0..15 (4 bits), ``scales`` and ``zeros`` (4 bits) float32 ``[N, K / 32]``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None


@dataclass(slots=True)
class KeptLinear:
    """A (fused) linear of the model built from GGUF tensors kept quantized."""

    module: str
    weights: list[tuple[str, GGUFTensor]]  # (HF name, tensor) in row order
    biases: list[tuple[str, GGUFTensor]]
    bits: int
    scale_dtype: torch.dtype


@dataclass(slots=True)
class KeptExperts:
    """The routed experts of a mixture-of-experts layer, from stacked GGUF tensors kept
    quantized (``ffn_{gate,up,down}_exps``, ``[experts, rows, cols]``)."""

    module: str
    gate: GGUFTensor
    up: GGUFTensor
    down: GGUFTensor
    bits: int
    scale_dtype: torch.dtype


@dataclass(slots=True)
class GGUFQuantPlan:
    kept: list[KeptLinear] = field(default_factory=list)
    experts: list[KeptExperts] = field(default_factory=list)
    dequantized: dict[str, list[str]] = field(default_factory=dict)  # reason -> GGUF names

    @property
    def consumed(self) -> frozenset[str]:
        """The GGUF tensors the kept modules load (``iter_gguf_weights`` skips them)."""
        names = {t.name for k in self.kept for _, t in [*k.weights, *k.biases]}
        return frozenset(names | {t.name for e in self.experts for t in (e.gate, e.up, e.down)})


# ----------------------------------------------------------------------------- decoding


def _f16(b: np.ndarray) -> np.ndarray:
    """float16 values stored in the last axis (2 bytes) of ``b``, as float32 ``b.shape[:-1]``."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit blocks of 32: value ``j`` in the low nibble of byte ``j``, ``j + 16`` in its
    high one. ``qs [..., 16]`` to codes ``[..., 32]``."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _int4(codes: np.ndarray, s: np.ndarray, c: np.ndarray) -> Codes:
    """Codes of ``w = q s - c`` (``codes [N, K]``, ``s`` and ``c`` ``[N, K / 32]``) as
    ``w = (q - z) s``; a block of ``s == 0`` (the single value ``-c``) exactly as codes 0,
    ``s = |c|``, ``z = sign(c)``."""
    zero = s == 0
    z = np.divide(c, s, out=np.zeros_like(s), where=~zero)
    if zero.any():
        s = np.where(zero, np.abs(c), s)
        z = np.where(zero, np.sign(c), z)
        n = codes.shape[0]
        blocks = codes.reshape(n, -1, GROUP)
        codes = np.where(zero[..., None], np.uint8(0), blocks).reshape(n, -1)
    return Codes(
        torch.from_numpy(np.ascontiguousarray(codes, dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(z, dtype=np.float32)),
    )


def decode_codes(f: GGUFFile, tensor: GGUFTensor) -> Codes:
    """The codes, scales and zeros of a tensor of a ``KEPT_TYPES`` type, its leading dimensions
    flattened into rows (stacked experts: ``[experts * rows, cols]``); vectorised over every
    block of the tensor, read from the file's memory map."""
    k = tensor.shape[-1]
    n = math.prod(tensor.shape[:-1])
    raw = np.asarray(f.data[tensor.offset : tensor.offset + tensor.nbytes]).reshape(n, -1)
    qtype = _QT(tensor.type)
    if qtype == _QT.Q8_0:
        b = raw.reshape(n, k // 32, 34)
        q = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
        return Codes(torch.from_numpy(q), torch.from_numpy(_f16(b[..., :2])), None)
    if qtype == _QT.Q4_0:
        b = raw.reshape(n, k // 32, 18)
        d = _f16(b[..., :2])
        return _int4(_nibbles(b[..., 2:]).reshape(n, k), d, 8 * d)
    if qtype == _QT.Q4_1:
        b = raw.reshape(n, k // 32, 20)
        d, m = _f16(b[..., :2]), _f16(b[..., 2:4])
        return _int4(_nibbles(b[..., 4:]).reshape(n, k), d, -m)
    if qtype == _QT.Q4_K:
        b = raw.reshape(n, k // 256, 144)
        d, dmin = _f16(b[..., :2]), _f16(b[..., 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
        sc = sc.reshape(n, k // 256, 8).astype(np.float32)
        mn = mn.reshape(n, k // 256, 8).astype(np.float32)
        # 32 bytes per pair of sub-blocks: sub-block 2i in the low nibbles, 2i + 1 in the high
        qs = b[..., 16:].reshape(n, k // 256, 4, 1, 32) >> np.array([0, 4], np.uint8)[:, None]
        codes = (qs & 0xF).reshape(n, k)
        s = (d[..., None] * sc).reshape(n, k // 32)
        c = (dmin[..., None] * mn).reshape(n, k // 32)
        return _int4(codes, s, c)
    raise ValueError(f"tensor {tensor.name!r}: {tensor.type_name} is not kept quantized")


# ----------------------------------------------------------------------------- planning


def _module_of(hf: str) -> tuple[str, str | None, str]:
    """(foudre module, part of a fused module or None, leaf) of a Hugging Face tensor name."""
    *path, proj, leaf = hf.split(".")
    for fused, parts in _FUSED.items():
        if proj in parts:
            return ".".join([*path, fused]), proj, leaf
    return ".".join([*path, proj]), None, leaf


def plan_gguf_quantized(f: GGUFFile, model: nn.Module) -> GGUFQuantPlan:
    """Which linears and experts of ``model`` (built for ``f``'s config) are kept quantized, and
    which quantized tensors are dequantized and why. Everything is dequantized when
    ``FOUDRE_GGUF_DEQUANTIZE=1``."""
    plan = GGUFQuantPlan()
    if os.environ.get(ENV, "0") not in ("", "0"):
        return plan

    def dequantized(reason: str, tensor: GGUFTensor) -> None:
        if tensor.type not in _FLOATS:
            plan.dequantized.setdefault(reason, []).append(tensor.name)

    def refuse(tensors: list[GGUFTensor], together: str) -> None:
        unkept = "/".join(sorted({t.type_name for t in tensors if t.type not in KEPT_TYPES}))
        for t in tensors:
            if t.type not in KEPT_TYPES:
                dequantized(f"{t.type_name} (no kept-quantized kernel)", t)
            else:
                dequantized(f"{together} {unkept or 'another layout'}", t)

    modules = dict(model.named_modules())
    weights: dict[str, dict[str | None, tuple[str, GGUFTensor]]] = {}
    biases: dict[str, dict[str | None, tuple[str, GGUFTensor]]] = {}
    experts: dict[str, dict[str, GGUFTensor]] = {}
    for tensor in f.tensors.values():
        hf = _hf_name(tensor.name)
        if tensor.name == _ROPE_FREQS or hf is None:
            continue
        module, part, leaf = _module_of(hf)
        stacked = _STACKED_EXPERTS.match(hf)
        if stacked is not None:
            experts.setdefault(stacked.group(1), {})[stacked.group(2)] = tensor
        elif ".experts." in hf:
            dequantized("one tensor per expert (older files)", tensor)
        elif module.endswith(_ROUTERS):
            dequantized("routers (kept in float)", tensor)
        elif not isinstance(modules.get(module), nn.Linear):
            embedding = module.endswith("embed_tokens")
            dequantized("the embedding table" if embedding else "not a linear", tensor)
        else:
            target = weights if leaf == "weight" else biases
            target.setdefault(module, {})[part] = (hf, tensor)
    for module, parts in weights.items():
        lin = modules[module]
        assert isinstance(lin, nn.Linear)
        order = _FUSED.get(module.rpartition(".")[2], (None,))
        found = [parts[p] for p in order if p in parts]
        found_bias = [biases[module][p] for p in order if p in biases.get(module, {})]
        tensors = [t for _, t in found]
        if (
            len(found) != len(order)
            or len(found_bias) != (len(order) if lin.bias is not None else 0)
            or sum(t.shape[0] for t in tensors) != lin.out_features
            or any(len(t.shape) != 2 or t.shape[1] != lin.in_features for t in tensors)
            or len({KEPT_TYPES.get(t.type) for t in tensors}) != 1
            or tensors[0].type not in KEPT_TYPES
        ):  # dequantized; load_weights reports missing or misshapen parts
            refuse(tensors, "fused with")
            continue
        bits = KEPT_TYPES[tensors[0].type]
        plan.kept.append(KeptLinear(module, found, found_bias, bits, _scale_dtype(tensors)))
    for module, stack in experts.items():
        ex = modules.get(module)
        gate, up, down = (stack.get(p) for p in ("gate_proj", "up_proj", "down_proj"))
        tensors = [t for t in (gate, up, down) if t is not None]
        if (
            not isinstance(ex, Experts)
            or gate is None
            or up is None
            or down is None
            or len(gate.shape) != 3
            or gate.shape != up.shape
            or (gate.shape[0], 2 * gate.shape[1], gate.shape[2]) != tuple(ex.gate_up_proj.shape)
            or down.shape != tuple(ex.down_proj.shape)
            or len({KEPT_TYPES.get(t.type) for t in tensors}) != 1
            or gate.type not in KEPT_TYPES
        ):  # dequantized; load_weights reports missing or misshapen experts
            refuse(tensors, "experts with")
            continue
        bits = KEPT_TYPES[gate.type]
        plan.experts.append(KeptExperts(module, gate, up, down, bits, _scale_dtype(tensors)))
    return plan


def _scale_dtype(tensors: list[GGUFTensor]) -> torch.dtype:
    """float16 holds Q4_0's scales (``d``) and zero points (8) exactly; float32 the others'."""
    return torch.float16 if all(t.type == _QT.Q4_0 for t in tensors) else torch.float32


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def swap_in_quantized(model: nn.Module, plan: GGUFQuantPlan) -> None:
    """Replace the planned linears and experts of ``model`` (still on the meta device, in its
    dtype) by empty ``QuantLinear`` / ``QuantExperts`` modules of the same device and dtype
    (scales in the plan's)."""

    def empty(
        like: torch.Tensor, k: int, n: int, bits: int, bias: bool, scales: torch.dtype
    ) -> QuantLinear:
        return QuantLinear(
            k, n, bits, GROUP, bias=bias, dtype=like.dtype, device=like.device, scale_dtype=scales
        )

    for kept in plan.kept:
        lin = model.get_submodule(kept.module)
        assert isinstance(lin, nn.Linear)
        bias = lin.bias is not None
        new = empty(
            lin.weight, lin.in_features, lin.out_features, kept.bits, bias, kept.scale_dtype
        )
        _set_module(model, kept.module, new)
    for ke in plan.experts:
        ex = model.get_submodule(ke.module)
        assert isinstance(ex, Experts)
        n, two_i, hidden = ex.gate_up_proj.shape
        w, bits, sd = ex.gate_up_proj, ke.bits, ke.scale_dtype
        gate_up = [empty(w, hidden, two_i, bits, False, sd) for _ in range(n)]
        down = [empty(w, two_i // 2, hidden, bits, False, sd) for _ in range(n)]
        _set_module(model, ke.module, QuantExperts(gate_up, down))


def _rope_heads(config: ModelConfig, hf: str) -> int | None:
    """The head count to un-permute ``hf``'s rows by (llama.cpp's q/k order), as
    ``iter_gguf_weights`` does; None for other tensors."""
    if config.architecture not in ("llama", "mixtral"):
        return None
    if ".q_proj." in hf:
        return config.num_attention_heads
    return config.num_key_value_heads if ".k_proj." in hf else None


def _fill(mod: nn.Module, rows: slice, c: Codes) -> None:
    """Copy codes (unpacked), scales and zeros into the rows ``rows`` of ``mod``'s buffers."""
    assert isinstance(mod, QuantLinear)
    q = c.codes
    if mod.zeros is not None and c.zeros is not None:
        mod.zeros[rows].copy_(c.zeros)
        q = q[:, 0::2] | (q[:, 1::2] << 4)  # pack_int4's order
    mod.qweight[rows].copy_(q)
    mod.scales[rows].copy_(c.scales)
    mod._packed = {}


@torch.no_grad()
def load_gguf_quantized(
    f: GGUFFile, config: ModelConfig, model: nn.Module, plan: GGUFQuantPlan
) -> None:
    """Fill the modules ``swap_in_quantized`` made (now allocated) from the file's codes, and
    log which quantized tensors were dequantized instead, and why."""
    for kept in plan.kept:
        mod = model.get_submodule(kept.module)
        assert isinstance(mod, QuantLinear)
        start = 0
        for hf, tensor in kept.weights:
            c = decode_codes(f, tensor)
            heads = _rope_heads(config, hf)
            if heads is not None:
                zeros = None if c.zeros is None else _unpermute_rope(c.zeros, heads)
                c = Codes(_unpermute_rope(c.codes, heads), _unpermute_rope(c.scales, heads), zeros)
            _fill(mod, slice(start, start + tensor.shape[0]), c)
            start += tensor.shape[0]
        start = 0
        for hf, tensor in kept.biases:
            assert mod.bias is not None
            b = dequantize_tensor(f, tensor)
            heads = _rope_heads(config, hf)
            b = b if heads is None else _unpermute_rope(b, heads)
            mod.bias[start : start + b.shape[0]].copy_(b)
            start += b.shape[0]
    for ke in plan.experts:
        qe = model.get_submodule(ke.module)
        assert isinstance(qe, QuantExperts)
        inter = ke.gate.shape[1]
        for tensor, linears, first in (
            (ke.gate, qe.gate_up, 0),
            (ke.up, qe.gate_up, inter),
            (ke.down, qe.down, 0),
        ):
            c = decode_codes(f, tensor)  # [experts * rows, cols]
            rows = tensor.shape[1]
            for e, lin in enumerate(linears):
                part = slice(e * rows, (e + 1) * rows)
                zeros = None if c.zeros is None else c.zeros[part]
                _fill(lin, slice(first, first + rows), Codes(c.codes[part], c.scales[part], zeros))
    if plan.dequantized or plan.kept or plan.experts:
        reasons = "; ".join(
            f"{reason}: {', '.join(names[:3])}"
            + (f" (+{len(names) - 3})" if len(names) > 3 else "")
            for reason, names in plan.dequantized.items()
        )
        log.info(
            "%s: %d linears and %d expert sets kept quantized; dequantized at load: %s",
            f.path,
            len(plan.kept),
            len(plan.experts),
            reasons or "nothing",
        )
