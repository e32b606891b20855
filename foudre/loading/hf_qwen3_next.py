"""Qwen3-Next's own keys of a Hugging Face ``config.json`` (its gated DeltaNet layers and which
layers they are) as ``ModelConfig`` fields; its attention, RoPE and experts are parsed with the
other families' (``hf.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from foudre.loading.errors import ModelLoadError

# ModelConfig field -> (config.json key, transformers' default)
_KEYS: dict[str, tuple[str, int]] = {
    "linear_num_key_heads": ("linear_num_key_heads", 16),
    "linear_num_value_heads": ("linear_num_value_heads", 32),
    "linear_key_head_dim": ("linear_key_head_dim", 128),
    "linear_value_head_dim": ("linear_value_head_dim", 128),
    "linear_conv_kernel": ("linear_conv_kernel_dim", 4),
}
_MIXERS = ("linear_attention", "full_attention")


def _positive_int(raw: dict[str, Any], key: str, default: Any, path: Path) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"{path}: {key} must be a positive int, got {value!r}", path)
    return value


def _layer_types(raw: dict[str, Any], layers: int, path: Path) -> list[str]:
    """Each layer's mixer: the config's ``layer_types``, else every ``full_attention_interval``
    -th layer attention and the others linear (transformers' rule)."""
    types = raw.get("layer_types")
    if types is None:
        every = _positive_int(raw, "full_attention_interval", 4, path)
        return [
            "full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(layers)
        ]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= set(_MIXERS):
        raise ModelLoadError(
            f"{path}: layer_types must give one of {', '.join(_MIXERS)} for each of the "
            f"{layers} layers, got {types!r}",
            path,
        )
    return types


def qwen3_next_fields(raw: dict[str, Any], path: Path, layers: int) -> dict[str, Any]:
    """The ``linear_*`` fields of ``ModelConfig`` for a ``qwen3_next`` config; raises
    ``ModelLoadError`` naming the key for a missing, invalid or unsupported value."""
    fields: dict[str, Any] = {
        name: _positive_int(raw, key, default, path) for name, (key, default) in _KEYS.items()
    }
    if fields["linear_conv_kernel"] < 2:
        raise ModelLoadError(f"{path}: linear_conv_kernel_dim must be at least 2", path)
    if fields["linear_num_value_heads"] % fields["linear_num_key_heads"]:
        raise ModelLoadError(
            f"{path}: linear_num_value_heads={fields['linear_num_value_heads']} must be a "
            f"multiple of linear_num_key_heads={fields['linear_num_key_heads']}",
            path,
        )
    if raw.get("attention_bias"):
        raise ModelLoadError(f"{path}: attention_bias=true is not supported for qwen3_next", path)
    types = _layer_types(raw, layers, path)
    fields["linear_layers"] = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    return fields
