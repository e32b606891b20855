"""Checkpoints whose linear weights are stored in 8-bit floats with one scale per block of
weights (DeepSeek-V3, R1 and Kimi-K2 as released: ``quantization_config`` ``{"quant_method":
"fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}``), dequantized as they are read.

Each quantized weight ``W`` ``[out, in]`` (float8 e4m3) comes with ``W_scale_inv``
``[ceil(out / bo), ceil(in / bi)]`` (float32), and the weight it stands for is
``W[i, j] * scale_inv[i // bo, j // bi]``; tensors without a scale (embeddings, norms, routers,
the head) are stored in float as usual. The weights reach the model dequantized (its dtype),
so every scheme and path runs on them as on a float checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from foudre.loading.errors import ModelLoadError

_SCALE = "_scale_inv"  # the suffix of a block scale's name after its weight's


def fp8_block_size(qc: dict[str, Any] | None, path: Path) -> tuple[int, int] | None:
    """The ``(rows, cols)`` of a scale's block when ``qc`` (a ``quantization_config``) says
    the weights are block-scaled float8, else None. ``ModelLoadError`` naming the key for an
    fp8 layout other than e4m3 with a block size."""
    if qc is None or qc.get("quant_method") != "fp8":
        return None
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ModelLoadError(f"{path}: unsupported fp8 quantization_config fmt={fmt!r}", path)
    block = qc.get("weight_block_size")
    if (
        not isinstance(block, list)
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise ModelLoadError(
            f"{path}: fp8 quantization_config needs weight_block_size [rows, cols] "
            f"(per-tensor fp8 is not read), got {block!r}",
            path,
        )
    return block[0], block[1]


def dequantize_fp8_block(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``w`` (float8 ``[out, in]``) times its block scales, in float32. ``ValueError`` when
    the scales' shape does not tile ``w`` by ``block``."""
    (out, cols), (bo, bi) = w.shape, block
    want = (-(-out // bo), -(-cols // bi))
    if w.dim() != 2 or tuple(scale_inv.shape) != want:
        raise ValueError(
            f"block scales of shape {tuple(scale_inv.shape)} for a weight of shape "
            f"{tuple(w.shape)} in blocks of {list(block)}: expected {want}"
        )
    scale = scale_inv.float().repeat_interleave(bo, 0)[:out].repeat_interleave(bi, 1)[:, :cols]
    return w.float() * scale


def dequantize_fp8_blocks(
    weights: Iterable[tuple[str, torch.Tensor]], block: tuple[int, int]
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with each float8 weight and its ``weight_scale_inv`` yielded once, as the
    float32 weight they stand for (under the weight's name); the other tensors as they come.
    A weight waits for its scale (or the scale for its weight) only until the other arrives.
    ``ValueError`` naming a float8 weight without a scale, or a scale without a weight."""
    weights_waiting: dict[str, torch.Tensor] = {}
    scales_waiting: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name.endswith(_SCALE):
            base = name.removesuffix(_SCALE)
            w = weights_waiting.pop(base, None)
            if w is None:
                scales_waiting[base] = tensor
                continue
            yield base, _dequantized(base, w, tensor, block)
        elif tensor.dtype == torch.float8_e4m3fn:
            scale = scales_waiting.pop(name, None)
            if scale is None:
                weights_waiting[name] = tensor
                continue
            yield name, _dequantized(name, tensor, scale, block)
        else:
            yield name, tensor
    for base in weights_waiting:
        raise ValueError(f"float8 weight {base!r} has no {base + _SCALE!r} in the checkpoint")
    for base in scales_waiting:
        raise ValueError(f"{base + _SCALE!r} scales no float8 weight of the checkpoint")


def _dequantized(
    name: str, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    try:
        return dequantize_fp8_block(w, scale_inv, block)
    except ValueError as e:
        raise ValueError(f"weight {name!r}: {e}") from None
