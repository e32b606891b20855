"""Round-to-nearest quantizers, the canonical packed layouts, and ``QuantLinear``.

Canonical layouts (what checkpoints store, whatever the device):

- 8 bits, per output channel, symmetric: ``qweight`` int8 ``[N, K]``, ``scales`` ``[N]``;
  ``w = q * scale``.
- 4 bits, group-wise, asymmetric: ``qweight`` uint8 ``[N, Kp / 2]`` (column ``2j`` in the low
  nibble, ``2j + 1`` in the high one), ``scales`` and ``zeros`` ``[N, Kp / G]`` (zeros are integer
  zero points (any integer, held in a float tensor)); ``w = (q - zero) * scale``. ``Kp`` is
  ``K`` rounded up to a multiple of the group size; the padded columns quantize zeros and meet
  zero inputs.

Optional per module: ``input_scale`` ``[K]`` (AWQ scaling that could not be folded into the
previous op; the input is multiplied by it) and ``perm`` ``[K]`` (act-order column permutation of
imported GPTQ checkpoints; the kernel sees ``x[..., perm]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP_SIZES = (32, 64, 128, 256)


def padded_k(k: int, group_size: int) -> int:
    return -(-k // group_size) * group_size


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8: ``(q int8 [N, K], scales float32 [N])`` with
    ``|w - q * scale| <= scale / 2`` elementwise."""
    w = w.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-10)
    q = torch.round(w / scales[:, None]).clamp(-128, 127).to(torch.int8)
    return q, scales


def int4_params(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric scale and integer zero point of each group of ``w`` ``[N, Kp]``
    (``[N, Kp / G]`` each): ``scale = (max - min) / 15``, ``zero = round(-min / scale)``.

    The zero point may fall outside 0..15 (a group of all-positive weights), so that the codes
    ``round(w / scale) + zero`` always span exactly 0..15 and every error is within scale / 2.
    """
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scales = ((hi - lo) / 15.0).clamp(min=1e-10)
    zeros = torch.round(-lo / scales)  # not clamped to 0..15: all-positive groups stay exact
    return scales, zeros


def quantize_with(
    w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Integer codes 0..15 of ``w`` ``[N, Kp]`` for given group scales and zero points."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    q = torch.round(g / scales[..., None]) + zeros[..., None]
    return q.clamp(0, 15).reshape(n, k).to(torch.uint8)


def quantize_int4(
    w: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Group-wise asymmetric 4-bit codes ``[N, Kp]`` (uint8, unpacked), scales, zeros.

    ``w`` is zero-padded to ``Kp``. Each element's error is at most its group's ``scale / 2``.
    """
    w = pad_columns(w.float(), padded_k(w.shape[1], group_size))
    scales, zeros = int4_params(w, group_size)
    return quantize_with(w, scales, zeros, group_size), scales, zeros


def pad_columns(w: torch.Tensor, k: int) -> torch.Tensor:
    return w if w.shape[1] == k else F.pad(w, (0, k - w.shape[1]))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` codes 0..15 (K even) to uint8 ``[N, K / 2]``, even columns in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: uint8 ``[N, K]`` codes."""
    lo, hi = packed & 0xF, packed >> 4
    return torch.stack([lo, hi], dim=-1).reshape(packed.shape[0], -1)


def dequantize_int4(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Float32 ``[N, Kp]`` weight of unpacked codes ``q``."""
    n, k = q.shape
    g = q.float().reshape(n, k // group_size, group_size)
    return ((g - zeros[..., None]) * scales[..., None]).reshape(n, k)


class QuantLinear(nn.Module):
    """A weight-only quantized ``nn.Linear`` (8-bit per channel or 4-bit group-wise).

    ``forward`` returns what ``forward_reference`` (dequantize, then ``F.linear``) returns, to
    within the rounding of the activation dtype; on CPU it runs PyTorch's packed kernels, on CUDA
    the Triton kernels when Triton is importable. The output dtype is the input's.
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
    ) -> None:
        super().__init__()
        if bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {bits}")
        if bits == 4 and group_size not in INT4_GROUP_SIZES:
            raise ValueError(
                f"4-bit group_size must be one of {INT4_GROUP_SIZES}, got {group_size}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.bits = bits
        self.group_size = group_size if bits == 4 else None
        n, k = out_features, in_features
        if bits == 8:
            self.register_buffer("qweight", torch.zeros(n, k, dtype=torch.int8, device=device))
            self.register_buffer("scales", torch.ones(n, dtype=dtype, device=device))
            self.zeros = None
        else:
            assert group_size is not None
            kp = padded_k(k, group_size)
            self.register_buffer(
                "qweight", torch.zeros(n, kp // 2, dtype=torch.uint8, device=device)
            )
            self.register_buffer(
                "scales", torch.ones(n, kp // group_size, dtype=dtype, device=device)
            )
            self.register_buffer(
                "zeros", torch.zeros(n, kp // group_size, dtype=dtype, device=device)
            )
        self.register_buffer("bias", torch.zeros(n, dtype=dtype, device=device) if bias else None)
        self.register_buffer(
            "input_scale", torch.ones(k, dtype=dtype, device=device) if input_scale else None
        )
        self.register_buffer(
            "perm", torch.arange(k, dtype=torch.long, device=device) if perm else None
        )
        self._packed: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, ...]] = {}
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
        AWQ scale; ``input_scale`` is what the input is multiplied by)."""
        k = weight.shape[1]
        if bits == 8:
            q, scales = quantize_int8(weight)
            return cls.from_codes(q, scales, None, bias, bits, None, k, input_scale)
        assert group_size is not None
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
    ) -> QuantLinear:
        """Build from integer codes (int8 ``[N, K]``, or 0..15 ``[N, Kp]`` unpacked)."""
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
        if self.bits == 8:
            return self.qweight.float() * self.scales.float()[:, None]
        assert self.zeros is not None and self.group_size is not None
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
            from foudre.quant.kernels import cpu_linear

            return cpu_linear(self, x)
        if x.device.type == "cuda":
            from foudre.quant.kernels import cuda_linear

            return cuda_linear(self, x)
        return self.forward_reference(x)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        self._packed = {}  # device or dtype moves invalidate the kernel layouts
        return super()._apply(fn, recurse)

    def _load_from_state_dict(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._packed = {}
        return super()._load_from_state_dict(*args, **kwargs)

    def extra_repr(self) -> str:
        extra = f", group_size={self.group_size}" if self.bits == 4 else ""
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}{extra}"


def set_compute_dtype(model: nn.Module, dtype: torch.dtype | None) -> None:
    """Run every ``QuantLinear`` of ``model``'s CPU kernels in ``dtype`` (e.g. bfloat16 for a
    float32 model: much faster, activations rounded to bfloat16); None restores exact dtype."""
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.compute_dtype = dtype
