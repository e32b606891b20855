"""GGUF weights kept quantized: the linears of Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K and Q8_0
tensors as ``QuantLinear`` modules (and the stacked experts of mixture-of-experts layers as
``QuantExperts`` of them), re-expressed in foudre's canonical layouts (``foudre.quant.packing``)
rather than expanded to floats. Every type is decoded to integer codes ``q``, a scale ``s`` and
an optional min ``c`` per group, ``w = q s - c``, which is exactly the float32 arithmetic of the
gguf package's dequantizers (``d``, ``dmin`` and ``m`` are the file's float16 values):

- Q4_0 ``w = d (q - 8)`` and Q5_0 ``w = d (q - 16)``: codes ``q - 8`` / ``q - 16``, ``s = d``.
- Q4_1 and Q5_1 ``w = d q + m``: ``s = d``, ``c = -m``.
- Q4_K and Q5_K, per 256 values ``d``, ``dmin`` and per sub-block of 32 6-bit ``sc`` and ``m``,
  ``w = d sc q - dmin m``: ``s = d sc``, ``c = dmin m``.
- Q6_K, per 256 values ``d`` and per sub-block of 16 an int8 ``sc``, ``w = d sc (q - 32)``:
  codes ``q - 32``, ``s = d sc`` (exact in float32).
- Q8_0 ``w = d q``: codes ``q``, ``s = d``.

A module whose parts are all Q6_K is a 6-bit ``QuantLinear`` where our CPU kernels serve it
(``six_bit``): Q6_K's own codes, int8 sub-scales and float16 ``d`` (``packing.pack_int6``, the
file's 26.25 bytes per 32 weights), ``w = (q - 32) (d sc)`` exactly. A module whose parts
(q/k/v, gate/up) are all of the 4-bit types is a 4-bit ``QuantLinear`` with
groups of 32: codes 0..15 (Q4_0's ``q``) and zero points ``z = c / s`` (Q4_0: 8), ``w = (q - z)
s``. Any other module is 8-bit group-wise, with the smallest group of its parts (16 with a Q6_K
part; a group of 32 is two of 16 with the same scale) and zero points ``z = c / s`` when a part
has mins (Q4_1, Q4_K, Q5_1, Q5_K): so Q4_K_M's q/k/v (v in Q6_K) stays quantized, in 8 bits. A
group with zero points and ``s == 0`` holds one value ``-c``: it becomes codes 0, ``s = |c|``,
``z = sign(c)``, exactly ``-c``.

Exactness against the gguf dequantizer: bit for bit where the zero points are absent or integers
(Q5_0, Q6_K, Q8_0; Q4_0's 8); with a part's ``z = c / s``, ``(q - z) s`` and the kernels'
``q s - fl(s z)`` are within a few float32 roundings of ``|c|`` (under ``1e-7 max|w|`` measured,
where ``q s - c`` would be exact but is not ``QuantLinear``'s form). Scales are float32 (the
kernels' layouts use the buffers themselves), but float16 for modules of Q4_0, Q5_0 and Q8_0
parts only (``d`` is a float16, zero points none, 8 or 0): a Q4_0 module takes 20 bytes per 32
weights (the file 18), a Q8_0 one 34 (34), Q5_0 34 (22), Q5_1 / Q5_K 40 (24 / 22), Q6_K 26.25
(26.25; in 8 bits, fused with other types or on CUDA, 40).

Decoding is vectorised numpy over the file's memory map, one tensor at a time. Dequantized at
load as before: other types (Q2_K, Q3_K, the IQ types...) and the parts fused with one of them,
the embedding table (looked up, not multiplied), routers, experts stored one tensor per
expert (older files), gpt-oss's experts unless MXFP4 (kept packed by ``MXFP4Experts``; the
GGUF path builds no ``QuantExperts`` with their biases and clamped SwiGLU), DeepSeek's
``kv_b_proj`` (split in two by the converter; the model multiplies by its halves) and
Qwen3-Next's ``in_proj_qkvz``
(split into ``attn_qkv`` and ``attn_gate``, rows re-ordered across both). A qwen3next file's
multi-token-prediction blocks are not read. Rows are read in the order the
model loads them (llama's q/k un-permuted, DeepSeek's rotated rows de-interleaved). One log line
names them with the reason. ``FOUDRE_GGUF_DEQUANTIZE=1`` (or
``load_model(gguf_dequantize=True)``) dequantizes everything, as before.

Where the CPU kernels then repack a module's rows into 16-row blocks (``cpu_qmatmul.interleave``:
the VNNI path; modules of Q4_0, Q4_1 and Q4_K parts in 4 bits, and 8-bit modules of Q4_0, Q5_0
and Q8_0 parts), the blocks are built straight from the file's instead, in one native pass, into
the 2 MiB pages the model runs from (``foudre.quant.gguf_blocks``): the same bytes, without the
rows and their decoding in between.
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
    _BLOCK,
    _PAIRS,
    _PERMUTED_QK,
    _ROPE_FREQS,
    CHUNK_BYTES,
    GGUFFile,
    GGUFTensor,
    _first_mtp_block,
    _hf_name,
    _unpermute_rope,
    dequantize_tensor,
)
from foudre.loading.memory import release_freed
from foudre.models.config import ModelConfig
from foudre.native import huge_pages
from foudre.quant import gguf_blocks
from foudre.quant.experts import QuantExperts
from foudre.quant.packing import pack_int6
from foudre.quant.qlinear import QuantLinear, uses_native_kernels

log = logging.getLogger(__name__)

_QT = GGMLQuantizationType


@dataclass(frozen=True, slots=True)
class Layout:
    """How weights are held: ``bits`` (4: codes 0..15, 6: Q6_K's, 8: int8), columns per scale
    (``group``), and whether there are zero points (always with 4 bits; for 8 bits, when a part
    has mins)."""

    bits: int
    group: int
    zero_point: bool


# ggml type kept quantized -> its own layout (zero_point: the format has mins ``c``)
KEPT_TYPES: dict[int, Layout] = {
    _QT.Q4_0: Layout(4, 32, False),
    _QT.Q4_1: Layout(4, 32, True),
    _QT.Q4_K: Layout(4, 32, True),
    _QT.Q5_0: Layout(8, 32, False),
    _QT.Q5_1: Layout(8, 32, True),
    _QT.Q5_K: Layout(8, 32, True),
    _QT.Q6_K: Layout(8, 16, False),
    _QT.Q8_0: Layout(8, 32, False),
}
_FLOATS = (_QT.F32, _QT.F16, _QT.BF16)
_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_ROUTERS = ("mlp.gate", "mlp.shared_expert_gate")
_STACKED_EXPERTS = re.compile(r"^(.*\.experts)\.\{\}\.(gate_proj|up_proj|down_proj)\.weight$")
ENV = "FOUDRE_GGUF_DEQUANTIZE"
# gpt-oss's experts have biases and a clamped SwiGLU, for which this path builds no QuantExperts
_GPT_OSS_EXPERTS = "gpt-oss experts (kept packed as MXFP4 only)"


def module_layout(tensors: list[GGUFTensor], six_bit: bool = False) -> Layout:
    """The layout of a module made of ``tensors`` (all of ``KEPT_TYPES``): 6 bits when every
    part is Q6_K and ``six_bit`` (our CPU kernels take it), 4 bits with groups of 32 when every
    part is 4-bit, else 8 bits with the smallest group, zero points when a part has mins."""
    if six_bit and all(t.type == _QT.Q6_K for t in tensors):
        return Layout(6, 16, False)
    layouts = [KEPT_TYPES[t.type] for t in tensors]
    if all(lay.bits == 4 for lay in layouts):
        return Layout(4, 32, True)
    return Layout(8, min(lay.group for lay in layouts), any(lay.zero_point for lay in layouts))


@dataclass(slots=True)
class Codes:
    """One tensor's codes in QuantLinear's canonical (unpacked) form: ``codes`` uint8 0..15
    (4 bits), 0..63 (6 bits) or int8 (8 bits) ``[N, K]``, ``scales`` and ``zeros`` (None: no
    zero points) float32 ``[N, K / group]``; 6 bits: ``scales`` the ``d`` ``[N, K / 256]`` and
    ``subs`` the int8 sub-scales ``[N, K / 16]``."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    subs: torch.Tensor | None = None


@dataclass(slots=True)
class KeptLinear:
    """A (fused) linear of the model built from GGUF tensors kept quantized."""

    module: str
    weights: list[tuple[str, GGUFTensor]]  # (HF name, tensor) in row order
    biases: list[tuple[str, GGUFTensor]]
    layout: Layout
    scale_dtype: torch.dtype


@dataclass(slots=True)
class KeptExperts:
    """The routed experts of a mixture-of-experts layer, from stacked GGUF tensors kept
    quantized (``ffn_{gate,up,down}_exps``, ``[experts, rows, cols]``); gate/up and down each
    in the layout of their types."""

    module: str
    gate: GGUFTensor
    up: GGUFTensor
    down: GGUFTensor
    gate_up_layout: Layout
    down_layout: Layout
    gate_up_dtype: torch.dtype
    down_dtype: torch.dtype


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


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1's fifth bits: bit ``j`` of the little-endian ``qh [..., 4]`` is value ``j``'s,
    as ``[..., 32]`` values 0 or 16."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


@dataclass(slots=True)
class _Blocks:
    """A tensor's values as ``w = codes s - c`` per group of ``group`` columns: int8 ``codes``
    ``[N, K]``, float32 ``s`` and ``c`` (None: 0) ``[N, K / group]``."""

    codes: np.ndarray
    s: np.ndarray
    c: np.ndarray | None
    group: int


def _decode(raw: np.ndarray, qtype: _QT, n: int, k: int) -> _Blocks:
    """The exact form of ``raw`` (``[N, row bytes]`` of ``qtype``); see the module docstring."""
    if qtype == _QT.Q8_0:
        b = raw.reshape(n, k // 32, 34)
        q: np.ndarray = np.ascontiguousarray(b[..., 2:]).view(np.int8).reshape(n, k)
        return _Blocks(q, _f16(b[..., :2]), None, 32)
    if qtype == _QT.Q4_0:
        b = raw.reshape(n, k // 32, 18)
        q = _nibbles(b[..., 2:]).view(np.int8) - np.int8(8)
        return _Blocks(q.reshape(n, k), _f16(b[..., :2]), None, 32)
    if qtype == _QT.Q4_1:
        b = raw.reshape(n, k // 32, 20)
        q = _nibbles(b[..., 4:]).view(np.int8).reshape(n, k)
        return _Blocks(q, _f16(b[..., :2]), -_f16(b[..., 2:4]), 32)
    if qtype == _QT.Q5_0:
        b = raw.reshape(n, k // 32, 22)
        q = (_nibbles(b[..., 6:]) | _high_bits(b[..., 2:6])).view(np.int8) - np.int8(16)
        return _Blocks(q.reshape(n, k), _f16(b[..., :2]), None, 32)
    if qtype == _QT.Q5_1:
        b = raw.reshape(n, k // 32, 24)
        q = (_nibbles(b[..., 8:]) | _high_bits(b[..., 4:8])).view(np.int8).reshape(n, k)
        return _Blocks(q, _f16(b[..., :2]), -_f16(b[..., 2:4]), 32)
    if qtype in (_QT.Q4_K, _QT.Q5_K):
        size = 144 if qtype == _QT.Q4_K else 176
        b = raw.reshape(n, k // 256, size)
        d, dmin = _f16(b[..., :2]), _f16(b[..., 2:4])
        sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(b[..., 4:16]).reshape(-1, 12))
        sc = sc.reshape(n, k // 256, 8).astype(np.float32)
        mn = mn.reshape(n, k // 256, 8).astype(np.float32)
        # 32 bytes per pair of sub-blocks: sub-block 2i in the low nibbles, 2i + 1 in the high
        qs = (
            b[..., size - 128 :].reshape(n, k // 256, 4, 1, 32)
            >> np.array([0, 4], np.uint8)[:, None]
        )
        q = (qs & 0xF).reshape(n, k // 256, 8, 32)
        if qtype == _QT.Q5_K:  # bit i of qh[l]: the fifth bit of sub-block i's value l
            qh = b[..., 16:48].reshape(n, k // 256, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
            q = q | ((qh & 1) << 4)
        s = (d[..., None] * sc).reshape(n, k // 32)
        c = (dmin[..., None] * mn).reshape(n, k // 32)
        return _Blocks(q.view(np.int8).reshape(n, k), s, c, 32)
    if qtype == _QT.Q6_K:
        q6, sc, d = _q6_k(raw, n, k)
        s = d.reshape(n, k // 256, 1) * sc.astype(np.float32).reshape(n, k // 256, 16)
        return _Blocks(q6.view(np.int8) - np.int8(32), s.reshape(n, k // 16), None, 16)
    raise AssertionError(qtype)


def _q6_k(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K's codes 0..63 ``[N, K]`` (uint8), int8 sub-scales ``[N, K / 16]`` and float16 ``d``
    (as float32) ``[N, K / 256]``; ``w = (q - 32) d sc``."""
    b = raw.reshape(n, k // 256, 210)
    # per half of 128 values: low nibbles of ql[0:64] (values 0..63), then their high
    # nibbles (64..127); bits 2i..2i+1 of qh[l] are the top bits of value 32 i + l
    ql = b[..., :128].reshape(n, k // 256, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    ql = (ql & np.uint8(0xF)).reshape(n, k // 256, 2, 4, 32)
    qh = b[..., 128:192].reshape(n, k // 256, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    q6 = (ql | ((qh & 3) << 4)).reshape(n, k)
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).reshape(n, k // 16)
    return q6, sc, _f16(b[..., 208:]).reshape(n, k // 256)


def _zero_points(codes: np.ndarray, s: np.ndarray, c: np.ndarray, group: int) -> Codes:
    """Codes of ``w = q s - c`` (``codes [N, K]``, ``s`` and ``c`` ``[N, K / group]``) as
    ``w = (q - z) s``; a group of ``s == 0`` (the single value ``-c``) exactly as codes 0,
    ``s = |c|``, ``z = sign(c)``."""
    zero = s == 0
    z = np.divide(c, s, out=np.zeros_like(s), where=~zero)
    if zero.any():
        s = np.where(zero, np.abs(c), s)
        z = np.where(zero, np.sign(c), z)
        n = codes.shape[0]
        blocks = codes.reshape(n, -1, group)
        codes = np.where(zero[..., None], codes.dtype.type(0), blocks).reshape(n, -1)
    return Codes(
        torch.from_numpy(np.ascontiguousarray(codes)),
        torch.from_numpy(np.ascontiguousarray(s, dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(z, dtype=np.float32)),
    )


def decode_codes(
    f: GGUFFile, tensor: GGUFTensor, layout: Layout, rows: slice | None = None
) -> Codes:
    """The codes, scales and zeros of a tensor of a ``KEPT_TYPES`` type in ``layout`` (its own,
    or a fused module's: ``module_layout``), its leading dimensions flattened into rows (stacked
    experts: ``[experts * rows, cols]``), of the rows ``rows`` only when given (a row's codes are
    its own blocks'); vectorised over every block of them, read from the file's memory map."""
    if tensor.type not in KEPT_TYPES:
        raise ValueError(f"tensor {tensor.name!r}: {tensor.type_name} is not kept quantized")
    k = tensor.shape[-1]
    total = math.prod(tensor.shape[:-1])
    first, last, _ = (rows or slice(0, total)).indices(total)
    n = last - first
    row_bytes = tensor.nbytes // total
    start = tensor.offset + first * row_bytes
    raw = np.asarray(f.data[start : start + n * row_bytes]).reshape(n, -1)
    if layout.bits == 6:
        if tensor.type != _QT.Q6_K:
            raise ValueError(f"tensor {tensor.name!r}: 6 bits are Q6_K's, not {tensor.type_name}")
        q6, sc, d = _q6_k(raw, n, k)
        return Codes(torch.from_numpy(q6), torch.from_numpy(d), None, torch.from_numpy(sc))
    b = _decode(raw, _QT(tensor.type), n, k)
    if layout.bits == 4:  # 4-bit types only: codes 0..15 (Q4_0's q - 8 back to q)
        assert b.group == layout.group
        c = 8 * b.s if b.c is None else b.c
        codes = b.codes.view(np.uint8) + np.uint8(8 if b.c is None else 0)
        return _zero_points(codes, b.s, c, layout.group)
    repeat = b.group // layout.group  # a group of 32 as two of 16
    s = np.repeat(b.s, repeat, axis=1) if repeat > 1 else b.s
    if layout.zero_point:
        c = np.zeros_like(b.s) if b.c is None else b.c
        c = np.repeat(c, repeat, axis=1) if repeat > 1 else c
        return _zero_points(b.codes, s, c, layout.group)
    assert b.c is None
    return Codes(torch.from_numpy(b.codes), torch.from_numpy(np.ascontiguousarray(s)), None)


# ----------------------------------------------------------------------------- planning


def _module_of(hf: str) -> tuple[str, str | None, str]:
    """(foudre module, part of a fused module or None, leaf) of a Hugging Face tensor name."""
    *path, proj, leaf = hf.split(".")
    for fused, parts in _FUSED.items():
        if proj in parts:
            return ".".join([*path, fused]), proj, leaf
    return ".".join([*path, proj]), None, leaf


_NO_KERNEL = "group-wise 8-bit (no kernel on this CPU: dequantized once, at load)"

# module -> part of a fused module (None: not fused) -> (HF name, tensor)
_Parts = dict[str, dict[str | None, tuple[str, GGUFTensor]]]


def _dequantize(plan: GGUFQuantPlan, reason: str, tensor: GGUFTensor) -> None:
    """Record that ``tensor`` is dequantized at load for ``reason`` (float tensors need not)."""
    if tensor.type not in _FLOATS:
        plan.dequantized.setdefault(reason, []).append(tensor.name)


def _refuse(plan: GGUFQuantPlan, tensors: list[GGUFTensor], together: str) -> None:
    """Dequantize a module's ``tensors``: those of a type with no kept kernel for that, the
    others for being ``together`` with them (or with another layout)."""
    unkept = "/".join(sorted({t.type_name for t in tensors if t.type not in KEPT_TYPES}))
    for t in tensors:
        if t.type not in KEPT_TYPES:
            _dequantize(plan, f"{t.type_name} (no kept-quantized kernel)", t)
        else:
            _dequantize(plan, f"{together} {unkept or 'another layout'}", t)


def _sort_tensors(
    f: GGUFFile, modules: dict[str, nn.Module], plan: GGUFQuantPlan
) -> tuple[_Parts, _Parts, dict[str, dict[str, GGUFTensor]]]:
    """``(weights, biases, experts)``: the file's tensors that may be kept, by module (stacked
    experts by projection); the others are recorded in ``plan`` as dequantized."""
    weights: _Parts = {}
    biases: _Parts = {}
    experts: dict[str, dict[str, GGUFTensor]] = {}
    arch = str(f.metadata.get("general.architecture"))
    mtp = _first_mtp_block(f, arch)
    for tensor in f.tensors.values():
        hf = _hf_name(tensor.name, arch)
        block = _BLOCK.match(tensor.name)
        if tensor.name == _ROPE_FREQS or hf is None or (block and int(block.group(1)) >= mtp):
            continue  # (blocks past mtp: multi-token prediction, not loaded)
        module, part, leaf = _module_of(hf)
        stacked = _STACKED_EXPERTS.match(hf)
        if arch == "gpt-oss" and ".experts." in hf:
            if tensor.type != _QT.MXFP4:  # (MXFP4 ones are kept packed: MXFP4Experts)
                _dequantize(plan, _GPT_OSS_EXPERTS, tensor)
        elif block is not None and (arch, block.group(2)) in _PAIRS:
            _dequantize(plan, "one matrix written as two (joined at load)", tensor)
        elif stacked is not None:
            experts.setdefault(stacked.group(1), {})[stacked.group(2)] = tensor
        elif ".experts." in hf:
            _dequantize(plan, "one tensor per expert (older files)", tensor)
        elif module.endswith(_ROUTERS):
            _dequantize(plan, "routers (kept in float)", tensor)
        elif not isinstance(modules.get(module), nn.Linear):
            embedding = module.endswith("embed_tokens")
            _dequantize(plan, "the embedding table" if embedding else "not a linear", tensor)
        else:
            target = weights if leaf == "weight" else biases
            target.setdefault(module, {})[part] = (hf, tensor)
    return weights, biases, experts


def _plan_linear(
    plan: GGUFQuantPlan,
    module: str,
    lin: nn.Linear,
    parts: dict[str | None, tuple[str, GGUFTensor]],
    bias_parts: dict[str | None, tuple[str, GGUFTensor]],
    grouped8: bool,
    six_bit: bool,
) -> None:
    """Keep the (fused) linear ``module`` quantized when its parts fit it and have a kernel."""
    # a fused module from its parts, or stored fused (phi3's qkv_proj, gate_up_proj)
    order = (None,) if None in parts else _FUSED.get(module.rpartition(".")[2], (None,))
    found = [parts[p] for p in order if p in parts]
    found_bias = [bias_parts[p] for p in order if p in bias_parts]
    tensors = [t for _, t in found]
    if (
        len(found) != len(order)
        or len(found_bias) != (len(order) if lin.bias is not None else 0)
        or sum(t.shape[0] for t in tensors) != lin.out_features
        or any(len(t.shape) != 2 or t.shape[1] != lin.in_features for t in tensors)
        or any(t.type not in KEPT_TYPES for t in tensors)
    ):  # dequantized; load_weights reports missing or misshapen parts
        _refuse(plan, tensors, "fused with")
        return
    layout = module_layout(tensors, six_bit)
    dtype = _scale_dtype(tensors, layout)
    if layout.bits == 8 and not grouped8:
        for t in tensors:
            _dequantize(plan, _NO_KERNEL, t)
        return
    plan.kept.append(KeptLinear(module, found, found_bias, layout, dtype))


def _plan_experts(
    plan: GGUFQuantPlan,
    module: str,
    ex: nn.Module | None,
    stack: dict[str, GGUFTensor],
    grouped8: bool,
    six_bit: bool,
) -> None:
    """Keep the stacked experts ``module`` quantized when they fit it and have a kernel."""
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
        or any(t.type not in KEPT_TYPES for t in tensors)
    ):  # dequantized; load_weights reports missing or misshapen experts
        _refuse(plan, tensors, "experts with")
        return
    gate_up_layout, down_layout = (
        module_layout([gate, up], six_bit),
        module_layout([down], six_bit),
    )
    if not grouped8 and 8 in (gate_up_layout.bits, down_layout.bits):
        for t in tensors:
            _dequantize(plan, _NO_KERNEL, t)
        return
    plan.experts.append(
        KeptExperts(
            module,
            gate,
            up,
            down,
            gate_up_layout,
            down_layout,
            _scale_dtype([gate, up], gate_up_layout),
            _scale_dtype([down], down_layout),
        )
    )


def plan_gguf_quantized(
    f: GGUFFile, model: nn.Module, grouped8: bool = True, six_bit: bool = False
) -> GGUFQuantPlan:
    """Which linears and experts of ``model`` (built for ``f``'s config) are kept quantized, and
    which quantized tensors are dequantized and why. Everything is dequantized when
    ``FOUDRE_GGUF_DEQUANTIZE=1``; layouts of group-wise 8 bits (Q8_0, Q5_*, Q6_K) unless
    ``grouped8`` (our CPU kernels build with AVX-512 or AVX2, or CUDA's Triton kernels):
    elsewhere they have no kernel and would be dequantized at every call. Modules all of Q6_K in
    6 bits where ``six_bit`` (our CPU kernels), else in 8 bits."""
    plan = GGUFQuantPlan()
    if os.environ.get(ENV, "0") not in ("", "0"):
        return plan
    modules = dict(model.named_modules())
    weights, biases, experts = _sort_tensors(f, modules, plan)
    for module, parts in weights.items():
        lin = modules[module]
        assert isinstance(lin, nn.Linear)
        _plan_linear(plan, module, lin, parts, biases.get(module, {}), grouped8, six_bit)
    for module, stack in experts.items():
        _plan_experts(plan, module, modules.get(module), stack, grouped8, six_bit)
    return plan


# the types whose scale is the file's float16 d and whose zero point is none, or Q4_0's 8 (0 in
# a group whose d is 0)
_HALF_SCALES = (_QT.Q4_0, _QT.Q5_0, _QT.Q8_0)


def _scale_dtype(tensors: list[GGUFTensor], layout: Layout) -> torch.dtype:
    """float16 holds the scales (``d``) and zero points (none, 8 or 0) of Q4_0, Q5_0 and Q8_0
    exactly, in any mix, and 6 bits' ``d``; float32 the others' (``d sc``, ``c / s``)."""
    half = layout.bits == 6 or all(t.type in _HALF_SCALES for t in tensors)
    return torch.float16 if half else torch.float32


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, new)


def swap_in_quantized(model: nn.Module, plan: GGUFQuantPlan) -> None:
    """Replace the planned linears and experts of ``model`` (still on the meta device, in its
    dtype) by empty ``QuantLinear`` / ``QuantExperts`` modules of the same device and dtype
    (scales in the plan's)."""

    def empty(
        like: torch.Tensor, k: int, n: int, layout: Layout, bias: bool, scales: torch.dtype
    ) -> QuantLinear:
        return QuantLinear(
            k,
            n,
            layout.bits,
            layout.group,
            bias=bias,
            dtype=like.dtype,
            device=like.device,
            scale_dtype=scales,
            zero_point=layout.bits == 8 and layout.zero_point,
        )

    for kept in plan.kept:
        lin = model.get_submodule(kept.module)
        assert isinstance(lin, nn.Linear)
        bias = lin.bias is not None
        new = empty(
            lin.weight, lin.in_features, lin.out_features, kept.layout, bias, kept.scale_dtype
        )
        _set_module(model, kept.module, new)
    for ke in plan.experts:
        ex = model.get_submodule(ke.module)
        assert isinstance(ex, Experts)
        n, two_i, hidden = ex.gate_up_proj.shape
        w, gu, dn = ex.gate_up_proj, ke.gate_up_layout, ke.down_layout
        gate_up = [empty(w, hidden, two_i, gu, False, ke.gate_up_dtype) for _ in range(n)]
        down = [empty(w, two_i // 2, hidden, dn, False, ke.down_dtype) for _ in range(n)]
        _set_module(model, ke.module, QuantExperts(gate_up, down))


def _row_order(config: ModelConfig, hf: str, rows: int) -> torch.Tensor | None:
    """The order to read the rows of ``hf`` in, as the model loads its float weights: q/k of
    llama and granitehybrid files un-permuted (``iter_gguf_weights``), DeepSeek's rotated rows
    from interleaved pairs to evens then odds (``DeepseekV3ForCausalLM``, ``rope_interleave``);
    None for other tensors."""
    order = torch.arange(rows)
    if config.architecture in _PERMUTED_QK:
        if ".q_proj." in hf:
            return _unpermute_rope(order, config.num_attention_heads)
        return _unpermute_rope(order, config.num_key_value_heads) if ".k_proj." in hf else None
    if config.architecture != "deepseek_v3" or not config.rope_interleave:
        return None
    rope, nope = config.qk_rope_head_dim, config.qk_nope_head_dim
    pairs = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if ".kv_a_proj_with_mqa." in hf:  # the latent's rows, then the shared rotated key's
        order[-rope:] = order[-rope:][pairs]
    elif ".q_b_proj." in hf:  # per head: nope rows, then rope rows
        heads = order.view(-1, nope + rope)
        heads[:, nope:] = heads[:, nope:][:, pairs]
    else:
        return None
    return order


def _fill(mod: nn.Module, rows: slice, c: Codes) -> None:
    """Copy codes (unpacked), scales and zeros into the rows ``rows`` of ``mod``'s buffers."""
    assert isinstance(mod, QuantLinear) and not mod.interleaved  # (rows, written in place)
    q = c.codes
    if mod.bits == 6:
        assert c.subs is not None
        mod.qweight[rows].copy_(pack_int6(q, c.subs))
        mod.scales[rows].copy_(c.scales)
        mod.invalidate_layouts()
        return
    if mod.bits == 4:
        q = q[:, 0::2] | (q[:, 1::2] << 4)  # pack_int4's order
    assert (mod.zeros is None) == (c.zeros is None)
    if mod.zeros is not None and c.zeros is not None:
        mod.zeros[rows].copy_(c.zeros)
    mod.qweight[rows].copy_(q)
    mod.scales[rows].copy_(c.scales)
    mod.invalidate_layouts()


def _row_chunks(tensor: GGUFTensor, whole: bool) -> list[slice]:
    """The rows of ``tensor`` (leading dimensions flattened) in pieces of about
    ``CHUNK_BYTES`` of codes (one piece where ``whole``), so that decoding holds only a piece's
    temporaries at a time."""
    total = math.prod(tensor.shape[:-1])
    step = total if whole else max(1, CHUNK_BYTES // max(1, tensor.shape[-1]))
    return [slice(r, min(r + step, total)) for r in range(0, total, step)]


def _load_kept(
    f: GGUFFile,
    config: ModelConfig,
    mod: QuantLinear,
    kept: KeptLinear,
    room: tuple[str, torch.Tensor] | None,
) -> None:
    """Fill the (fused) linear ``mod`` from its tensors: straight into the kernels' 16-row
    blocks where ``room`` gives their layout and place (``_blocks_room``), 6 bits natively
    (``_load_int6``), else a few megabytes of rows at a time (q/k of llama files whole: their
    rows are un-permuted); each tensor's pages then released."""
    loaded = room is not None and _load_blocks(f, config, mod, kept, *room)
    loaded = loaded or (kept.layout.bits == 6 and _load_int6(f, config, mod, kept))
    if not loaded:
        _load_rows(f, config, mod, kept)
    start = 0
    for hf, tensor in kept.biases:
        assert mod.bias is not None
        b = dequantize_tensor(f, tensor)
        order = _row_order(config, hf, b.shape[0])
        b = b if order is None else b[order]
        mod.bias[start : start + b.shape[0]].copy_(b)
        start += b.shape[0]


def _load_rows(f: GGUFFile, config: ModelConfig, mod: QuantLinear, kept: KeptLinear) -> None:
    """Fill ``mod``'s rows (codes, scales, zero points) from its tensors' decoded codes."""
    start = 0
    for hf, tensor in kept.weights:
        order = _row_order(config, hf, tensor.shape[0])
        for rows in _row_chunks(tensor, whole=order is not None):
            c = decode_codes(f, tensor, kept.layout, rows)
            if order is not None:
                zeros = None if c.zeros is None else c.zeros[order]
                subs = None if c.subs is None else c.subs[order]
                c = Codes(c.codes[order], c.scales[order], zeros, subs)
            _fill(mod, slice(start + rows.start, start + rows.stop), c)
            del c
        f.release(tensor)
        release_freed()
        start += tensor.shape[0]


def _load_int6(f: GGUFFile, config: ModelConfig, mod: QuantLinear, kept: KeptLinear) -> bool:
    """Fill a 6-bit ``mod`` (Q6_K parts) natively (``gguf_blocks.int6_rows``: the rows
    ``_load_rows`` writes, in one pass); False where it does not take them (the library did not
    build, a d is a NaN): ``_load_rows`` then."""
    k = mod.in_features
    if gguf_blocks._library() is None or mod.scales.dtype != torch.float16 or k % 256:
        return False
    start = 0
    for hf, tensor in kept.weights:
        rows = tensor.shape[0]
        order = _row_order(config, hf, rows)
        address = f.data.ctypes.data + tensor.offset
        if tensor.type != _QT.Q6_K or tensor.shape != (rows, k):
            return False
        if not gguf_blocks.int6_rows(address, order, rows, k, mod.qweight, mod.scales, start):
            return False
        f.release(tensor)
        start += rows
    mod.invalidate_layouts()
    return True


def _blocks_room(model: nn.Module, plan: GGUFQuantPlan) -> list[tuple[str, torch.Tensor] | None]:
    """Per kept linear of ``plan``, where ``prepare_for_cpu`` would repack its rows into 16-row
    blocks that ``gguf_blocks`` builds straight from its tensors: the layout and room for it,
    views of one map of 2 MiB pages (``huge_pages.arena``: where the model runs from, so that
    nothing is moved there later) or tensors of their own where none is given; else None."""
    params = next(model.parameters(), None)
    if params is None or params.device.type != "cpu" or not uses_native_kernels(params.dtype):
        return [None] * len(plan.kept)
    shapes: list[tuple[str, tuple[int, int]] | None] = []
    for kept in plan.kept:
        mod = model.get_submodule(kept.module)
        assert isinstance(mod, QuantLinear)
        k, lay = mod.in_features, kept.layout
        types = [t.type for _, t in kept.weights]
        kind = gguf_blocks.blocks_kind(types, lay.bits, lay.group, lay.zero_point, k)
        if kind is None or any(t.shape != (t.shape[0], k) for _, t in kept.weights):
            shapes.append(None)
        else:
            shapes.append((kind, gguf_blocks.shape(kind, mod.out_features, k)))
    spans = [0 if s is None else -(-math.prod(s[1]) // 64) * 64 for s in shapes]
    mapped = huge_pages.arena(sum(spans)) if any(spans) else None
    rooms: list[tuple[str, torch.Tensor] | None] = []
    pos = 0 if mapped is None else mapped.storage_offset()
    for s, span in zip(shapes, spans, strict=True):
        if s is None:
            rooms.append(None)
            continue
        if mapped is None:
            room = torch.empty(s[1], dtype=torch.uint8)
        else:  # a tensor on the map's storage, not a view of the map
            room = torch.empty(0, dtype=torch.uint8)
            room.set_(mapped.untyped_storage(), pos, s[1], (s[1][1], 1))
        rooms.append((s[0], room))
        pos += span
    return rooms


def _load_blocks(
    f: GGUFFile,
    config: ModelConfig,
    mod: QuantLinear,
    kept: KeptLinear,
    kind: str,
    out: torch.Tensor,
) -> bool:
    """Fill ``out`` with ``mod``'s weight as the 16-row blocks ``kind`` that ``prepare_for_cpu``
    would build of its rows (``gguf_blocks``: the same bytes, repacked from the file's blocks
    in one pass) and make it ``mod``'s; False, ``mod`` as it was, where a group's ``d`` gives
    the rows another form (``gguf_blocks.repack``)."""
    k, zeros = mod.in_features, gguf_blocks.ZeroPoints()
    base, start = f.data.ctypes.data, 0
    for hf, tensor in kept.weights:
        rows = tensor.shape[0]
        order = _row_order(config, hf, rows)
        address = base + tensor.offset
        if not gguf_blocks.repack(kind, tensor.type, address, order, rows, k, out, start, zeros):
            return False
        f.release(tensor)
        start += rows
    assert start == mod.out_features, (kept.module, start, mod.out_features)
    if kind == "int4x16z" and zeros.alike():  # (then held as one zc, no zero points stored)
        return False
    gguf_blocks.pad(kind, out, k, start)
    held, zc, stored = gguf_blocks.held_as(kind)
    mod.adopt_blocks(out, held, k, zc, stored)
    return True


def _load_experts(f: GGUFFile, qe: QuantExperts, ke: KeptExperts) -> None:
    """Fill the experts ``qe`` from their stacked tensors, one expert's rows at a time."""
    inter = ke.gate.shape[1]
    for tensor, linears, first, layout in (
        (ke.gate, qe.gate_up, 0, ke.gate_up_layout),
        (ke.up, qe.gate_up, inter, ke.gate_up_layout),
        (ke.down, qe.down, 0, ke.down_layout),
    ):
        rows = tensor.shape[1]
        for e, lin in enumerate(linears):
            c = decode_codes(f, tensor, layout, slice(e * rows, (e + 1) * rows))
            _fill(lin, slice(first, first + rows), c)
            del c
        f.release(tensor)
        release_freed()


@torch.no_grad()
def load_gguf_quantized(
    f: GGUFFile, config: ModelConfig, model: nn.Module, plan: GGUFQuantPlan
) -> None:
    """Fill the modules ``swap_in_quantized`` made (now allocated) from the file's codes, and
    log which quantized tensors were dequantized instead, and why. The file is read a piece of
    a tensor at a time, each tensor's pages dropped from the process once read
    (``GGUFFile.release``)."""
    rooms = _blocks_room(model, plan)
    for kept, room in zip(plan.kept, rooms, strict=True):
        mod = model.get_submodule(kept.module)
        assert isinstance(mod, QuantLinear)
        _load_kept(f, config, mod, kept, room)
    del rooms
    for ke in plan.experts:
        qe = model.get_submodule(ke.module)
        assert isinstance(qe, QuantExperts)
        _load_experts(f, qe, ke)
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
