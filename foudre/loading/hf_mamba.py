"""The Mamba-2 mixer's keys of a Hugging Face ``config.json`` (Mamba-2's own names, and the
hybrids' ``mamba_*`` names) as ``ModelConfig`` fields."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from foudre.loading.errors import ModelLoadError

# ModelConfig field -> (Mamba2Config key, BambaConfig key, Hugging Face's default)
_KEYS: dict[str, tuple[str, str, Any]] = {
    "mamba_num_heads": ("num_heads", "mamba_n_heads", 128),
    "mamba_state_size": ("state_size", "mamba_d_state", None),
    "mamba_n_groups": ("n_groups", "mamba_n_groups", None),
    "mamba_conv_kernel": ("conv_kernel", "mamba_d_conv", 4),
    "mamba_chunk_size": ("chunk_size", "mamba_chunk_size", 256),
}
_DEFAULTS: dict[str, dict[str, Any]] = {
    "mamba2": {"state_size": 128, "n_groups": 8},
    "bamba": {"mamba_d_state": 256, "mamba_n_groups": 1},
    "granitemoehybrid": {"mamba_d_state": 256, "mamba_n_groups": 1},
    "falcon_h1": {"mamba_d_state": 256, "mamba_n_groups": 1},
}
# Granite's layer_types (also layers_block_type): its Mamba and its attention layers' names
_GRANITE_MAMBA = ("mamba", "linear_attention")
_GRANITE_ATTENTION = ("attention", "full_attention")


def _positive_int(raw: dict[str, Any], key: str, default: Any, path: Path) -> int:
    value = raw.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"{path}: {key} must be a positive int, got {value!r}", path)
    return value


def _number(value: Any, path: Path) -> float:
    """A float of config.json; transformers writes infinities as ``{"__float__": "Infinity"}``."""
    if isinstance(value, dict) and set(value) == {"__float__"}:
        value = value["__float__"]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ModelLoadError(
            f"{path}: time_step_limit holds {value!r}, not a number", path
        ) from None


def mamba_fields(raw: dict[str, Any], arch: str, path: Path, num_layers: int) -> dict[str, Any]:
    """The ``mamba_*`` fields of ``ModelConfig`` for a ``mamba2`` or ``bamba`` config; raises
    ``ModelLoadError`` naming the key for a missing, invalid or unsupported value."""
    own = arch == "mamba2"
    fields: dict[str, Any] = {}
    for name, (m2, hybrid, default) in _KEYS.items():
        key = m2 if own else hybrid
        fields[name] = _positive_int(raw, key, _DEFAULTS[arch].get(key, default), path)
    hidden = _positive_int(raw, "hidden_size", None, path)
    expand = raw.get("expand" if own else "mamba_expand", 2)
    inner, inner_key = int(expand * hidden), "expand * hidden_size"
    if arch == "falcon_h1" and raw.get("mamba_d_ssm", 1024) is not None:  # its inner width
        inner, inner_key = _positive_int(raw, "mamba_d_ssm", 1024, path), "mamba_d_ssm"
    head_key = "head_dim" if own else "mamba_d_head"
    head_dim = raw.get(head_key, 64 if own else "auto")
    if head_dim == "auto":
        head_dim = inner // fields["mamba_num_heads"]
    fields["mamba_head_dim"] = _positive_int({head_key: head_dim}, head_key, None, path)
    if fields["mamba_num_heads"] * fields["mamba_head_dim"] != inner:
        raise ModelLoadError(
            f"{path}: the Mamba heads ({fields['mamba_num_heads']} x {head_dim}) must make "
            f"{inner_key} = {inner}",
            path,
        )
    fields["mamba_conv_bias"] = bool(raw.get("use_conv_bias" if own else "mamba_conv_bias", True))
    fields["mamba_proj_bias"] = bool(raw.get("use_bias" if own else "mamba_proj_bias", False))
    limit = raw.get("time_step_limit") or (0.0, float("inf"))
    if not isinstance(limit, list | tuple) or len(limit) != 2:
        raise ModelLoadError(f"{path}: time_step_limit must be [min, max], got {limit!r}", path)
    fields["mamba_time_step_limit"] = (_number(limit[0], path), _number(limit[1], path))
    if raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelLoadError(
            f"{path}: unsupported hidden_act {raw['hidden_act']!r} for {arch}; only silu", path
        )
    if own or arch == "falcon_h1":  # (Falcon-H1: a mixer beside the attention of each layer)
        fields["mamba_layers"] = tuple(range(num_layers))
    elif arch == "granitemoehybrid":
        fields["mamba_layers"] = _granite_layers(raw, path, num_layers)
    else:
        attention = raw.get("attn_layer_indices") or []
        if not isinstance(attention, list) or not all(
            isinstance(i, int) and 0 <= i < num_layers for i in attention
        ):
            raise ModelLoadError(
                f"{path}: attn_layer_indices must list layers below {num_layers}, got "
                f"{attention!r}",
                path,
            )
        fields["mamba_layers"] = tuple(i for i in range(num_layers) if i not in attention)
    return fields


def _granite_layers(raw: dict[str, Any], path: Path, num_layers: int) -> tuple[int, ...]:
    types = raw.get("layer_types") or raw.get("layers_block_type") or ["mamba"] * num_layers
    known = _GRANITE_MAMBA + _GRANITE_ATTENTION
    if not isinstance(types, list) or len(types) != num_layers or set(types) - set(known):
        raise ModelLoadError(
            f"{path}: layer_types must give one of {', '.join(known)} for each of the "
            f"{num_layers} layers, got {types!r}",
            path,
        )
    return tuple(i for i, kind in enumerate(types) if kind in _GRANITE_MAMBA)


def granite_fields(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """A Granite 4.0 hybrid's multipliers, positions and experts as ``ModelConfig`` fields."""
    fields: dict[str, Any] = {}
    for key in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
        fields[key] = _positive(raw.get(key, 1.0), key, path)
    if raw.get("attention_multiplier") is not None:
        fields["attention_multiplier"] = _positive(
            raw["attention_multiplier"], "attention_multiplier", path
        )
    kind = raw.get("position_embedding_type")
    if kind not in (None, "nope", "rope"):
        raise ModelLoadError(f"{path}: unsupported position_embedding_type {kind!r}", path)
    fields["use_rope"] = kind == "rope"
    experts = raw.get("num_local_experts", 8)
    if not isinstance(experts, int) or isinstance(experts, bool) or experts < 0:
        raise ModelLoadError(f"{path}: num_local_experts must be >= 0, got {experts!r}", path)
    fields["num_experts"] = experts
    fields["shared_expert_intermediate_size"] = _positive_int(
        raw, "shared_intermediate_size", 1024, path
    )
    if experts:
        fields["num_experts_per_tok"] = _positive_int(raw, "num_experts_per_tok", 2, path)
        fields["moe_intermediate_size"] = _positive_int(raw, "intermediate_size", None, path)
        fields["norm_topk_prob"] = True  # a softmax over the top-k logits
    return fields


def _positive(value: Any, key: str, path: Path) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"{path}: {key} must be a positive number, got {value!r}", path)
    return float(value)


# Falcon-H1's scalar multipliers (ModelConfig fields of the same names)
_FALCON_MULTIPLIERS = (
    "embedding_multiplier",
    "attention_in_multiplier",
    "key_multiplier",
    "attention_out_multiplier",
    "ssm_in_multiplier",
    "ssm_out_multiplier",
    "lm_head_multiplier",
)


def falcon_h1_fields(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """Falcon-H1's multipliers, its mixer's output norm and out_proj bias as ``ModelConfig``
    fields; ``ModelLoadError`` naming the key for a value that is not what transformers
    accepts."""
    fields: dict[str, Any] = {}
    for key in _FALCON_MULTIPLIERS:
        value = raw.get(key, 1.0)
        fields[key] = 1.0 if value is None else _finite(value, key, path)
    for key, count in (("ssm_multipliers", 5), ("mlp_multipliers", 2)):
        values = raw.get(key) or [1.0] * count
        if not isinstance(values, list | tuple) or len(values) != count:
            raise ModelLoadError(f"{path}: {key} must list {count} numbers, got {values!r}", path)
        fields[key] = tuple(_finite(v, key, path) for v in values)
    for key in ("mamba_rms_norm", "mamba_norm_before_gate", "projectors_bias"):
        if not isinstance(raw.get(key, False), bool | None):  # (null: false, as transformers)
            raise ModelLoadError(f"{path}: {key} must be true or false, got {raw[key]!r}", path)
    if not raw.get("mamba_rms_norm", False):
        fields["mamba_gate_norm"] = "none"
    elif raw.get("mamba_norm_before_gate", True):
        fields["mamba_gate_norm"] = "before_gate"
    else:
        fields["mamba_gate_norm"] = "after_gate"
    fields["mamba_out_proj_bias"] = bool(raw.get("projectors_bias", False))
    return fields


def _finite(value: Any, key: str, path: Path) -> float:
    if (
        not isinstance(value, int | float)
        or isinstance(value, bool)
        or value != value
        or abs(value) == float("inf")
    ):
        raise ModelLoadError(f"{path}: {key} must hold finite numbers, got {value!r}", path)
    return float(value)
