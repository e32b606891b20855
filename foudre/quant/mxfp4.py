"""MXFP4 (OCP Microscaling FP4) weights kept packed: gpt-oss's expert weights, and GGUF's MXFP4.

The layout is the gpt-oss checkpoint's, per weight ``[N, K]`` (``K`` a multiple of 32)::

    blocks [N, K / 32, 16] uint8   per block of 32 columns, 16 bytes of E2M1 codes: byte j holds
                                   column 2j in its low nibble and column 2j + 1 in its high one
    scales [N, K / 32]     uint8   the block's E8M0 exponent s: w = E2M1[code] * 2^(s - 127)

with ``E2M1 = 0, .5, 1, 1.5, 2, 3, 4, 6`` for codes 0..7 and their negatives for 8..15 (bit 3
the sign). Stacked experts add a leading ``[E]``. Every value is exact in bfloat16 and float32.

- ``dequantize_mxfp4(blocks, scales, dtype)``: the reference ``[..., K]``.
- ``quantize_mxfp4(w)``: round to nearest (ties to even) E2M1 with a shared power-of-two scale per
  32 columns, ``2^(floor(log2 max|w|) - 2)`` as OCP defines it (values beyond 6 saturate).
- ``mxfp4_matmul(x, blocks, scales, bias)``: ``x [M, K] @ W^T + bias``, never expanding ``W``:
  on CUDA the Triton kernels (``mxfp4_triton``), on the CPU the native kernel
  (``native/cpu_mxfp4.cpp``: a block's codes become floats in registers; AVX-512, AVX2 or
  portable loops, threads over N) up to ``GEMM_ROWS`` rows, beyond them the weight dequantized
  a few rows at a time into torch's GEMM; elsewhere dequantize-then-matmul.
- ``from_gguf(raw, shape)``: a GGUF MXFP4 tensor's bytes as the same blocks and scales
  (``to_gguf`` the other way).
- ``MXFP4Experts``: stacked routed experts of a mixture of experts in this layout (a
  checkpoint's tensors held as they are: ``from_tensors``; float experts quantized:
  ``from_float``, ``from_experts``, and ``quant.api.MXFP4``, the ``mxfp4`` method at load);
  on CUDA grouped Triton kernels over all the experts (``mxfp4_triton.fused_experts``).

Where a value is 0 times an infinite scale (E8M0 255, NaN in OCP) the product is NaN, in the
reference and the kernels alike.
"""

from __future__ import annotations

import ctypes
import math
import os
from collections.abc import Callable, Mapping
from functools import cache, lru_cache, partial
from typing import cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from foudre.layers import fused_moe
from foudre.layers.linear import gemm_dtype
from foudre.layers.moe import (
    ClampedSwiGLUExperts,
    Experts,
    capturing,
    clamped_swiglu,
    every_expert,
    grouped_experts,
    silu_mul,
    swiglu_params,
)
from foudre.native import build as native

BLOCK = 32  # columns a scale covers
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# midpoints between the E2M1 magnitudes: round to nearest
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# rows of x from which the CPU product dequantizes into torch's GEMM: the kernel expands the
# codes again for every 4 rows, the GEMM path once (5760 x 2880 on one core of a Xeon with
# AVX-512 BF16, bfloat16 x: 4.1 against 4.9 ms at 8 rows, 10.3 against 5.3 at 16)
GEMM_ROWS = 10
DEQUANTIZED_CHUNK_BYTES = 4 << 20  # weight rows dequantized at a time on that path

SOURCE = native.SOURCES / "cpu_mxfp4.cpp"
PATHS = ("portable", "avx512", "avx2")
_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def check_layout(blocks: torch.Tensor, scales: torch.Tensor) -> int:
    """The input features K of ``blocks [..., K / 32, 16]`` and ``scales [..., K / 32]`` (both
    uint8, one device); ``ValueError`` naming what is wrong otherwise."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype}, {scales.dtype}")
    if (
        blocks.dim() < 2
        or blocks.shape[-1] != 16
        or tuple(blocks.shape[:-1]) != tuple(scales.shape)
    ):
        raise ValueError(
            f"MXFP4 blocks [..., K / 32, 16] and scales [..., K / 32] expected, got "
            f"{tuple(blocks.shape)} and {tuple(scales.shape)}"
        )
    if blocks.device != scales.device:
        raise ValueError(f"MXFP4 blocks on {blocks.device}, scales on {scales.device}")
    return blocks.shape[-2] * BLOCK


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """``2^(s - 127)`` in float32 for E8M0 bytes (exact: s = 0 is the subnormal 2^-127, 255 is
    +inf)."""
    s = scales.to(torch.int32)
    return torch.where(s > 0, s << 23, torch.full_like(s, 0x00400000)).view(torch.float32)


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """The weight ``[..., K]`` of ``blocks [..., K / 32, 16]`` and ``scales [..., K / 32]``, in
    ``dtype`` (exact in float32 and bfloat16), on their device."""
    k = check_layout(blocks, scales)
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]
    values = table[codes].flatten(-2) * scale_values(scales)[..., None]
    return values.reshape(*blocks.shape[:-2], k).to(dtype)


@torch.no_grad()
def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of a float weight ``w [..., K]`` (K a multiple of 32): per block of 32
    columns the shared scale ``2^(floor(log2 max|w|) - 2)`` (E8M0, clamped to its range; 2^-127
    for a block of zeros) and each value's nearest E2M1 multiple of it (ties to the even code,
    magnitudes beyond 6 saturating), as the OCP MX specification converts."""
    k = w.shape[-1]
    if k % BLOCK:
        raise ValueError(f"MXFP4 needs the input features K to be a multiple of 32, got {k}")
    wb = w.float().reshape(*w.shape[:-1], k // BLOCK, BLOCK)
    amax = wb.abs().amax(-1)
    exponent = torch.frexp(amax).exponent - 1  # floor(log2 amax): amax = m 2^e, m in [.5, 1)
    s = torch.where(amax > 0, exponent - 2 + 127, torch.zeros_like(exponent)).clamp(0, 254)
    scales = s.to(torch.uint8)
    scaled = wb / scale_values(scales)[..., None]
    magnitude = scaled.abs().contiguous()
    bounds = torch.tensor(_BOUNDS, device=w.device)
    code = torch.bucketize(magnitude, bounds)  # a midpoint goes to the lower code: ties ...
    tie = (code < len(_BOUNDS)) & (magnitude == bounds[code.clamp(max=len(_BOUNDS) - 1)])
    code = code + (tie & (code % 2 == 1)).long()  # ... to the even one
    code = code | ((scaled < 0) & (code > 0)).long() << 3
    code = code.to(torch.uint8)
    return (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous(), scales.contiguous()


def from_gguf(
    raw: np.ndarray | torch.Tensor, shape: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(blocks, scales)`` of a GGUF MXFP4 tensor of ``shape`` (PyTorch order ``[..., K]``) from
    its bytes ``raw`` (uint8, e.g. ``f.data[t.offset : t.offset + t.nbytes]`` of a
    ``loading.gguf.GGUFTensor``): ggml's ``block_mxfp4`` is 17 bytes a block of 32, the E8M0
    byte then 16 bytes whose low nibbles are values 0..15 and high nibbles 16..31, over a table
    twice E2M1 with a scale of ``2^(e - 128)``: the same ``e`` here, the codes re-paired as
    ``[..., K / 32, 16]`` (columns 2j, 2j + 1 a byte). Nothing is dequantized."""
    k = shape[-1]
    if k % BLOCK:
        raise ValueError(f"GGUF MXFP4 tensor of shape {shape}: K = {k} is not a multiple of 32")
    # (numpy: the file's map is read-only, and every array below is a new one)
    data = np.asarray(raw.cpu().numpy() if isinstance(raw, torch.Tensor) else raw, np.uint8)
    rows, groups = math.prod(shape[:-1]), k // BLOCK
    if data.size != rows * groups * 17:
        raise ValueError(
            f"GGUF MXFP4 tensor of shape {shape}: {rows * groups * 17} bytes expected, got "
            f"{data.size}"
        )
    data = data.reshape(rows, groups, 17)
    even, odd = data[..., 1::2], data[..., 2::2]  # ggml's code bytes 2j and 2j + 1
    blocks = np.empty((rows, groups, 16), np.uint8)
    # byte j: columns 2j and 2j + 1, their low nibbles; byte 8 + j: 16 + 2j, 17 + 2j, the high
    blocks[..., :8] = (even & 15) | ((odd & 15) << 4)
    blocks[..., 8:] = (even >> 4) | (odd & 0xF0)
    return (
        torch.from_numpy(blocks).reshape(*shape[:-1], groups, 16),
        torch.from_numpy(np.ascontiguousarray(data[..., 0])).reshape(*shape[:-1], groups),
    )


def to_gguf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The bytes ``[rows, K / 32 * 17]`` of ggml's ``block_mxfp4`` for ``blocks`` and ``scales``
    (``from_gguf``'s inverse: what a GGUF writer stores)."""
    k = check_layout(blocks, scales)
    b = blocks.reshape(-1, k // BLOCK, 16)
    codes = torch.stack([b & 15, b >> 4], dim=-1).flatten(-2)  # column order
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return torch.cat([scales.reshape(-1, k // BLOCK, 1), qs], dim=-1).reshape(b.shape[0], -1)


# ----------------------------------------------------------------------------- the products


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    dll = native.load(SOURCE)
    if dll is None:
        return None
    for suffix in _DTYPES.values():
        # x, blocks, scales, bias, y, m, n, k
        getattr(dll, f"foudre_mxfp4_mm_{suffix}").argtypes = [_P, _P, _P, _P, _P, _I64, _I64, _I64]
        # blocks, scales, out, n0, n1, k
        getattr(dll, f"foudre_mxfp4_dequantize_{suffix}").argtypes = [_P, _P, _P, _I64, _I64, _I64]
        # x, rows, hidden, inter, ids, weights, top_k, gate_up blocks, scales, bias, down
        # blocks, scales, bias, bias_bf16, experts, interleaved, alpha, limit, out
        fn = getattr(dll, f"foudre_mxfp4_gpt_oss_experts_{suffix}")
        fn.argtypes = [_P, _I64, _I64, _I64, _P, _P, _I64, *[_P] * 6, ctypes.c_int, _I64]
        fn.argtypes += [ctypes.c_int, ctypes.c_float, ctypes.c_float, _P]
        fn.restype = ctypes.c_int
    return dll


@lru_cache(maxsize=1)
def path() -> str | None:
    """``"avx512"``, ``"avx2"`` or ``"portable"``: the path the native kernel was built for; None
    where it did not build."""
    dll = _library()
    return None if dll is None else PATHS[dll.foudre_mxfp4_path()]


def _check_product(x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor) -> int:
    k = check_layout(blocks, scales)
    if blocks.dim() != 3:
        raise ValueError(f"one MXFP4 weight [N, K / 32, 16] expected, got {tuple(blocks.shape)}")
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(
            f"x [M, K] with K = {k} (the weight's, a multiple of 32) expected, got {tuple(x.shape)}"
        )
    if x.device != blocks.device:
        raise ValueError(f"x on {x.device}, the MXFP4 weight on {blocks.device}")
    return k


def _on_cpu(blocks: torch.Tensor) -> None:
    """``ValueError`` unless the weight is in host memory (the native kernels read it there)."""
    if blocks.device.type != "cpu":
        raise ValueError(f"the native MXFP4 kernels read CPU tensors, got {blocks.device}")


def _bias(bias: torch.Tensor | None, n: int) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.shape != (n,):
        raise ValueError(f"bias [{n}] expected, got {tuple(bias.shape)}")
    return bias.to(torch.float32).contiguous()


def native_matmul(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [M, K] @ W^T + bias`` by the native kernel for any M (``mxfp4_matmul`` takes it up
    to ``GEMM_ROWS`` rows): ``x`` float32 or bfloat16 on the CPU, float32 sums rounded once to
    x's dtype. ``RuntimeError`` where the kernel did not build."""
    k = _check_product(x, blocks, scales)
    _on_cpu(blocks)
    dll = _library()
    if dll is None:
        raise RuntimeError(f"{SOURCE.name} did not build: use mxfp4_matmul_reference")
    if x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(f"x must be float32 or bfloat16 on the CPU, got {x.dtype} {x.device}")
    n, m = blocks.shape[0], x.shape[0]
    x, blocks, scales, b = x.contiguous(), blocks.contiguous(), scales.contiguous(), _bias(bias, n)
    y = torch.empty(m, n, dtype=x.dtype)
    if m and n:
        getattr(dll, f"foudre_mxfp4_mm_{_DTYPES[x.dtype]}")(
            x.data_ptr(), blocks.data_ptr(), scales.data_ptr(), 0 if b is None else b.data_ptr(),
            y.data_ptr(), m, n, k,
        )  # fmt: skip
    return y


def dequantize_rows(
    blocks: torch.Tensor, scales: torch.Tensor, n0: int, n1: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows ``n0:n1`` of the weight ``blocks [N, K / 32, 16]``, ``scales [N, K / 32]`` by the
    native kernel, ``[n1 - n0, K]`` in ``dtype`` (float32 or bfloat16: exact, as
    ``dequantize_mxfp4``). ``RuntimeError`` where the kernel did not build."""
    k = check_layout(blocks, scales)
    _on_cpu(blocks)
    dll = _library()
    if dll is None:
        raise RuntimeError(f"{SOURCE.name} did not build: use dequantize_mxfp4")
    if blocks.dim() != 3 or not 0 <= n0 <= n1 <= blocks.shape[0] or dtype not in _DTYPES:
        raise ValueError(f"rows {n0}:{n1} in {dtype} of a weight {tuple(blocks.shape)}")
    blocks, scales = blocks.contiguous(), scales.contiguous()
    out = torch.empty(n1 - n0, k, dtype=dtype)
    fn = getattr(dll, f"foudre_mxfp4_dequantize_{_DTYPES[dtype]}")
    fn(blocks.data_ptr(), scales.data_ptr(), out.data_ptr(), n0, n1, k)
    return out


def dequantized_matmul(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``native_matmul``'s product for large batches: the weight dequantized by the native kernel
    a few megabytes of rows at a time (in x's dtype, or float32 where torch's bfloat16 GEMM is
    slow: ``layers.linear.gemm_dtype``) into torch's GEMM, never whole."""
    k = _check_product(x, blocks, scales)
    _on_cpu(blocks)
    dll = _library()
    if dll is None:
        raise RuntimeError(f"{SOURCE.name} did not build: use mxfp4_matmul_reference")
    n = blocks.shape[0]
    blocks, scales = blocks.contiguous(), scales.contiguous()
    dtype = gemm_dtype(x.dtype)
    xg = x.to(dtype)
    rows = max(16, DEQUANTIZED_CHUNK_BYTES // (k * xg.element_size()))
    w = torch.empty(min(rows, n), k, dtype=dtype)
    fn = getattr(dll, f"foudre_mxfp4_dequantize_{_DTYPES[dtype]}")
    out = torch.empty(x.shape[0], n, dtype=dtype)
    for n0 in range(0, n, rows):
        n1 = min(n, n0 + rows)
        fn(blocks.data_ptr(), scales.data_ptr(), w.data_ptr(), n0, n1, k)
        torch.matmul(xg, w[: n1 - n0].t(), out=out[:, n0:n1])
    if bias is not None:
        out += _bias(bias, n).to(dtype)  # type: ignore[union-attr]
    return out.to(x.dtype)


def mxfp4_matmul_reference(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Dequantize-then-matmul (the oracle, and the path of devices without a kernel): the weight
    whole in x's dtype, ``F.linear``."""
    _check_product(x, blocks, scales)
    w = dequantize_mxfp4(blocks, scales, x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def mxfp4_matmul(
    x: torch.Tensor, blocks: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``y [M, N] = x [M, K] @ W^T (+ bias [N])`` for the MXFP4 weight ``blocks [N, K / 32, 16]``,
    ``scales [N, K / 32]`` (K a multiple of 32: anything else is refused with a ``ValueError``),
    in x's dtype, W never expanded whole: CUDA, the Triton kernels where Triton imports; CPU,
    float32 or bfloat16 x, the native kernel up to ``GEMM_ROWS`` rows, else dequantized a few
    rows at a time into torch's GEMM; otherwise (or under autograd) ``mxfp4_matmul_reference``."""
    _check_product(x, blocks, scales)
    if torch.is_grad_enabled() and x.requires_grad:
        return mxfp4_matmul_reference(x, blocks, scales, bias)
    if x.is_cuda:
        triton_matmul = _triton_matmul()
        if triton_matmul is not None:
            return triton_matmul(x, blocks, scales, bias)
    elif x.device.type == "cpu" and x.dtype in _DTYPES and _library() is not None:
        if x.shape[0] < GEMM_ROWS:
            return native_matmul(x, blocks, scales, bias)
        return dequantized_matmul(x, blocks, scales, bias)
    return mxfp4_matmul_reference(x, blocks, scales, bias)


@cache
def _triton_matmul() -> Callable[..., torch.Tensor] | None:
    """``mxfp4_triton.matmul``, or None where Triton does not import."""
    try:
        import foudre.quant.mxfp4_triton as mxfp4_triton
    except ImportError:
        return None
    return mxfp4_triton.matmul


@cache
def _triton_experts() -> Callable[..., torch.Tensor] | None:
    """``mxfp4_triton.fused_experts``, or None where Triton does not import."""
    try:
        import foudre.quant.mxfp4_triton as mxfp4_triton
    except ImportError:
        return None
    return mxfp4_triton.fused_experts


# ----------------------------------------------------------------------------- experts

Activation = Callable[[torch.Tensor], torch.Tensor]


def stacked_experts(module: nn.Module) -> bool:
    """Whether ``module`` holds float routed experts in ``layers.moe.Experts``' layout: 3-D
    ``gate_up_proj`` ``[E, 2I, H]`` and ``down_proj`` ``[E, H, I]`` parameters (``Experts``,
    and modules of its call with biases and their own activation, as gpt-oss's)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.is_floating_point()
        and down.shape[:2] == (gate_up.shape[0], gate_up.shape[2])
    )


class MXFP4Experts(nn.Module):
    """The routed experts of a mixture-of-experts layer with MXFP4 weights, kept packed, under
    the gpt-oss checkpoint's own names (so its tensors load as they are, no conversion)::

        gate_up_proj_blocks [E, 2I, H / 32, 16] uint8    gate_up_proj_scales [E, 2I, H / 32] uint8
        down_proj_blocks    [E, H, I / 32, 16]  uint8    down_proj_scales    [E, H, I / 32]  uint8
        gate_up_proj_bias   [E, 2I]  (bias=True)         down_proj_bias      [E, H]

    (H = ``hidden_size``, I = ``intermediate_size``, both multiples of 32; the biases float32
    until the model's ``.to(dtype)`` casts them, the packed bytes stay uint8). Expert ``e`` maps
    rows ``x [n, H]`` to ``down(activation(gate_up(x)))``, each projection ``mxfp4_matmul``
    (+ its bias). The 2I outputs of gate_up stay in the checkpoint's order: ``activation``
    (``[n, 2I] -> [n, I]``) reads them as they are, so gpt-oss passes its clamped SwiGLU over the
    interleaved layout (gate = ``h[:, 0::2]``, up = ``h[:, 1::2]``); the default, ``silu_mul``,
    reads ``[gate | up]`` halves (the layout of ``layers.moe.Experts``).

    Called as ``layers.moe.Experts`` and ``quant.experts.QuantExperts`` are, ``experts(x,
    weights, ids)`` with ``x [T, H]`` and the routing ``weights``, ``ids`` ``[T, k]``: it returns
    ``out[t] = sum_j weights[t, j] * expert(ids[t, j], x[t])`` in x's dtype
    (on CUDA, ``mxfp4_triton.fused_experts``: grouped Triton kernels over the pairs sorted on
    the device, CUDA graphs capture them; on the CPU under ``GEMM_ROWS`` rows with the clamped
    SwiGLU, gpt-oss's, one native call, ``native_experts``; elsewhere ``grouped_experts``: each
    expert with tokens runs once over them, so decode reads only the chosen experts' bytes).

    Loading a gpt-oss checkpoint (``foudre/models`` may not import ``foudre.quant``, a layer
    above it: tests/test_layering.py; the loader, above both, swaps the module in, as quantized
    checkpoints get ``QuantExperts``)::

        prefix = f"model.layers.{i}.mlp.experts."
        layer.mlp.experts = MXFP4Experts.from_tensors(   # the float experts module replaced
            {k[len(prefix):]: v for k, v in checkpoint.items() if k.startswith(prefix)},
            activation=the_model_experts_clamped_swiglu,
        )                                  # the uint8 tensors held as they are, no copy

    or build ``MXFP4Experts(E, H, I, bias=True, activation=...)`` and copy each tensor into the
    buffer of its name (its state_dict's keys). A GGUF file's ``ffn_*_exps`` MXFP4 tensors:
    ``from_gguf`` gives the same blocks and scales (llama.cpp's converter splits gate and up
    into two tensors: their rows re-interleaved, gate row j at 2j and up row j at 2j + 1, give
    the checkpoint's gate_up).
    Quantizing float experts: ``MXFP4Experts.from_float`` (``from_experts`` for
    ``layers.moe.Experts``)."""

    gate_up_proj_blocks: torch.Tensor
    gate_up_proj_scales: torch.Tensor
    down_proj_blocks: torch.Tensor
    down_proj_scales: torch.Tensor
    gate_up_proj_bias: torch.Tensor | None
    down_proj_bias: torch.Tensor | None

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = True,
        activation: Activation | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        for name, size in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
            if size % BLOCK:
                raise ValueError(f"MXFP4 experts need {name} a multiple of 32, got {size}")
        e, h, i = num_experts, hidden_size, intermediate_size
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.activation: Activation = activation or silu_mul

        def u8(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.uint8, device=device)

        def f32(*shape: int) -> torch.Tensor | None:
            return torch.zeros(*shape, dtype=torch.float32, device=device) if bias else None

        self.register_buffer("gate_up_proj_blocks", u8(e, 2 * i, h // BLOCK, 16))
        self.register_buffer("gate_up_proj_scales", u8(e, 2 * i, h // BLOCK))
        self.register_buffer("down_proj_blocks", u8(e, h, i // BLOCK, 16))
        self.register_buffer("down_proj_scales", u8(e, h, i // BLOCK))
        self.register_buffer("gate_up_proj_bias", f32(e, 2 * i))
        self.register_buffer("down_proj_bias", f32(e, h))

    @classmethod
    @torch.no_grad()
    def from_float(
        cls,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        gate_up_bias: torch.Tensor | None = None,
        down_bias: torch.Tensor | None = None,
        activation: Activation | None = None,
    ) -> MXFP4Experts:
        """Float experts quantized (``quantize_mxfp4``): ``gate_up [E, 2I, H]`` and ``down [E, H,
        I]`` in foudre's ``[out, in]`` orientation (transformers' gpt-oss stores them
        transposed: ``[E, H, 2I]``, ``[E, I, H]``), biases ``[E, 2I]`` and ``[E, H]`` or None."""
        e, two_i, h = gate_up.shape
        if tuple(down.shape) != (e, h, two_i // 2):
            raise ValueError(f"down [E, H, I] = {(e, h, two_i // 2)} expected, got {down.shape}")
        mod = cls(e, h, two_i // 2, gate_up_bias is not None, activation, gate_up.device)
        if (gate_up_bias is None) != (down_bias is None):
            raise ValueError("MXFP4Experts takes both biases or neither")
        mod.gate_up_proj_blocks[:], mod.gate_up_proj_scales[:] = quantize_mxfp4(gate_up)
        mod.down_proj_blocks[:], mod.down_proj_scales[:] = quantize_mxfp4(down)
        if gate_up_bias is not None and down_bias is not None:
            mod.gate_up_proj_bias = gate_up_bias.detach().float().clone()
            mod.down_proj_bias = down_bias.detach().float().clone()
        return mod

    @classmethod
    def from_tensors(
        cls, tensors: Mapping[str, torch.Tensor], activation: Activation | None = None
    ) -> MXFP4Experts:
        """The experts holding a checkpoint's tensors of one layer as they are (no copy, nothing
        allocated besides), keyed by the buffers' names (``gate_up_proj_blocks``,
        ``gate_up_proj_scales``, ``down_proj_blocks``, ``down_proj_scales``, and optionally
        both biases: the checkpoint's ``model.layers.{i}.mlp.experts.`` names without that
        prefix); the sizes read from their shapes. ``ValueError`` naming a missing tensor or a
        shape that does not fit."""
        names = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks")
        missing = [n for n in (*names, "down_proj_scales") if n not in tensors]
        if missing:
            raise ValueError(f"MXFP4 experts: missing {', '.join(missing)}")
        gb, gs = tensors["gate_up_proj_blocks"], tensors["gate_up_proj_scales"]
        db, ds = tensors["down_proj_blocks"], tensors["down_proj_scales"]
        h, i = check_layout(gb, gs), check_layout(db, ds)
        e = gb.shape[0]
        if gb.dim() != 4 or tuple(gb.shape[:2]) != (e, 2 * i) or tuple(db.shape[:2]) != (e, h):
            raise ValueError(
                f"MXFP4 experts: gate_up_proj_blocks [E, 2I, H/32, 16] and down_proj_blocks "
                f"[E, H, I/32, 16] do not fit: {tuple(gb.shape)}, {tuple(db.shape)}"
            )
        gu_bias, d_bias = tensors.get("gate_up_proj_bias"), tensors.get("down_proj_bias")
        if (gu_bias is None) != (d_bias is None):
            raise ValueError(
                "MXFP4 experts: both biases (gate_up_proj_bias, down_proj_bias) or none"
            )
        if (
            gu_bias is not None
            and d_bias is not None
            and (tuple(gu_bias.shape) != (e, 2 * i) or tuple(d_bias.shape) != (e, h))
        ):
            raise ValueError(
                f"MXFP4 experts: biases [{e}, {2 * i}] and [{e}, {h}] expected, got "
                f"{tuple(gu_bias.shape)} and {tuple(d_bias.shape)}"
            )
        mod = cls(e, h, i, gu_bias is not None, activation, device="meta")
        mod.gate_up_proj_blocks, mod.gate_up_proj_scales = gb, gs
        mod.down_proj_blocks, mod.down_proj_scales = db, ds
        mod.gate_up_proj_bias, mod.down_proj_bias = gu_bias, d_bias
        return mod

    @classmethod
    def from_experts(cls, experts: nn.Module) -> MXFP4Experts:
        """Float stacked experts quantized: ``layers.moe.Experts`` (``[gate | up]``, no biases,
        ``silu_mul``), or any module of its layout (``stacked_experts``) whose
        ``gate_up_proj_bias`` and ``down_proj_bias`` and ``activation`` method (gpt-oss's
        clamped SwiGLU experts) are kept: the same rows, so the same activation reads them."""
        if not stacked_experts(experts):
            raise ValueError(f"{type(experts).__name__} is not stacked experts (stacked_experts)")
        activation = None if isinstance(experts, Experts) else getattr(experts, "activation", None)
        if isinstance(experts, ClampedSwiGLUExperts):  # (not a bound method: it would keep the
            # float module, its weights included, alive; and a native kernel reads the partial)
            activation = partial(clamped_swiglu, alpha=experts.alpha, limit=experts.limit)
        return cls.from_float(
            cast(torch.Tensor, experts.gate_up_proj),
            cast(torch.Tensor, experts.down_proj),
            cast(torch.Tensor | None, getattr(experts, "gate_up_proj_bias", None)),
            cast(torch.Tensor | None, getattr(experts, "down_proj_bias", None)),
            activation if callable(activation) else None,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        """The float weights ``(gate_up [E, 2I, H], down [E, H, I])`` (for references)."""
        return (
            dequantize_mxfp4(self.gate_up_proj_blocks, self.gate_up_proj_scales, dtype),
            dequantize_mxfp4(self.down_proj_blocks, self.down_proj_scales, dtype),
        )

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` over the rows ``x`` ``[n, H]``: ``[n, H]`` in x's dtype."""
        gb, db = self.gate_up_proj_bias, self.down_proj_bias
        h = mxfp4_matmul(
            x,
            self.gate_up_proj_blocks[e],
            self.gate_up_proj_scales[e],
            None if gb is None else gb[e],
        )
        h = self.activation(h).to(x.dtype)
        return mxfp4_matmul(
            h, self.down_proj_blocks[e], self.down_proj_scales[e], None if db is None else db[e]
        )

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and not (torch.is_grad_enabled() and x.requires_grad):
            fused = _triton_experts()
            if fused is not None:  # grouped kernels, no host synchronisation
                gate_up = (self.gate_up_proj_blocks, self.gate_up_proj_scales)
                down = (self.down_proj_blocks, self.down_proj_scales)
                return fused(
                    x,
                    (*gate_up, self.gate_up_proj_bias),
                    (*down, self.down_proj_bias),
                    weights,
                    ids,
                    self.activation,
                )
        if self._native(x):
            return native_experts(x, weights, ids, self)
        if capturing(x):  # a CUDA graph: no sort on the host
            return every_expert(x, weights, ids, self.num_experts, self.expert)
        return grouped_experts(x, weights, ids, self.num_experts, self.expert)

    def _native(self, x: torch.Tensor) -> bool:
        """Whether ``native_experts`` runs this call: a CPU batch under ``GEMM_ROWS`` rows
        (each expert's product is then ``native_matmul``'s, bit for bit), float32 or bfloat16,
        the clamped SwiGLU, biases of x's dtype or float32 (or none), nothing autograd records."""
        gb, db = self.gate_up_proj_bias, self.down_proj_bias
        return (
            x.device.type == "cpu"
            and x.dim() == 2
            and x.shape[0] < GEMM_ROWS
            and x.dtype in _DTYPES
            and not (torch.is_grad_enabled() and x.requires_grad)
            and self.gate_up_proj_blocks.device.type == "cpu"
            and (gb is None) == (db is None)
            and (gb is None or gb.dtype == db.dtype in (torch.float32, torch.bfloat16))  # type: ignore[union-attr]
            and swiglu_params(self.activation) is not None
            and os.environ.get("FOUDRE_FUSED_CPU_OPS", "1") != "0"  # (as the other native ops)
            and _library() is not None
        )

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, hidden={self.hidden_size}, "
            f"intermediate={self.intermediate_size}, mxfp4"
        )


def native_experts(
    x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: MXFP4Experts
) -> torch.Tensor:
    """``experts(x, weights, ids)`` for gpt-oss's MXFP4 experts (the clamped SwiGLU as their
    ``activation``: ``layers.moe.swiglu_params``) in one native call (``cpu_mxfp4.cpp``, the
    driver of ``native/cpu_moe_experts.h``): only the chosen experts' blocks read, each
    product ``native_matmul``'s (bit for bit), the activation rounding as torch's ops in x's
    dtype, the weighted sum in float32 in increasing expert order as ``grouped_experts``.
    ``x`` ``[T, H]`` float32 or bfloat16 on the CPU, ``weights`` and ``ids`` ``[T, k]``;
    ``ValueError`` for another activation or a tensor of the wrong shape, ``IndexError`` for an
    id outside ``0..E``."""
    params = swiglu_params(experts.activation)
    if params is None:
        raise ValueError("native_experts runs the clamped SwiGLU only (layers.moe.swiglu_params)")
    fused_moe.check_routing(x, weights, ids)
    if x.shape[1] != experts.hidden_size or x.dtype not in _DTYPES or x.device.type != "cpu":
        raise ValueError(
            f"native_experts: x [T, {experts.hidden_size}] float32 or bfloat16 on the CPU "
            f"expected, got {tuple(x.shape)} {x.dtype} {x.device}"
        )
    dll = _library()
    if dll is None:
        raise RuntimeError(f"{SOURCE.name} did not build")
    alpha, limit, interleaved = params
    gb, db = experts.gate_up_proj_bias, experts.down_proj_bias
    if gb is not None and db is not None and gb.dtype != db.dtype:
        db = db.to(gb.dtype)
    x, ids = x.contiguous(), ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    tensors = [
        experts.gate_up_proj_blocks.contiguous(),
        experts.gate_up_proj_scales.contiguous(),
        None if gb is None else gb.contiguous(),
        experts.down_proj_blocks.contiguous(),
        experts.down_proj_scales.contiguous(),
        None if db is None else db.contiguous(),
    ]
    out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    failed = getattr(dll, f"foudre_mxfp4_gpt_oss_experts_{_DTYPES[x.dtype]}")(
        x.data_ptr(), x.shape[0], experts.hidden_size, experts.intermediate_size,
        ids.data_ptr(), weights.data_ptr(), ids.shape[1],
        *[None if t is None else t.data_ptr() for t in tensors],
        int(gb is not None and gb.dtype == torch.bfloat16), experts.num_experts,
        int(interleaved), alpha, limit, out.data_ptr(),
    )  # fmt: skip
    if failed:
        raise IndexError(f"native_experts: an expert id outside 0..{experts.num_experts}")
    return out
