"""FP8 weights (``--quantization fp8``): ``Fp8Linear``, a linear whose weight is float8 e4m3.

Layout: ``weight`` float8_e4m3fn ``[N, K]`` and ``weight_scale`` float32 ``[N]``, one scale per
output channel (the row's largest magnitude over 448, e4m3's largest finite value);
``w = q * scale``. e4m3 keeps 3 mantissa bits: every normal weight is within 2^-4 of its
magnitude (relative; subnormals within half of e4m3's smallest step times the scale), the
largest of each row exact. The weight stays float8 and the scales float32
through ``model.to(dtype)``; only the bias takes the model's dtype.

Forward, by device:

- CUDA, compute capability 9.0+ (Hopper), bfloat16 activations, more than ``TRITON_MAX_ROWS``
  rows, K and N multiples of 16: the activations are quantized per token to e4m3 (scale: the
  row's largest magnitude over 448, computed on the device) and ``torch._scaled_mm`` runs the
  product on the FP8 tensor cores with row-wise scales (``scaled_mm``).
- other CUDA cases on compute capability 8.9+ with Triton: weight-only, the Triton kernels of
  ``triton_kernels`` (the weight read once and upcast in registers; the GEMV / split-K kernel
  for decode batches).
- elsewhere (CPU, older GPUs): weight-only, the weight upcast to the activations' dtype (exact:
  every e4m3 value is a bfloat16 / float32 value), ``F.linear``, then the scales; float16
  activations dequantize first (codes up to 448 times large activations overflow float16).

On Hopper a row's result therefore depends on its batch: up to ``TRITON_MAX_ROWS`` rows its
activations stay as they are, above they are rounded to e4m3.

``forward_reference`` (dequantize, ``F.linear``) is what every weight-only path computes to
within the activation dtype's rounding; the activation-quantized path adds e4m3's rounding of
the activations (``scaled_mm_reference`` emulates it exactly in float64).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# decode batches up to this many rows run the weight-only Triton kernels even on Hopper (they
# read the weight once and skip quantizing the activations)
TRITON_MAX_ROWS = 16


def quantize_fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 ``(q float8_e4m3fn [N, K], scales float32 [N])`` of ``w`` ``[N, K]``:
    ``scale = amax / 448`` (rows of zeros get scale 1), ``q = round(w / scale)`` to e4m3."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scales[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (row) e4m3 of activations ``x [M, K]``: ``(xq [M, K], scales float32
    [M, 1])``, all on the device (no host sync)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
    scales = amax / FP8_MAX
    return (xf / scales).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scales


def scaled_mm(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``x [M, K] @ (weight * scale).T`` with x quantized per token to e4m3, through
    ``torch._scaled_mm`` (row-wise scales, float32 accumulation); K and N multiples of 16 on
    CUDA, where row-wise scaling outputs bfloat16 only (``uses_scaled_mm`` asks for it). Runs
    on the CPU as well (torch's CPU build implements it), which the tests use."""
    xq, xs = quantize_rows(x.contiguous())
    return torch._scaled_mm(
        xq, weight.t(), scale_a=xs, scale_b=weight_scale.view(1, -1), out_dtype=out_dtype
    )


def scaled_mm_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """What ``scaled_mm`` computes, in float64: the e4m3-rounded activations times the
    dequantized weight."""
    xq, xs = quantize_rows(x)
    w = weight.double() * weight_scale.double()[:, None]
    return (xq.double() * xs.double()) @ w.t()


def uses_scaled_mm(x: torch.Tensor, n: int) -> bool:
    """Whether ``Fp8Linear`` runs ``x [M, K]`` through ``scaled_mm`` (see the module's
    docstring)."""
    if x.device.type != "cuda" or x.dtype != torch.bfloat16 or x.shape[0] <= TRITON_MAX_ROWS:
        return False
    if x.shape[1] % 16 or n % 16:
        return False
    return torch.cuda.get_device_capability(x.device) >= (9, 0)


class Fp8Linear(nn.Module):
    """A linear with an e4m3 weight and per-output-channel float32 scales (module docstring).
    The output dtype is the input's."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    bias: torch.Tensor | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        n, k = out_features, in_features
        self.register_buffer("weight", torch.zeros(n, k, dtype=FP8_DTYPE, device=device))
        self.register_buffer("weight_scale", torch.ones(n, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(n, dtype=dtype, device=device) if bias else None)

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> Fp8Linear:
        """Round ``weight`` ``[N, K]`` to e4m3 per output channel (``quantize_fp8``); the bias
        keeps its dtype (float32 when absent)."""
        n, k = weight.shape
        dtype = bias.dtype if bias is not None else torch.float32
        mod = cls(k, n, bias is not None, dtype, weight.device)
        q, scales = quantize_fp8(weight)
        with torch.no_grad():
            mod.weight.copy_(q)
            mod.weight_scale.copy_(scales)
            if bias is not None:
                assert mod.bias is not None
                mod.bias.copy_(bias)
        return mod

    def dequantize(self) -> torch.Tensor:
        """The float32 weight ``[N, K]``."""
        return self.weight.float() * self.weight_scale[:, None]

    def forward_reference(self, x: torch.Tensor) -> torch.Tensor:
        """Dequantize-then-matmul in x's dtype; the definition the weight-only paths meet."""
        bias = self.bias.to(x.dtype) if self.bias is not None else None
        return F.linear(x, self.dequantize().to(x.dtype), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        if uses_scaled_mm(x2, self.out_features):
            y = scaled_mm(x2, self.weight, self.weight_scale, x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        elif x.device.type == "cuda" and _triton_fp8(x.device):
            import foudre.quant.triton_kernels as triton_kernels

            y = triton_kernels.quant_matmul(
                x2, self.weight, self.weight_scale, None, None, self.bias
            )
        elif x.dtype == torch.float16:  # codes up to 448 and tiny scales: both overflow fp16
            y = self.forward_reference(x2)
        else:
            y = F.linear(x2, self.weight.to(x.dtype)) * self.weight_scale.to(x.dtype)
            if self.bias is not None:
                y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        # model.to(dtype) casts every floating tensor, float8 included: hand the weight and
        # its scales over as raw bytes, which device moves carry and dtype casts leave alone
        raw = {name: self._buffers[name] for name in ("weight", "weight_scale")}
        for name, t in raw.items():
            assert t is not None
            self._buffers[name] = t.view(torch.uint8)
        try:
            return super()._apply(fn, recurse)
        finally:
            for name, t in raw.items():
                moved = self._buffers[name]
                assert moved is not None and t is not None
                self._buffers[name] = moved.view(t.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8=e4m3"


def _triton_fp8(device: torch.device) -> bool:
    """Whether the Triton kernels take float8 weights on ``device`` (compute capability 8.9+
    and Triton importable)."""
    if torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
