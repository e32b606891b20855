"""``QuantLinear``: a weight-only quantized linear over the canonical layouts of
``foudre.quant.packing`` (8-bit per channel or group-wise, 4-bit group-wise), run by the packed
kernels: on the CPU our own (``cpu_qmatmul``, int8 weights; up to ``NATIVE_MAX_ROWS`` rows)
where they built with AVX-512, else PyTorch's (``kernels``); on CUDA ``triton_kernels``.
Group-wise int8 (GGUF's Q8_0) runs on ours only; elsewhere (CPUs without AVX-512, CUDA) it runs
``forward_reference``.

With AVX512-VNNI, ours round the activations to int8 per block of 32 columns (as llama.cpp's
Q8_0): ``cpu_qmatmul.error_bound`` bounds the difference from ``forward_reference``. On the
stories260K model its logits' error is that of bfloat16 activations (the loader's compute dtype
for a float32 model), 0.078 RMS beside int8 weights' own 0.069 (logits of RMS 6.9).

Optional per module: ``input_scale`` ``[K]`` (AWQ scaling that could not be folded into the
previous op; the input is multiplied by it) and ``perm`` ``[K]`` (act-order column permutation of
imported GPTQ checkpoints; the kernel sees ``x[..., perm]``).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from foudre.quant import cpu_qmatmul, kernels
from foudre.quant.packing import (
    INT4_GROUP_SIZES,
    dequantize_int4,
    dequantize_int8_grouped,
    pack_int4,
    padded_k,
    quantize_int4,
    quantize_int8,
    quantize_int8_grouped,
    unpack_int4,
)

# Rows up to which the CPU forward runs cpu_qmatmul rather than aten's packed kernels, by bits.
# Measured on one Zen 4 thread (benchmarks/quant_kernels_cpu.py; 4096x4096 and 1024x2816, bf16
# activations): int8 1.7x aten's speed at one row with the weights read from memory, 1.25-1.9x
# at 16 and still 1.4-1.6x at 512-2048 rows, so every batch (and a row's result never depends
# on the batch around it); int4 0.7x at one row (our VNNI kernel is compute-bound there) and
# 0.96-1.12x at 16: not yet.
NATIVE_MAX_ROWS: dict[int, float] = {8: math.inf, 4: 0}


class QuantLinear(nn.Module):
    """A weight-only quantized ``nn.Linear`` (8-bit per channel or per group, 4-bit per group).

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
    ) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if (bits == 4 or group_size is not None) and group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"{bits}-bit group_size must be one of {INT4_GROUP_SIZES}"
                f"{' or None' if bits == 8 else ''}, got {group_size}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.bits = bits
        self.group_size = group_size
        n, k = out_features, in_features
        sdtype = scale_dtype or dtype  # GGUF's scales keep their exact float16 / float32 values
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
        self.register_buffer("bias", torch.zeros(n, dtype=dtype, device=device) if bias else None)
        self.register_buffer(
            "input_scale", torch.ones(k, dtype=dtype, device=device) if input_scale else None
        )
        self.register_buffer(
            "perm", torch.arange(k, dtype=torch.long, device=device) if perm else None
        )
        # kernel layouts by (device, activation dtype); dtype None: cpu_qmatmul's (any dtype)
        self._packed: dict[tuple[torch.device, torch.dtype | None], tuple[torch.Tensor, ...]] = {}
        # activations are cast to this dtype for the CPU kernels and the result cast back
        # (None: the input's dtype). torch 2.13's float32 packed kernels are several times
        # slower than its bfloat16 ones; see set_compute_dtype.
        self.compute_dtype: torch.dtype | None = None

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
        or group-wise when ``group_size`` is given."""
        k = weight.shape[1]
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
    ) -> QuantLinear:
        """Build from integer codes (int8 ``[N, K]`` per channel or ``[N, Kp]`` group-wise, or
        0..15 ``[N, Kp]`` unpacked); ``scale_dtype`` (default ``dtype``) holds scales and
        zeros."""
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
        )
        with torch.no_grad():
            if bits == 8:
                mod.qweight.copy_(q.to(torch.int8))
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
        if self.bits == 8 and self.group_size is None:
            return self.qweight.float() * self.scales.float()[:, None]
        assert self.group_size is not None
        if self.bits == 8:
            w = dequantize_int8_grouped(self.qweight, self.scales, self.group_size)
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

    def _cpu_layout(self, dtype: torch.dtype | None) -> tuple[torch.Tensor, ...]:
        """aten's layout for activations in ``dtype``; None: ``cpu_qmatmul``'s."""
        key = (self.qweight.device, dtype)
        layout = self._packed.get(key)
        if layout is None:
            if dtype is None:
                layout = cpu_qmatmul.layout(self.qweight, self.scales, self.zeros, self.group_size)
            else:
                layout = kernels.cpu_layout(self.qweight, self.scales, self.zeros, dtype)
            self._packed[key] = layout
        return layout

    def _forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        """Through the native CPU packed kernels (``kernels``)."""
        out_dtype = x.dtype
        x2, lead = self._flat(x)
        if self.compute_dtype is not None:
            x2 = x2.to(self.compute_dtype)
        x2 = x2.contiguous()
        native = uses_native_kernels(x2.dtype)
        grouped8 = self.bits == 8 and self.group_size is not None
        if grouped8 and not native:
            return self.forward_reference(x)  # aten has no group-wise int8 kernel
        if native and (grouped8 or x2.shape[0] <= NATIVE_MAX_ROWS[self.bits]):
            y = cpu_qmatmul.matmul(x2, self._cpu_layout(None), self.group_size).to(out_dtype)
        else:
            layout = self._cpu_layout(x2.dtype)
            y = kernels.cpu_matmul(x2, layout, self.group_size, self.out_features).to(out_dtype)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """The Triton dequantize-matmul when Triton imports, else (and for group-wise int8,
        which has no Triton kernel yet) the dequantize reference."""
        if self.bits == 8 and self.group_size is not None:
            return self.forward_reference(x)
        try:
            from foudre.quant import triton_kernels
        except ImportError:
            return self.forward_reference(x)
        x2, lead = self._flat(x)
        y = triton_kernels.quant_matmul(x2, self.qweight, self.scales, self.zeros, self.group_size)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._packed = {}  # device or dtype moves invalidate the kernel layouts
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._packed = {}
        return super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        extra = f", group_size={self.group_size}" if self.group_size is not None else ""
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}{extra}"


def uses_native_kernels(dtype: torch.dtype) -> bool:
    """Whether small CPU batches in ``dtype`` run ``cpu_qmatmul``: float32 or bfloat16, the
    library built with AVX-512 (its portable path is for checks; aten's kernels serve CPUs
    without AVX-512), and not switched off with ``FOUDRE_NATIVE_QMATMUL=0``."""
    if dtype not in cpu_qmatmul.DTYPES or os.environ.get("FOUDRE_NATIVE_QMATMUL", "1") == "0":
        return False
    return cpu_qmatmul.path() in ("vnni", "avx512")


def set_compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Run every ``QuantLinear`` of ``model``'s CPU kernels in ``dtype`` (e.g. bfloat16 for a
    float32 model: much faster, activations rounded to bfloat16); None restores exact dtype."""
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.compute_dtype = dtype
