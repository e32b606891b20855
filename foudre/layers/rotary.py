"""Rotary position embeddings (the "rotate half" convention), with Llama-3, linear, YaRN and
LongRoPE scaling, over the whole head or its first ``rotary_dim`` dimensions (partial rotary)."""

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
    if rope_type == "longrope":  # the short factors; longrope_inv_freq gives the long ones
        return longrope_inv_freq(head_dim, theta, scaling, long=False)
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r} (supported: linear, llama3, yarn, longrope)"
    )


def longrope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any], long: bool
) -> torch.Tensor:
    """LongRoPE's (Phi-3's "su") inverse frequencies: the plain ones each divided by its own
    factor, ``short_factor`` within the original context, ``long_factor`` beyond it (float32,
    as ``transformers`` computes them). ``head_dim`` is the rotated width."""
    key = "long_factor" if long else "short_factor"
    factors = scaling.get(key)
    if not isinstance(factors, list | tuple) or len(factors) != head_dim // 2:
        raise ValueError(
            f"rope_scaling of type 'longrope' needs {key!r}: a list of {head_dim // 2} numbers "
            f"(half the rotated dimensions), got {factors!r}"
        )
    ext = torch.tensor([float(f) for f in factors], dtype=torch.float32, device="cpu")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    return 1.0 / (ext * theta**exponents)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """The factor YaRN and LongRoPE apply to cos and sin (1 for the other types)."""
    rope_type = None if not scaling else scaling.get("rope_type", scaling.get("type"))
    if scaling is None or rope_type not in ("yarn", "longrope"):
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    if rope_type == "longrope":  # sqrt(1 + log(factor) / log(original context))
        if factor <= 1.0:
            return 1.0
        original = float(scaling["original_max_position_embeddings"])
        return math.sqrt(1 + math.log(factor) / math.log(original))

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
    """Applies RoPE to q and k laid out as ``[tokens, heads, head_dim]`` at given positions.

    Only the first ``rotary_dim`` dimensions of each head rotate (all by default; partial
    rotary, as Phi-4-mini's 0.75, leaves the rest as they are).

    LongRoPE picks its factors as ``transformers`` does: per forward, by the sequence's length
    (its last position + 1): the long factors beyond ``original_max_position_embeddings``, else
    the short ones. ``transformers``' ``generate`` drops its cache when a sequence first grows
    past the original context and computes it again with the long factors, so no key stays
    short-rotated; the engine does the same (the scheduler recomputes such a request). The
    table holds ``max_positions`` rows by the position alone (short below ``original``, long
    from it), then ``max_positions`` rows of long factors only, which a request whose prompt
    exceeds the original context reads through ``position_offset`` (its positions are shifted
    by it; the runner adds it, and the prefix cache keeps such requests' blocks apart). Decode
    positions of such a request lie beyond ``original``, where both halves agree, so paths that
    place only decode tokens may leave it out.
    """

    cos: torch.Tensor
    sin: torch.Tensor

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, Any] | None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.head_dim, self.max_positions = head_dim, max_positions
        self.rotary_dim = rotary_dim or head_dim
        if not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise ValueError(
                f"rotary_dim must be even and within 1..head_dim={head_dim}, got {rotary_dim}"
            )
        self.theta, self.scaling = theta, scaling
        # LongRoPE's original context (None: one table, every position as itself)
        self.original: int | None = None
        if scaling and scaling.get("rope_type", scaling.get("type")) == "longrope":
            self.original = int(scaling["original_max_position_embeddings"])
        self._checked: torch.Tensor | None = None  # positions already bounds-checked
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.init_tables(torch.empty(0).device)  # "meta" while the model is built there

    def position_offset(self, num_prompt_tokens: int) -> int:
        """What to add to every position of a request whose prompt has ``num_prompt_tokens``
        tokens (0 but for a LongRoPE prompt longer than the original context)."""
        if self.original is not None and num_prompt_tokens > self.original:
            return self.max_positions
        return 0

    def init_tables(self, device: torch.device) -> None:
        """(Re)compute the float32 cos/sin tables, e.g. after building the model on ``meta``."""
        inv_freq = rope_inv_freq(self.rotary_dim, self.theta, self.scaling)
        t = torch.arange(self.max_positions, dtype=torch.float32, device="cpu")
        emb = torch.outer(t, inv_freq)
        if self.original is not None:
            assert self.scaling is not None
            long_freq = longrope_inv_freq(self.rotary_dim, self.theta, self.scaling, long=True)
            long = torch.outer(t, long_freq)
            emb[self.original :] = long[self.original :]
            emb = torch.cat([emb, long])
        emb = emb.repeat(1, 2)
        cos, sin = emb.cos(), emb.sin()
        factor = rope_attention_factor(self.scaling)
        if factor != 1.0:  # YaRN and LongRoPE scale q·k through both rotated vectors
            cos, sin = cos * factor, sin * factor
        self.cos, self.sin = cos.to(device), sin.to(device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated q and k. On the CPU's fused path they are rotated in place (the attention
        layer passes views of its fresh q|k|v projection); elsewhere new tensors."""
        if self.rotary_dim < self.head_dim:
            return self._partial(positions, q), self._partial(positions, k)
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

    def _partial(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x`` with its first ``rotary_dim`` dimensions of each head rotated."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


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
