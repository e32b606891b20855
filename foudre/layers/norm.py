"""RMSNorm, computed in float32 as the reference implementations do."""

from __future__ import annotations

import torch
from torch import nn

from foudre.layers import fused


class RMSNorm(nn.Module):
    """``weight * x / rms(x)`` over the last dimension.

    The normalisation runs in float32 and the result is cast back to the input dtype before the
    weight multiplies it, which is what Hugging Face's Llama does; matching it keeps logits equal.
    """

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.enabled(x, self.weight):
            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class OffsetRMSNorm(nn.Module):
    """``(1 + weight) * x / rms(x)`` over the last dimension (Gemma's form: the stored weight is
    the offset from one, so a zero weight is the identity scale).

    Everything runs in float32, the weight's product included, and the result is cast back to
    the input dtype once, which is what Hugging Face's Gemma 3 does."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused.enabled(x, self.weight):
            return fused.offset_rms_norm(x, self.weight, self.eps)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
