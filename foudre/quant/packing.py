"""Round-to-nearest quantizers and the canonical packed layouts of quantized weights.

Canonical layouts (what checkpoints store, whatever the device):

- 8 bits, per output channel, symmetric: ``qweight`` int8 ``[N, K]``, ``scales`` ``[N]``;
  ``w = q * scale``.
- 8 bits, group-wise, symmetric (GGUF's Q8_0 with groups of 32): ``qweight`` int8 ``[N, Kp]``,
  ``scales`` ``[N, Kp / G]``; ``w = q * scale``.
- 4 bits, group-wise, asymmetric: ``qweight`` uint8 ``[N, Kp / 2]`` (column ``2j`` in the low
  nibble, ``2j + 1`` in the high one), ``scales`` and ``zeros`` ``[N, Kp / G]`` (zeros are
  zero points held in a float tensor: integers when we quantize, any value (GGUF's Q4_1 and
  Q4_K, ``-min / scale``) when imported); ``w = (q - zero) * scale``.

``Kp`` is ``K`` rounded up to a multiple of the group size; the padded columns quantize zeros
and meet zero inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

INT4_GROUP_SIZES = (32, 64, 128, 256)
INT8_GROUP_SIZES = (16, *INT4_GROUP_SIZES)  # group-wise 8-bit (GGUF's Q6_K has groups of 16)


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


def quantize_int8_grouped(w: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-wise symmetric int8 (GGUF's Q8_0 for ``group_size`` 32): ``(q int8 [N, Kp],
    scales float32 [N, Kp / G])``, ``w`` zero-padded to ``Kp``, each error within scale / 2."""
    w = pad_columns(w.float(), padded_k(w.shape[1], group_size))
    n, k = w.shape
    g = w.reshape(n, k // group_size, group_size)
    scales = g.abs().amax(dim=2) / 127.0
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = torch.round(g / safe[..., None]).clamp(-128, 127).to(torch.int8)
    return q.reshape(n, k), scales


def dequantize_int8_grouped(
    q: torch.Tensor, scales: torch.Tensor, group_size: int, zeros: torch.Tensor | None = None
) -> torch.Tensor:
    """Float32 ``[N, Kp]`` weight of group-wise 8-bit codes: ``(q - zeros) * scales`` per group
    (``zeros`` None: 0)."""
    n, k = q.shape
    g = q.float().reshape(n, k // group_size, group_size)
    if zeros is not None:
        g = g - zeros.float()[..., None]
    return (g * scales.float()[..., None]).reshape(n, k)
