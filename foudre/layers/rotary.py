"""Rotary position embeddings (the "rotate half" convention), with Llama-3, linear and YaRN
scaling."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from foudre.layers import fused


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies per rotated pair, after the configured scaling.

    Supports no scaling, ``linear``, ``llama3`` and ``yarn`` (as ``transformers`` computes
    them); any other ``rope_type`` raises ``ValueError`` rather than silently producing a model
    with wrong positions.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu") / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq.float()
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq.float()
    factor = float(scaling.get("factor", 1.0))
    if rope_type == "linear":
        return (inv_freq / factor).float()
    if rope_type == "llama3":
        low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
        high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_len / low_freq_factor
        high_freq_wavelen = old_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled).float()
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r} (supported: linear, llama3, yarn)"
    )


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor YaRN applies to cos and sin (1 for the other types)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if m and m_all:
        return mscale(factor, float(m)) / mscale(factor, float(m_all))
    return mscale(factor)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN's inverse frequencies: interpolated (divided by ``factor``) for the dimensions that
    rotate fewer than ``beta_slow`` times over the original context, extrapolated (unchanged) for
    those that rotate more than ``beta_fast`` times, a linear ramp between (float32, as
    ``transformers`` computes them)."""
    for key in ("factor", "original_max_position_embeddings"):
        if scaling.get(key) is None:
            raise ValueError(f"rope_scaling of type 'yarn' needs {key!r}, got {scaling}")
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # as transformers: no singularity
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim)
    ramp = (torch.arange(head_dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)
    extrapolation = 1 - torch.clamp(ramp, 0, 1)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q and k laid out as ``[tokens, heads, head_dim]`` at given positions."""

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.theta, self.scaling = theta, scaling
        self._checked: torch.Tensor | None = None  # positions already bounds-checked
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.init_tables(torch.empty(0).device)  # "meta" while the model is built there

    def init_tables(self, device: torch.device) -> None:
        """(Re)compute the float32 cos/sin tables, e.g. after building the model on ``meta``."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling)
        t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        emb = torch.outer(t, inv_freq).repeat(1, 2)
        cos, sin = emb.cos(), emb.sin()
        factor = rope_attention_factor(self.scaling)
        if factor != 1.0:  # YaRN scales q·k through both rotated vectors
            cos, sin = cos * factor, sin * factor
        self.cos, self.sin = cos.to(device), sin.to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q and k. On the CPU's fused path they are rotated in place (the attention
        layer passes views of its fresh q|k|v projection); elsewhere new tensors."""
        if fused.enabled(q, k) and _heads_contiguous(q) and _heads_contiguous(k):
            if positions is not self._checked:  # the same tensor for every layer of a forward
                if len(positions) and not 0 <= int(positions.min()) <= int(positions.max()) < len(
                    self.cos
                ):
                    raise IndexError(f"RoPE position outside the table of {len(self.cos)}")
                self._checked = positions
            q_row = q.shape[1] * q.shape[2] * q.element_size()
            if k.data_ptr() == q.data_ptr() + q_row and k.stride(0) == q.stride(0):
                # k's heads follow q's in each row (views of q|k|v): one pass over both
                both = q.as_strided(
                    (q.shape[0], q.shape[1] + k.shape[1], q.shape[2]),
                    q.stride(),
                    q.storage_offset(),
                )
                fused.rope_(both, self.cos, self.sin, positions)
            else:
                fused.rope_(q, self.cos, self.sin, positions)
                fused.rope_(k, self.cos, self.sin, positions)
            return q, k
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def init_rotary_tables(model: nn.Module, device: torch.device) -> None:
    """``init_tables(device)`` on every ``RotaryEmbedding`` of ``model`` (a model built on
    ``meta`` holds no values in any of them; Gemma 3 has two, for its sliding and its global
    layers)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.init_tables(device)
