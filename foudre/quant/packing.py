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

- 6 bits (GGUF's Q6_K, as its files hold it): ``qweight`` uint8 ``[N, 13 Kp / 16]``
  (``pack_int6``: per 128 columns the low nibbles of codes 0..63 as ``pack_int4`` lays them,
  their top two bits, then an int8 sub-scale ``sc`` per 16 columns), ``scales`` ``d``
  ``[N, Kp / 256]``; ``w = (q - 32) * (d * sc)``.

``Kp`` is ``K`` rounded up to a multiple of the group size (of 256 for 6 bits); the padded
columns quantize zeros and meet zero inputs.
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


INT6_BLOCK = 256  # columns per d of a 6-bit weight (Q6_K's super-block); sub-scales per 16


def pack_int6(q: torch.Tensor, sub_scales: torch.Tensor) -> torch.Tensor:
    """Codes 0..63 ``[N, Kp]`` (Kp a multiple of 256) and int8 ``sub_scales`` ``[N, Kp / 16]`` to
    the 6-bit rows ``[N, 13 Kp / 16]``: per 128 columns a block of 104 bytes (a row is one
    sequential stream), the low nibbles (64 bytes, ``pack_int4``'s), the top two bits (32 bytes,
    byte ``i`` holding those of the block's columns ``2i`` in bits 0-1, ``2i + 64`` in 2-3,
    ``2i + 1`` in 4-5, ``2i + 65`` in 6-7: one shift lines up 64 codes of ``pack_int4``'s even or
    odd columns), then the block's 8 sub-scales."""
    n, k = q.shape
    if k % INT6_BLOCK or sub_scales.shape != (n, k // 16) or sub_scales.dtype != torch.int8:
        raise ValueError(
            f"6-bit codes {tuple(q.shape)} need K a multiple of {INT6_BLOCK} and int8 sub-scales "
            f"[N, K / 16], got {sub_scales.dtype} {tuple(sub_scales.shape)}"
        )
    if q.dtype.is_floating_point or q.dtype == torch.bool:
        raise ValueError(f"6-bit codes must be integers 0..63, got {q.dtype}")
    if q.numel() and (int(q.min()) < 0 or int(q.max()) > 63):
        raise ValueError(f"6-bit codes must be 0..63, got {int(q.min())}..{int(q.max())}")
    q = q.to(torch.uint8).reshape(n, k // 128, 128)
    top = q >> 4
    even, odd = top[..., 0::2], top[..., 1::2]
    tops = even[..., :32] | (even[..., 32:] << 2) | (odd[..., :32] << 4) | (odd[..., 32:] << 6)
    nibbles = (q[..., 0::2] & 0xF) | ((q[..., 1::2] & 0xF) << 4)
    subs = sub_scales.view(torch.uint8).reshape(n, k // 128, 8)
    return torch.cat([nibbles, tops, subs], dim=-1).reshape(n, k // 128 * 104)


def quantize_int6(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 6-bit codes in Q6_K's form: ``(codes uint8 0..63 [N, Kp], int8 sub-scales
    [N, Kp / 16], d float32 [N, Kp / 256])``, ``w`` zero-padded to ``Kp`` (a multiple of 256).
    Each sub-block's step ``d * sc`` is its ``max|w| / 31`` rounded up to a multiple of ``d``
    (``d`` the largest of those over 127), so every code is within -31..31 of 32 and every error
    within half the step."""
    w = pad_columns(w.float(), padded_k(w.shape[1], INT6_BLOCK))
    n, k = w.shape
    g = w.reshape(n, k // 16, 16)
    sub = g.abs().amax(-1) / 31  # [N, Kp / 16]
    d = sub.reshape(n, k // INT6_BLOCK, INT6_BLOCK // 16).amax(-1) / 127
    per_sub = d.repeat_interleave(INT6_BLOCK // 16, dim=1)
    sc = torch.ceil(sub / torch.where(per_sub > 0, per_sub, torch.ones_like(per_sub))).clamp(0, 127)
    s = sc * per_sub
    q = torch.round(g / torch.where(s > 0, s, torch.ones_like(s))[..., None]).clamp(-32, 31) + 32
    return q.reshape(n, k).to(torch.uint8), sc.to(torch.int8), d


def unpack_int6(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of ``pack_int6``: codes uint8 ``[N, Kp]`` and int8 sub-scales ``[N, Kp / 16]``."""
    if packed.dim() != 2 or packed.shape[1] % 208:
        raise ValueError(f"6-bit rows {tuple(packed.shape)}: 104 bytes per 128 columns, Kp / 256")
    n, blocks = packed.shape[0], packed.shape[1] // 104
    b = packed.reshape(n, blocks, 104)
    nibbles, tops = b[..., :64], b[..., 64:96]
    even = torch.cat([tops & 3, (tops >> 2) & 3], dim=-1) << 4 | (nibbles & 0xF)
    odd = torch.cat([(tops >> 4) & 3, tops >> 6], dim=-1) << 4 | (nibbles >> 4)
    q = torch.stack([even, odd], dim=-1).reshape(n, blocks * 128)
    subs = b[..., 96:].contiguous().view(torch.int8).reshape(n, blocks * 8)
    return q, subs


def dequantize_int6(packed: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Float32 ``[N, Kp]`` weight of 6-bit rows: ``(q - 32) * (d * sc)`` in float32 (the gguf
    package's Q6_K arithmetic, exactly)."""
    q, subs = unpack_int6(packed)
    n, k = q.shape
    s = (d.float().repeat_interleave(INT6_BLOCK // 16, dim=1) * subs.float())[..., None]
    return ((q.float() - 32.0).reshape(n, k // 16, 16) * s).reshape(n, k)


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
