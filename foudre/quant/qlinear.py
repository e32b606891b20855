"""``QuantLinear``: a weight-only quantized linear over the canonical layouts of
``foudre.quant.packing`` (8-bit per channel or group-wise with optional zero points, 4-bit
group-wise, 6-bit as GGUF's Q6_K). On a CPU with AVX-512 or AVX2 our kernels (``cpu_qmatmul``)
read those buffers as they are: batches below ``dequantized_gemm_rows`` (64; 32 for group-wise
8-bit, GGUF's forms; on AVX2 96-2048; 1024 for the layouts on AMX's tiles, 160 and 128 for 8 and
4 bits in groups of 32 there) through the integer kernel, larger ones (prefill chunks, larger
decode batches) as the weight dequantized a few rows at a time into torch's GEMM; elsewhere
torch's packed kernels (``kernels``; group-wise 8-bit and 6-bit there run
``forward_reference``). On CUDA the Triton kernels (``triton_kernels``: a split-K GEMV at one
row, dequantizing tiles in registers above; 6-bit: ``forward_reference``, the GGUF loader keeps
Q6_K there in group-wise 8 bits).

With AVX512-VNNI (and on AVX2) the integer kernel rounds the activations to int8 per block
(``cpu_qmatmul.activation_block``): ``cpu_qmatmul.error_bound`` bounds the difference from
``forward_reference`` and ``cpu_qmatmul.round_like_kernel`` reproduces the rounding.

Optional per module: ``input_scale`` ``[K]`` (AWQ scaling that could not be folded into the
previous op; the input is multiplied by it) and ``perm`` ``[K]`` (act-order column permutation of
imported GPTQ checkpoints; the kernel sees ``x[..., perm]``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

import foudre.quant.cpu_qmatmul as cpu_qmatmul
import foudre.quant.kernels as kernels
from foudre.quant.packing import (
    INT4_GROUP_SIZES,
    INT6_BLOCK,
    INT8_GROUP_SIZES,
    dequantize_int4,
    dequantize_int6,
    dequantize_int8_grouped,
    pack_int4,
    pack_int6,
    padded_k,
    quantize_int4,
    quantize_int6,
    quantize_int8,
    quantize_int8_grouped,
    unpack_int4,
)

log = logging.getLogger(__name__)

# Where each CPU kernel leads: the crossings below were measured with
# benchmarks/quant_kernels_cpu.py (weights of a few thousand rows and columns, bf16 activations,
# ours against the other path in turns); the figures are in docs/architecture.md ("Quantized
# weights"), which says what to rerun when a kernel changes.

# Rows up to which the CPU forward runs cpu_qmatmul rather than aten's packed kernels, by bits:
# ours lead aten's at every batch below DEQUANTIZED_GEMM_ROWS, for int8 and for int4 (reading
# pack_int4's nibbles directly, two vpdpbusd summed per 128 columns), so int4 weights need no
# second, aten-packed copy; tests lower it to reach aten's kernels.
NATIVE_MAX_ROWS: dict[int, float] = {8: math.inf, 4: math.inf}
# Rows from which the CPU forward dequantizes the weight a few rows at a time into x's dtype and
# runs torch's GEMM (cpu_qmatmul.matmul_dequantized): at prefill sizes the step is compute-bound
# and a bf16 GEMM does more per cycle than the integer kernel's int8 products with their
# per-block scaling.
DEQUANTIZED_GEMM_ROWS = 64
# ... from 32 rows for group-wise 8-bit layouts (GGUF's Q8_0, Q5_x, and Q6_K beside other
# types), whose kernel steps multiply every lane by its group's scale: their crossing lies near
# 24 rows, and 32 is kept as the native decode step's bound. int4 in groups of 32 gained nothing
# end to end from a lower bound (its steps then leave the native decode step) and keeps 64, as
# 6 bits do (their crossing lies near 80 rows, the native decode step's bound kept). Measured with
# bf16 activations on the VNNI path; float32 activations and the AVX-512 float path take the
# same rows, unmeasured.
GROUPED8_GEMM_ROWS = 32


# On the AVX2 path (no AVX-512, where torch's bfloat16 GEMM runs in float32:
# layers.linear.gemm_dtype) the integer kernel leads far longer, once its tiles take x's rows a
# panel at a time (cpu_qmatmul.cpp's kPanelBytes), and takes its zero points off lane-wise
# (Avx2::take_offsets): int8 per channel and int4 in groups of 128 up to 2048 rows (so there
# prompt chunks under 2048 tokens round their activations to int8 too, within
# cpu_qmatmul.error_bound); int4 in smaller groups and group-wise int8 (whose loops take their
# scales' spread as a constant: cpu_qmatmul.cpp's two_scales) up to 192; group-wise int8 in
# groups of 16 (two scales a step) up to 96. 6 bits, unmeasured there, keep the other paths'
# rows.
AVX2_GEMM_ROWS = {"wide": 2048, "int4": 192, "grouped8": 192, "grouped8_16": 96}

# Where per-channel int8 and int4 in groups of 128 or more run on AMX's int8 tiles
# (cpu_qmatmul.amx_rows), their kernels lead the dequantized GEMM (oneDNN's bfloat16 one on AMX)
# at every batch measured up to 512 rows (the tiles' time grows more slowly with the rows than
# the dequantized GEMM's past its dequantization), but not at 1024, where each task reads all of
# x's packed rows again. So there they take up to 1023 rows.
AMX_GEMM_ROWS = 1024
# ... groups of 32 on the tiles (a tile product and its float scaling every 32 columns):
# group-wise int8 (GGUF's Q8_0, Q5_x) up to 159 rows, int4 (Q4_0, Q4_1, Q4_K, its rows unpacked
# to bytes a task) up to 127, where each crossing lies (the VNNI kernel before them: the
# dequantized GEMM from 32 and 64 rows).
AMX_GROUPS32_GEMM_ROWS = {8: 160, 4: 128}
# ... int4 in groups of 64, on the tiles only in blocks of 16 rows (cpu_qmatmul.interleave; rows
# of it have no tile kernel), up to 255, where the crossing lies (groups of 32 in blocks cross
# near 128: AMX_GROUPS32_GEMM_ROWS's 128 holds).
AMX_BLOCKS64_GEMM_ROWS = 256


def dequantized_gemm_rows(bits: int, group_size: int | None) -> int:
    """The rows from which ``QuantLinear``'s CPU forward (and the native decode step's limit)
    turns to ``cpu_qmatmul.matmul_dequantized`` for a ``bits``-bit layout in ``group_size``
    (``AVX2_GEMM_ROWS`` on the AVX2 path; ``AMX_GEMM_ROWS`` for the layouts on AMX's tiles,
    ``AMX_GROUPS32_GEMM_ROWS`` for groups of 32 there, ``AMX_BLOCKS64_GEMM_ROWS`` for int4 in
    groups of 64, which take them in blocks of 16 rows)."""
    grouped8 = bits == 8 and group_size is not None
    if cpu_qmatmul.amx_rows(bits, group_size):
        small = group_size is not None and group_size < 128  # (groups of 32)
        return AMX_GROUPS32_GEMM_ROWS[bits] if small else AMX_GEMM_ROWS
    if bits == 4 and cpu_qmatmul.repacks() and cpu_qmatmul.amx_rows(4, group_size, blocks=True):
        return AMX_BLOCKS64_GEMM_ROWS  # (groups of 64: only their blocks take the tiles)
    if bits in (4, 8) and cpu_qmatmul.path() == "avx2":
        if grouped8:
            return AVX2_GEMM_ROWS["grouped8" if (group_size or 0) >= 32 else "grouped8_16"]
        wide = bits == 8 or (group_size or 0) >= 128
        return AVX2_GEMM_ROWS["wide" if wide else "int4"]
    return GROUPED8_GEMM_ROWS if grouped8 else DEQUANTIZED_GEMM_ROWS


def _check_format(bits: int, group_size: int | None, zero_point: bool) -> None:
    """A ``QuantLinear``'s bits, group size and zero point must name a layout it has."""
    if bits not in (4, 6, 8):
        raise ValueError(f"bits must be 4, 6 or 8, got {bits}")
    sizes = {4: INT4_GROUP_SIZES, 6: (16,), 8: INT8_GROUP_SIZES}[bits]
    if (bits != 8 or group_size is not None) and group_size not in sizes:
        raise ValueError(
            f"{bits}-bit group_size must be one of {sizes}"
            f"{' or None' if bits == 8 else ''}, got {group_size}"
        )
    if zero_point and (bits != 8 or group_size is None):
        raise ValueError("zero_point is for group-wise 8-bit weights (4-bit always has one)")


class QuantLinear(nn.Module):
    """A weight-only quantized ``nn.Linear`` (8-bit per channel or per group, 4-bit per group,
    6-bit as GGUF's Q6_K).

    Weights: 8-bit per channel ``w = q * s``; 8-bit group-wise ``w = (q - z) * s`` per group of
    ``group_size`` columns, ``z`` (``zeros``) only with ``zero_point`` (GGUF's Q5_1 and Q5_K;
    without, as Q8_0, Q5_0 and Q6_K, z = 0); 4-bit ``w = (q - z) * s``, codes 0..15; 6-bit
    (``group_size`` 16, ``packing.pack_int6``'s rows in ``qweight``, ``scales`` the ``d`` per
    256 columns) ``w = (q - 32) * d * sc``, codes 0..63, an int8 ``sc`` per 16 columns.

    Where the CPU kernels serve it on the VNNI path, 8-bit in groups of 32 with one zero point
    (GGUF's Q8_0, Q5_0) and 4-bit (GGUF's Q4_0, Q4_1, Q4_K too) are repacked in blocks of 16 rows
    when their layout is built (``interleaved``: ``qweight`` then holds ``cpu_qmatmul.interleave``'s
    uint8 blocks with the scales and zero points inside, ``scales`` and ``zeros`` empty;
    ``state_dict`` and moves see rows).

    ``forward`` returns what ``forward_reference`` (dequantize, then ``F.linear``) returns, to
    within the rounding of the activation dtype (or of int8 activations, see the module's
    docstring); on CPU it runs the packed kernels (ours or PyTorch's), on CUDA the Triton kernels
    when Triton is importable. The output dtype is the input's.
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    bias: torch.Tensor | None
    input_scale: torch.Tensor | None
    perm: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        group_size: int | None = None,
        bias: bool = False,
        input_scale: bool = False,
        perm: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        scale_dtype: torch.dtype | None = None,
        zero_point: bool = False,
    ) -> None:
        super().__init__()
        _check_format(bits, group_size, zero_point)
        self.in_features, self.out_features = in_features, out_features
        self.bits = bits
        self.group_size = group_size
        n, k = out_features, in_features
        sdtype = scale_dtype or dtype  # GGUF's scales keep their exact float16 / float32 values
        self._register_codes(n, k, sdtype, device, zero_point)
        self.register_buffer("bias", torch.zeros(n, dtype=dtype, device=device) if bias else None)
        self.register_buffer(
            "input_scale", torch.ones(k, dtype=dtype, device=device) if input_scale else None
        )
        self.register_buffer(
            "perm", torch.arange(k, dtype=torch.long, device=device) if perm else None
        )
        # aten's kernel layouts by (device, activation dtype), and cpu_qmatmul's (any dtype)
        self._packed: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
        self._native: cpu_qmatmul.Packed | None = None
        # (kind, K, zc, zero points stored in the blocks, the scales' dtype as the module held
        # them) where qweight holds cpu_qmatmul.interleave's blocks (scales and zero points
        # inside them, ``scales`` and ``zeros`` then empty): set by _native_layout, undone by
        # _restore
        self._interleaved: tuple[str, int, float, bool, torch.dtype] | None = None
        # activations are cast to this dtype for the CPU kernels and the result cast back
        # (None: the input's dtype). torch's float32 packed kernels are much slower than its
        # bfloat16 ones; see set_compute_dtype.
        self.compute_dtype: torch.dtype | None = None

    def _register_codes(
        self,
        n: int,
        k: int,
        sdtype: torch.dtype,
        device: torch.device | str | None,
        zero_point: bool,
    ) -> None:
        """The buffers of the codes, their scales and zero points, in the layout of
        ``self.bits`` and ``self.group_size`` for a weight ``[n, k]``."""
        bits, group_size = self.bits, self.group_size
        if bits == 8 and group_size is None:
            self.register_buffer("qweight", torch.zeros(n, k, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.ones(n, dtype=sdtype, device=device))
            self.zeros = None
        elif bits == 8:
            assert group_size is not None
            kp = padded_k(k, group_size)
            self.register_buffer("qweight", torch.zeros(n, kp, dtype=torch.int8, device=device))
            self.register_buffer(
                "scales", torch.ones(n, kp // group_size, dtype=sdtype, device=device)
            )
            zeros = torch.zeros(n, kp // group_size, dtype=sdtype, device=device)
            self.register_buffer("zeros", zeros if zero_point else None)
        elif bits == 6:
            kp = padded_k(k, INT6_BLOCK)
            rows = torch.zeros(n, kp // 16 * 13, dtype=torch.uint8, device=device)
            self.register_buffer("qweight", rows)
            self.register_buffer(
                "scales", torch.ones(n, kp // INT6_BLOCK, dtype=sdtype, device=device)
            )
            self.zeros = None
        else:
            assert group_size is not None
            kp = padded_k(k, group_size)
            self.register_buffer(
                "qweight", torch.zeros(n, kp // 2, dtype=torch.uint8, device=device)
            )
            self.register_buffer(
                "scales", torch.ones(n, kp // group_size, dtype=sdtype, device=device)
            )
            self.register_buffer(
                "zeros", torch.zeros(n, kp // group_size, dtype=sdtype, device=device)
            )

    # -- construction --------------------------------------------------------------------

    @classmethod
    def from_float(
        cls,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        bits: int,
        group_size: int | None = None,
        input_scale: torch.Tensor | None = None,
    ) -> QuantLinear:
        """Round-to-nearest quantization of ``weight`` ``[N, K]`` (already multiplied by any
        AWQ scale; ``input_scale`` is what the input is multiplied by). 8 bits: per channel,
        or group-wise when ``group_size`` is given; 6 bits: Q6_K's form (``quantize_int6``)."""
        k = weight.shape[1]
        if bits == 6:
            if group_size != 16:
                raise ValueError(f"6-bit group_size must be 16 (Q6_K's), got {group_size}")
            q6, subs, d = quantize_int6(weight)
            return cls.from_codes(q6, d, None, bias, 6, 16, k, input_scale, sub_scales=subs)
        if bits == 8 and group_size is None:
            q, scales = quantize_int8(weight)
            return cls.from_codes(q, scales, None, bias, bits, None, k, input_scale)
        assert group_size is not None
        if bits == 8:
            q, scales = quantize_int8_grouped(weight, group_size)
            return cls.from_codes(q, scales, None, bias, bits, group_size, k, input_scale)
        q4, scales, zeros = quantize_int4(weight, group_size)
        return cls.from_codes(q4, scales, zeros, bias, 4, group_size, k, input_scale)

    @classmethod
    def from_codes(
        cls,
        q: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        bias: torch.Tensor | None,
        bits: int,
        group_size: int | None,
        in_features: int,
        input_scale: torch.Tensor | None = None,
        perm: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
        scale_dtype: torch.dtype | None = None,
        sub_scales: torch.Tensor | None = None,
    ) -> QuantLinear:
        """Build from integer codes (int8 ``[N, K]`` per channel or ``[N, Kp]`` group-wise, or
        0..15 ``[N, Kp]`` unpacked, or 0..63 ``[N, Kp]`` for 6 bits, Kp a multiple of 256);
        ``scale_dtype`` (default ``dtype``) holds scales and zeros. 8-bit group-wise codes take
        ``zeros`` or None (z = 0). 6 bits take their int8 ``sub_scales`` ``[N, Kp / 16]``,
        ``scales`` their d ``[N, Kp / 256]``, no zeros."""
        if (bits == 6) != (sub_scales is not None) or (bits == 6 and zeros is not None):
            raise ValueError("6-bit codes (and only they) take sub_scales, and no zeros")
        dtype = dtype or (bias.dtype if bias is not None else torch.float32)
        if not dtype.is_floating_point:
            dtype = torch.float32
        mod = cls(
            in_features,
            q.shape[0],
            bits,
            group_size,
            bias=bias is not None,
            input_scale=input_scale is not None,
            perm=perm is not None,
            dtype=dtype,
            device=q.device,
            scale_dtype=scale_dtype,
            zero_point=bits == 8 and zeros is not None,
        )
        with torch.no_grad():
            if sub_scales is not None:
                mod.qweight.copy_(pack_int6(q, sub_scales))
            elif bits == 8:
                mod.qweight.copy_(q.to(torch.int8))
                if zeros is not None:
                    assert mod.zeros is not None
                    mod.zeros.copy_(zeros)
            else:
                assert mod.zeros is not None and zeros is not None
                mod.qweight.copy_(pack_int4(q))
                mod.zeros.copy_(zeros)
            mod.scales.copy_(scales)
            if bias is not None:
                assert mod.bias is not None
                mod.bias.copy_(bias)
            if input_scale is not None:
                assert mod.input_scale is not None
                mod.input_scale.copy_(input_scale)
            if perm is not None:
                assert mod.perm is not None
                mod.perm.copy_(perm)
        return mod

    # -- math ----------------------------------------------------------------------------

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]`` in the kernel's column order (``perm`` applied)."""
        if self._interleaved is not None:  # (the blocks: the same values, dequantized natively)
            w = cpu_qmatmul.dequantize_rows(self._native_layout(), 0, self.out_features,
                                            torch.float32)  # fmt: skip
            return w[:, : self.in_features]
        if self.bits == 8 and self.group_size is None:
            return self.qweight.float() * self.scales.float()[:, None]
        if self.bits == 6:
            return dequantize_int6(self.qweight, self.scales)[:, : self.in_features]
        assert self.group_size is not None
        if self.bits == 8:
            w = dequantize_int8_grouped(self.qweight, self.scales, self.group_size, self.zeros)
            return w[:, : self.in_features]
        assert self.zeros is not None
        w = dequantize_int4(
            unpack_int4(self.qweight), self.scales.float(), self.zeros.float(), self.group_size
        )
        return w[:, : self.in_features]

    def effective_weight(self) -> torch.Tensor:
        """The float32 weight ``W`` such that this module computes ``x @ W.T + bias``."""
        w = self.dequantize()
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        if self.input_scale is not None:
            w = w * self.input_scale.float()[None, :]
        return w

    def _prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        if self.input_scale is not None:
            x = x * self.input_scale.to(x.dtype)
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        return x

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize-then-matmul; the definition every kernel is tested against."""
        x = self._prepare_input(x)
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16, torch.float16):
            return self._forward_cpu(x)
        if x.device.type == "cuda":
            return self._forward_cuda(x)
        return self.forward_reference(x)

    def _flat(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
        lead = x.shape[:-1]
        x = self._prepare_input(x).reshape(-1, x.shape[-1])
        return x, tuple(lead)

    def _cpu_layout(self, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """aten's layout for activations in ``dtype``."""
        key = (self.qweight.device, dtype)
        layout = self._packed.get(key)
        if layout is None:
            rows = self._canonical() if self._interleaved is not None else {}  # (blocks: rows)
            qweight, scales = rows.get("qweight", self.qweight), rows.get("scales", self.scales)
            zeros = rows.get("zeros", self.zeros)
            layout = kernels.cpu_layout(qweight, scales, zeros, dtype)
            self._packed[key] = layout
        return layout

    def _native_layout(self) -> cpu_qmatmul.Packed:
        """``cpu_qmatmul``'s layout (built once; it serves every activation dtype). Group-wise
        scales and zero points are first paired in place (``cpu_qmatmul.pair_scales``: one
        stream for the kernels)."""
        if self._native is not None:
            return self._native
        if self._interleaved is not None:
            kind, k, zc, stored, _ = self._interleaved
            z = self.scales.new_empty(0) if stored else None  # (int4: its zero points stored)
            self._native = cpu_qmatmul.Packed(
                kind, self.qweight, self.scales, z, self.group_size, k, zc, self.out_features
            )
            return self._native
        if self.group_size is not None and self.bits != 6:
            with torch.inference_mode(False):  # buffers, written in place later
                scales, zeros = cpu_qmatmul.pair_scales(self.scales, self.zeros)
            self._buffers["scales"], self._buffers["zeros"] = scales, zeros
        packed = cpu_qmatmul.layout(
            self.qweight, self.scales, self.zeros, self.group_size, self.bits
        )
        scale_dtype = self.scales.dtype  # (layout casts them to float32 beside other zeros)
        if cpu_qmatmul.interleaves(packed):
            # GGUF's Q8_0 and Q5_0, and int4 (GGUF's Q4_x too), in blocks of 16 rows in place
            # of the rows (the same codes and scales, rows padded to 16; faster at batch 1 and
            # at 2-64 rows: docs/architecture.md, "Quantized weights"): the buffers become the
            # blocks (scales and zeros empty)
            with torch.inference_mode(False):
                packed = cpu_qmatmul.interleave(packed)
            self._buffers["qweight"], self._buffers["scales"] = packed.w, packed.s
            if self.zeros is not None:
                self._buffers["zeros"] = self.zeros.new_empty(0)
            stored = packed.z is not None
            self._interleaved = (packed.kind, packed.k, packed.zc, stored, scale_dtype)
        self._native = packed
        return packed

    def adopt_blocks(
        self, blocks: torch.Tensor, kind: str, k: int, zc: float, stored: bool = False
    ) -> None:
        """Take ``blocks`` (this module's weight in ``cpu_qmatmul.interleave``'s layout ``kind``
        over ``k`` columns, its zero points stored in them, or else every one ``zc``: built
        straight from a file's blocks) as ``qweight``, the module then as ``_native_layout``
        leaves an interleaved one (``scales`` and ``zeros`` empty)."""
        assert self.group_size is not None and self._interleaved is None
        with torch.inference_mode(False):
            scale_dtype = self.scales.dtype
            self._buffers["qweight"] = blocks
            self._buffers["scales"] = self.scales.new_empty(0)
            if self.zeros is not None:
                self._buffers["zeros"] = self.zeros.new_empty(0)
        self._interleaved = (kind, k, zc, stored, scale_dtype)
        self.invalidate_layouts()

    @property
    def interleaved(self) -> bool:
        """Whether ``qweight`` holds ``cpu_qmatmul.interleave``'s blocks (uint8, the scales and
        zero points inside; ``scales`` and ``zeros`` empty): GGUF's Q8_0 and Q5_0, and int4
        (GGUF's Q4_x too), once their layout is built on the VNNI path (``prepare_for_cpu``).
        A move, ``load_state_dict`` or ``state_dict`` see rows."""
        return self._interleaved is not None

    def _canonical(self) -> dict[str, torch.Tensor]:
        """An interleaved module's buffers as rows again: qweight, scales (and zeros)."""
        assert self._interleaved is not None and self.group_size is not None
        rows = cpu_qmatmul.deinterleave(self._native_layout())
        group = self.group_size
        kp = padded_k(self.in_features, group)  # (the blocks' K may be padded further)
        width = kp // 2 if self.bits == 4 else kp
        out = {"qweight": rows[0][:, :width].contiguous()}
        _, _, zc, stored, scale_dtype = self._interleaved
        out["scales"] = rows[1][:, : kp // group].to(scale_dtype).contiguous()
        if self.zeros is not None:  # (zc exactly where the blocks hold none: not via scales)
            shape, dtype = out["scales"].shape, self.zeros.dtype
            zeros = rows[-1] if stored else torch.full(shape, zc)  # (stored: int4's third)
            out["zeros"] = zeros[:, : kp // group].to(dtype).contiguous()
        return out

    def _restore(self) -> None:
        """Undo the interleaving of ``_native_layout``: the buffers rows again."""
        if self._interleaved is not None:
            with torch.inference_mode(False):
                canonical = self._canonical()
            self._buffers.update(canonical)
            self._interleaved = None
        self.invalidate_layouts()

    def native_rows(self) -> int:
        """The most rows ``_forward_cpu`` runs through ``cpu_qmatmul``'s integer kernel (where
        ``uses_native_kernels``): below ``dequantized_gemm_rows`` and, but for group-wise 8 bits
        and 6 bits (which aten's kernels do not take), up to ``NATIVE_MAX_ROWS``."""
        rows = dequantized_gemm_rows(self.bits, self.group_size) - 1
        if not self._aten_kernels():
            return rows
        return int(min(rows, NATIVE_MAX_ROWS[self.bits]))

    def _forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """On the CPU: ``cpu_qmatmul`` (its integer kernel, or its dequantized GEMM from
        ``dequantized_gemm_rows`` rows) where ``uses_native_kernels``, else aten's packed
        kernels (``kernels``; group-wise 8-bit and 6-bit: ``forward_reference``)."""
        out_dtype = x.dtype
        x2, lead = self._flat(x)
        if self.compute_dtype is not None:
            x2 = x2.to(self.compute_dtype)
        x2 = x2.contiguous()
        native = uses_native_kernels(x2.dtype)
        if not native and not self._aten_kernels():
            _warn_dequantizing(self, f"{x2.dtype} activations without our CPU kernels")
            return self.forward_reference(x)
        if native and x2.shape[0] >= dequantized_gemm_rows(self.bits, self.group_size):
            y = cpu_qmatmul.matmul_dequantized(x2, self._native_layout()).to(out_dtype)
        elif native and x2.shape[0] <= self.native_rows():
            y = cpu_qmatmul.matmul(x2, self._native_layout()).to(out_dtype)
        else:
            layout = self._cpu_layout(x2.dtype)
            y = kernels.cpu_matmul(x2, layout, self.group_size, self.out_features).to(out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _aten_kernels(self) -> bool:
        """Whether aten's packed kernels take this layout (not group-wise 8 bits nor 6 bits)."""
        return self.bits == 4 or (self.bits == 8 and self.group_size is None)

    def _forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """The Triton dequantize-matmul kernels (every layout: a GEMV or split-K kernel for
        decode batches, ``tl.dot`` tiles beyond; bias added in the kernel) when Triton imports,
        else the dequantize reference."""
        if self.bits == 6:  # no Triton kernel: the GGUF loader keeps Q6_K as 8 bits on CUDA
            _warn_dequantizing(self, "CUDA (no 6-bit Triton kernel)")
            return self.forward_reference(x)
        try:
            import foudre.quant.triton_kernels as triton_kernels
        except ImportError:
            return self.forward_reference(x)
        x2, lead = self._flat(x)
        y = triton_kernels.quant_matmul(
            x2, self.qweight, self.scales, self.zeros, self.group_size, self.bias
        )
        return y.reshape(*lead, self.out_features)

    def invalidate_layouts(self) -> None:
        """Forget the kernels' layouts: call after writing the buffers in place (rows: not
        where ``interleaved``, whose ``qweight`` holds blocks; ``_restore`` first)."""
        self._packed, self._native = {}, None

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._restore()  # device or dtype moves invalidate the layouts (rows again)
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._restore()
        return super()._load_from_state_dict(*args, **kwargs)

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self._interleaved is not None:  # saved as rows, the buffers' canonical form
            for name, tensor in self._canonical().items():
                destination[prefix + name] = tensor

    def extra_repr(self) -> str:
        extra = f", group_size={self.group_size}" if self.group_size is not None else ""
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}{extra}"


_warned: set[str] = set()


def _warn_dequantizing(mod: QuantLinear, where: str) -> None:
    """Log once per case that ``mod``'s layout runs ``forward_reference`` (the whole weight
    dequantized at every call) on ``where``."""
    layout = f"{mod.bits}-bit" + (f" group {mod.group_size}" if mod.group_size else "")
    if (key := f"{layout} {where}") not in _warned:
        _warned.add(key)
        log.warning("%s weights on %s: every call dequantizes the whole weight", layout, where)


def uses_native_kernels(dtype: torch.dtype) -> bool:
    """Whether CPU activations in ``dtype`` run ``cpu_qmatmul``: float32 or bfloat16, the
    library built with AVX-512 or AVX2 (its portable path is for checks; aten's kernels serve
    CPUs with neither), and not switched off with ``FOUDRE_NATIVE_QMATMUL=0``."""
    if dtype not in cpu_qmatmul.DTYPES or os.environ.get("FOUDRE_NATIVE_QMATMUL", "1") == "0":
        return False
    return cpu_qmatmul.path() in cpu_qmatmul.NATIVE_PATHS


def prepare_for_cpu(model: nn.Module) -> None:
    """As loaded on the CPU: where our kernels (AVX-512, AVX2) serve the model's dtype, each
    quantized linear's layout is built now (its group-wise scales and zero points paired: new
    buffers, which ``huge_pages.place_in_huge_pages`` then moves with the rest); else a float32
    model's quantized linears compute in bfloat16 (torch's packed kernels are fast with bf16
    activations only)."""
    params = next(model.parameters(), None)
    if params is None or params.device.type != "cpu":
        return
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    if uses_native_kernels(params.dtype):
        replaced = 0
        for mod in quantized:
            replaced += mod.qweight.nbytes
            mod._native_layout()
            if replaced >= _TRIM_BYTES:  # the rows the layouts replaced given back to the system
                _release_freed()
                replaced = 0
    elif params.dtype == torch.float32 and quantized:
        set_compute_dtype(model, torch.bfloat16)


# bytes of rows replaced by layouts between asking the allocator to return them: a load's peak
# holds at most this much of them, while the memory freed in between is reused without faults
_TRIM_BYTES = 32 << 20


def _release_freed() -> None:
    """Ask glibc's allocator to return the memory freed since to the system (nothing
    elsewhere): freed buffers stay resident in its heap otherwise."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def set_compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Run every ``QuantLinear`` of ``model``'s CPU kernels in ``dtype`` (e.g. bfloat16 for a
    float32 model: much faster, activations rounded to bfloat16); None restores exact dtype."""
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.compute_dtype = dtype
