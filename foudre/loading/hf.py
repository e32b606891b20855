"""Hugging Face checkpoints: where they are, their config, their safetensors weights.

Only safetensors are read. Pickle checkpoints (``pytorch_model.bin``, ``*.pt``) can run code
when loaded, so they are refused with a message that says how to convert them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import mmap
import re
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from foudre.loading.errors import ModelLoadError
from foudre.loading.hf_mamba import falcon_h1_fields, granite_fields, mamba_fields
from foudre.loading.hf_qwen3_next import qwen3_next_fields
from foudre.models.config import SUPPORTED_ARCHITECTURES, ModelConfig

logger = logging.getLogger(__name__)

HUB_ALLOW_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.txt", "*.jinja")

# `architectures` entries we know, for configs whose `model_type` is missing or unfamiliar.
_ARCHITECTURE_CLASSES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "DeepseekV3ForCausalLM": "deepseek_v3",  # Kimi-K2's model_type is kimi_k2
    "GptOssForCausalLM": "gpt_oss",
    "Phi3ForCausalLM": "phi3",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
    "Mamba2ForCausalLM": "mamba2",
    "BambaForCausalLM": "bamba",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "FalconH1ForCausalLM": "falcon_h1",
    "Qwen3NextForCausalLM": "qwen3_next",
}
# `model_type`s that name one of SUPPORTED_ARCHITECTURES otherwise
_MODEL_TYPES = {"gemma3_text": "gemma3"}

# Hugging Face's defaults per model type for keys a config.json may leave out
# (transformers 5.x, models/<type>/configuration_<type>.py).
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"max_position_embeddings": 4096 * 32},
    "qwen2": {"max_position_embeddings": 32768},
    "qwen3": {"max_position_embeddings": 32768, "head_dim": 128},
    "mixtral": {
        "max_position_embeddings": 4096 * 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
    },
    "qwen2_moe": {
        "max_position_embeddings": 32768,
        "num_experts": 60,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 1408,
        "shared_expert_intermediate_size": 5632,
    },
    "qwen3_moe": {
        "max_position_embeddings": 32768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    },
    "olmoe": {"max_position_embeddings": 4096, "num_experts": 64, "num_experts_per_tok": 8},
    "deepseek_v3": {
        "max_position_embeddings": 4096,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "n_shared_experts": 1,
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "rope_interleave": True,
        "num_nextn_predict_layers": 1,
    },
    "gpt_oss": {
        "max_position_embeddings": 131072,
        "head_dim": 64,
        "num_experts": 128,
        "num_experts_per_tok": 4,
    },
    "phi3": {
        "max_position_embeddings": 4096,
        "original_max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
    },
    "bamba": {"max_position_embeddings": 262144},  # its partial rotary factor is fixed at 0.5
    "granitemoehybrid": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "falcon_h1": {"max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "num_key_value_heads": 8},
    "qwen3_next": {
        "max_position_embeddings": 32768,
        "head_dim": 256,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "norm_topk_prob": True,
        "partial_rotary_factor": 0.25,
    },
    # Gemma3TextConfig's defaults (a multimodal config's text_config leaves many out)
    "gemma3": {
        "vocab_size": 262_208,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131_072,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 2,
        "eos_token_id": 1,
        "tie_word_embeddings": True,
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
}

# gpt-oss: what transformers assumes for the keys a config.json leaves out (GptOssConfig)
_GPT_OSS_KEYS: dict[str, Any] = {
    "sliding_window": 128,
    "attention_bias": True,
    "rms_norm_eps": 1e-5,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}

# Keys of other mixture-of-experts routers (DeepSeek's sigmoid scores, grouped top-k and scaled
# weights), with the values that mean "as the architectures here route": a config that asks for
# anything else is refused, naming the key, rather than routed wrongly. (Training-only keys such
# as router_jitter_noise or router_aux_loss_coef change nothing at inference.)
_MOE_ROUTING_KEYS: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("softmax", None),
    "topk_method": ("greedy", None),
    "n_group": (1, None),
    "topk_group": (1, None),
    "routed_scaling_factor": (1, 1.0, None),
}

_DTYPES = ("float32", "float16", "bfloat16")
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def resolve_model_path(
    model: str,
    revision: str | None = None,
    *,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
) -> Path:
    """Return the local path of ``model``: a directory or file as is, else a Hub snapshot.

    A string that names an existing file or directory is returned unchanged (``~`` expanded).
    A string shaped like a Hub id (``org/name``) is fetched with ``snapshot_download`` (configs,
    safetensors and tokenizer files only; a cached snapshot is used without network when
    offline). Anything else raises ``ModelLoadError``.
    """
    path = Path(model).expanduser()
    if path.exists():
        return path
    if not _HUB_ID.match(model):
        raise ModelLoadError(f"{model}: no such file or directory", path)
    from huggingface_hub import snapshot_download

    try:
        snapshot = snapshot_download(
            repo_id=model,
            revision=revision,
            allow_patterns=list(HUB_ALLOW_PATTERNS),
            cache_dir=cache_dir,
            local_files_only=local_files_only,
        )
    except Exception as exc:  # the hub raises many kinds (HTTP, offline, validation, OS)
        raise ModelLoadError(
            f"model {model!r} is not a local path and could not be downloaded from the "
            f"Hugging Face Hub (offline?): {type(exc).__name__}: {exc}"
        ) from exc
    return Path(snapshot)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found", path) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc}", path) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{path}: invalid JSON: {exc}", path) from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: expected a JSON object, got {type(data).__name__}", path)
    return data


def load_generation_config(model_dir: Path) -> dict[str, Any]:
    """Return ``generation_config.json`` of ``model_dir`` as a dict; ``{}`` when there is none.

    A file that exists but is not a JSON object raises ``ModelLoadError`` naming it.
    """
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return {}
    return _read_json(path)


def _architecture(raw: dict[str, Any], path: Path) -> str:
    model_type = raw.get("model_type")
    model_type = _MODEL_TYPES.get(str(model_type), model_type)
    if model_type in SUPPORTED_ARCHITECTURES:
        return str(model_type)
    architectures = raw.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    for name in architectures:
        if name in _ARCHITECTURE_CLASSES:
            return _ARCHITECTURE_CLASSES[name]
    found = model_type if model_type is not None else "/".join(map(str, architectures)) or None
    raise ModelLoadError(
        f"{path}: unsupported architecture {found!r}; supported: "
        f"{', '.join(SUPPORTED_ARCHITECTURES)} ({', '.join(_ARCHITECTURE_CLASSES)})",
        path,
    )


def _token_ids(value: Any, key: str, path: Path) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ModelLoadError(f"{path}: {key} must be an int or a list of ints, got {value!r}", path)
    return list(values)


def _rope(
    raw: dict[str, Any], max_positions: int, path: Path, arch: str = "llama"
) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either the 4.x or the 5.x layout of config.json."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if isinstance(params, dict) and "full_attention" in params:  # per layer type (Gemma 3)
        params = params["full_attention"] or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"{path}: rope_parameters must be an object, got {params!r}", path)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, int | float) or theta <= 0:
        raise ModelLoadError(f"{path}: rope_theta must be a positive number, got {theta!r}", path)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if arch == "phi3" and rope_type in ("su", "yarn"):  # Phi-3's older names of LongRoPE
        rope_type = "longrope"
    if rope_type == "default":
        return float(theta), None
    if rope_type == "longrope" and arch != "phi3":
        raise ModelLoadError(
            f"{path}: rope_scaling 'longrope' is supported for phi3 models only, not {arch}", path
        )
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "type")}
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn", "longrope"):  # as transformers' standardize_rope_params
        scaling.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", max_positions),
        )
    if rope_type == "yarn" and scaling.get("factor") is None:  # DeepSeek's way: by the ratio
        scaling["factor"] = max_positions / scaling["original_max_position_embeddings"]
    if rope_type == "longrope":
        _longrope(raw, scaling, max_positions, path)
    return float(theta), scaling


def _longrope(raw: dict[str, Any], scaling: dict[str, Any], max_positions: int, path: Path) -> None:
    """Complete Phi-3's LongRoPE ``scaling`` as ``transformers`` reads it: the config's own
    ``original_max_position_embeddings`` (4096 when absent) wins over the one in
    ``rope_scaling``, and a missing ``factor`` is the ratio of the extended to the original
    context (it sets the attention factor)."""
    original = raw.get("original_max_position_embeddings", 4096)
    if not isinstance(original, int) or isinstance(original, bool) or original <= 0:
        raise ModelLoadError(
            f"{path}: original_max_position_embeddings must be a positive int, got {original!r}",
            path,
        )
    scaling["original_max_position_embeddings"] = original
    if scaling.get("factor") is None:
        scaling["factor"] = max_positions / original
    for key in ("short_factor", "long_factor"):
        factors = scaling.get(key)
        if not isinstance(factors, list) or not all(
            isinstance(f, int | float) and not isinstance(f, bool) and f > 0 for f in factors
        ):
            raise ModelLoadError(
                f"{path}: rope_scaling 'longrope' needs {key} as a list of positive numbers, "
                f"got {factors!r}",
                path,
            )


def _partial_rotary(raw: dict[str, Any], arch: str, path: Path) -> float:
    """The fraction of each head RoPE turns (Phi-3 / Phi-4; Qwen3-Next's is 0.25 unless set;
    Bamba's is 0.5 whatever its config says, as in transformers; 1 for the other families)."""
    if arch == "bamba":
        return 0.5
    if arch not in ("phi3", "qwen3_next"):
        return 1.0
    default = _HF_DEFAULTS[arch].get("partial_rotary_factor", 1.0)
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    value = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", default))
    if value is None:
        return 1.0
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= 1:
        raise ModelLoadError(
            f"{path}: partial_rotary_factor must be a number in (0, 1], got {value!r}", path
        )
    return float(value)


def _dtype(raw: dict[str, Any], path: Path) -> str:
    value = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    name = str(value).removeprefix("torch.")
    if name not in _DTYPES:
        raise ModelLoadError(
            f"{path}: unsupported dtype {value!r}; supported: {', '.join(_DTYPES)}", path
        )
    return name


def _sliding_window(raw: dict[str, Any], arch: str) -> int | None:
    """The attention window, when the model really uses one (Mistral v0.1, some Qwen)."""
    window = raw.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return None
    if arch in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe") and not raw.get(
        "use_sliding_window", False
    ):
        return None
    return window


def _layer_types(
    raw: dict[str, Any], arch: str, num_layers: int, window: int | None
) -> tuple[str, ...] | None:
    """Which layers slide, as transformers decides it: every layer for Mistral, Mixtral and
    Qwen3-MoE (None); for Qwen2 and Qwen3 the config's ``layer_types``, else the layers from
    ``max_window_layers`` on; for Qwen2-MoE its ``layer_types``, else the even-numbered layers
    below ``max_window_layers``; for Gemma 3 its ``layer_types``, else every layer but each
    ``sliding_window_pattern``-th."""
    if window is None or arch not in ("qwen2", "qwen3", "qwen2_moe", "gpt_oss", "gemma3"):
        return None
    given = raw.get("layer_types")
    if isinstance(given, list):
        return tuple(str(t) for t in given)
    if arch == "gpt_oss":  # even layers slide, odd ones attend to everything
        return tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)
        )
    if arch == "gemma3":
        every = raw["sliding_window_pattern"]  # checked by _gemma3_text_config
        return tuple(
            "sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)
        )
    first = raw.get("max_window_layers", 28)
    if arch == "qwen2_moe":
        return tuple(
            "sliding_attention" if i % 2 == 0 and i < first else "full_attention"
            for i in range(num_layers)
        )
    return tuple("sliding_attention" if i >= first else "full_attention" for i in range(num_layers))


# DeepSeek-V3's routing keys and the values that mean its routing (sigmoid scores, the
# selection bias, group-limited top-k): anything else is refused, naming the key.
_DEEPSEEK_ROUTING_KEYS: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("sigmoid", None),
    "topk_method": ("noaux_tc", None),
}


def _deepseek_v3(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """DeepSeek-V3's (and Kimi-K2's) ``ModelConfig`` fields: latent attention and routing."""
    defaults = _HF_DEFAULTS["deepseek_v3"]

    def get(key: str) -> Any:
        return raw[key] if key in raw else defaults[key]

    def count(key: str, minimum: int = 1) -> int:
        value = get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ModelLoadError(f"{path}: {key} must be an int >= {minimum}, got {value!r}", path)
        return value

    for key, accepted in _DEEPSEEK_ROUTING_KEYS.items():
        if raw.get(key) not in accepted:
            raise ModelLoadError(
                f"{path}: unsupported mixture-of-experts routing {key}={raw[key]!r} for "
                f"deepseek_v3 (supported: {accepted[0]!r})",
                path,
            )
    scaling = get("routed_scaling_factor")
    _positive_number(path, "routed_scaling_factor", scaling)
    experts, inter = count("n_routed_experts"), count("moe_intermediate_size")
    q_lora = get("q_lora_rank")
    return dict(
        num_experts=experts,
        num_experts_per_tok=count("num_experts_per_tok"),
        moe_intermediate_size=inter,
        norm_topk_prob=bool(get("norm_topk_prob")),
        moe_scoring_func="sigmoid",
        shared_expert_intermediate_size=count("n_shared_experts", 0) * inter,
        mlp_only_layers=tuple(range(count("first_k_dense_replace", 0))),
        n_group=1 if raw.get("n_group", 0) is None else count("n_group"),
        topk_group=1 if raw.get("topk_group", 0) is None else count("topk_group"),
        routed_scaling_factor=float(scaling),
        kv_lora_rank=count("kv_lora_rank"),
        q_lora_rank=None if q_lora is None else count("q_lora_rank"),
        qk_nope_head_dim=count("qk_nope_head_dim"),
        qk_rope_head_dim=count("qk_rope_head_dim"),
        v_head_dim=count("v_head_dim"),
        rope_interleave=bool(get("rope_interleave")),
        num_nextn_predict_layers=count("num_nextn_predict_layers", 0),
    )


def _moe(raw: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """The ``ModelConfig`` mixture-of-experts fields of a config.json (``{}`` for dense ones)."""
    if arch == "deepseek_v3":
        return _deepseek_v3(raw, path)
    if arch not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "qwen3_next"):
        return {}
    defaults = _HF_DEFAULTS[arch]

    def count(*keys: str, default: Any = None) -> int:
        """The first of ``keys`` the config sets, else Hugging Face's default for it."""
        value = next((raw[k] for k in keys if raw.get(k) is not None), None)
        if value is None:
            value = next((defaults[k] for k in keys if k in defaults), default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ModelLoadError(
                f"{path}: {keys[0]} must be a non-negative int, got {value!r}", path
            )
        return value

    for key, accepted in _MOE_ROUTING_KEYS.items():
        if key in raw and raw[key] not in accepted:
            raise ModelLoadError(
                f"{path}: unsupported mixture-of-experts routing {key}={raw[key]!r} "
                "(foudre routes by softmax then top-k, as Mixtral and Qwen-MoE do)",
                path,
            )
    num_experts = count("num_experts", "num_local_experts")
    if num_experts == 0 and arch == "qwen3_next":  # dense MLPs in every layer
        return {}
    if num_experts == 0:
        raise ModelLoadError(f"{path}: a {arch} model needs num_experts > 0", path)
    layers = raw.get("mlp_only_layers") or []
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        raise ModelLoadError(f"{path}: mlp_only_layers must be a list of ints", path)
    if arch == "mixtral":  # one expert size, top-k renormalised, every layer sparse
        inter = count("intermediate_size")
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=count("num_experts_per_tok"),
            moe_intermediate_size=inter,
            norm_topk_prob=True,
        )
    if arch == "gpt_oss":  # every layer sparse, top-k renormalised, the clamped SwiGLU
        for key in ("swiglu_alpha", "swiglu_limit"):
            _positive_number(path, key, raw[key])
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=count("num_experts_per_tok"),
            moe_intermediate_size=count("intermediate_size"),
            norm_topk_prob=True,
            swiglu_alpha=float(raw["swiglu_alpha"]),
            swiglu_limit=float(raw["swiglu_limit"]),
            mxfp4_experts=_quant_method(raw) == "mxfp4",  # the experts' *_blocks, *_scales
        )
    if arch == "olmoe":  # every layer sparse, experts of intermediate_size
        return dict(
            num_experts=num_experts,
            num_experts_per_tok=count("num_experts_per_tok"),
            moe_intermediate_size=count("intermediate_size"),
            norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        )
    gated_shared = arch in ("qwen2_moe", "qwen3_next")
    shared = count("shared_expert_intermediate_size") if gated_shared else 0
    return dict(
        num_experts=num_experts,
        num_experts_per_tok=count("num_experts_per_tok"),
        moe_intermediate_size=count("moe_intermediate_size"),
        norm_topk_prob=bool(raw.get("norm_topk_prob", defaults.get("norm_topk_prob", False))),
        shared_expert_intermediate_size=shared,
        shared_expert_gate=shared > 0,
        decoder_sparse_step=count("decoder_sparse_step", default=1) or 1,
        mlp_only_layers=tuple(layers),
    )


def _required_int(raw: dict[str, Any], path: Path, key: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(f"{path}: {key} must be a positive int, got {value!r}", path)
    return value


def _optional_int(raw: dict[str, Any], path: Path, key: str, default: int) -> int:
    if raw.get(key) is None:
        return default
    return _required_int(raw, path, key)


def _check_mlp(raw: dict[str, Any], arch: str, path: Path) -> None:
    """The MLP must be SiLU-gated (Gemma 3: tanh-GELU-gated), without bias."""
    if arch == "gemma3":
        if raw.get("hidden_activation") != "gelu_pytorch_tanh":
            raise ModelLoadError(
                f"{path}: unsupported hidden_activation {raw.get('hidden_activation')!r} for "
                "gemma3; only gelu_pytorch_tanh",
                path,
            )
    elif raw.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ModelLoadError(
            f"{path}: unsupported hidden_act {raw['hidden_act']!r}; only silu", path
        )
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{path}: mlp_bias=true is not supported", path)


def _head_dim(
    raw: dict[str, Any], path: Path, defaults: dict[str, Any], hidden: int, heads: int
) -> int:
    """The config's head_dim, else its model type's default, else hidden_size / heads."""
    head_dim = _optional_int(raw, path, "head_dim", defaults.get("head_dim", hidden // heads))
    if "head_dim" not in defaults and raw.get("head_dim") is None and hidden % heads != 0:
        raise ModelLoadError(
            f"{path}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}", path
        )
    return head_dim


def _positive_number(path: Path, key: str, value: Any) -> None:
    if not isinstance(value, int | float) or value <= 0:
        raise ModelLoadError(f"{path}: {key} must be a positive number, got {value!r}", path)


def _special_ids(raw: dict[str, Any], model_dir: Path, path: Path) -> tuple[list[int], list[int]]:
    """``(bos ids, eos ids)``: the config's EOS ids followed by any new ones from
    ``generation_config.json``; BOS from the config, else from the generation config."""
    generation = load_generation_config(model_dir)
    eos = _token_ids(raw.get("eos_token_id"), "eos_token_id", path)
    for token in _token_ids(generation.get("eos_token_id"), "eos_token_id", path.parent):
        if token not in eos:
            eos.append(token)
    bos_ids = _token_ids(
        raw.get("bos_token_id", generation.get("bos_token_id")), "bos_token_id", path
    )
    return bos_ids, eos


def _sliding_layers(
    raw: dict[str, Any], arch: str, path: Path
) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding window, layer types)``, both None when no layer slides."""
    window = _sliding_window(raw, arch)
    layer_types = _layer_types(raw, arch, _required_int(raw, path, "num_hidden_layers"), window)
    if layer_types is not None and "sliding_attention" not in layer_types:
        window, layer_types = None, None  # no layer slides
    return window, layer_types


def _attention_bias(raw: dict[str, Any], arch: str) -> bool:
    """Qwen2's q/k/v always carry a bias (Qwen2-MoE's unless qkv_bias is false); the others
    follow the config (HF modeling code)."""
    return (
        arch == "qwen2"
        or (arch == "qwen2_moe" and bool(raw.get("qkv_bias", True)))
        or bool(raw.get("attention_bias", False))
    )


def _quant_method(raw: dict[str, Any]) -> str | None:
    """The ``quantization_config``'s ``quant_method`` of a config.json, if any."""
    qc = raw.get("quantization_config")
    return qc.get("quant_method") if isinstance(qc, dict) else None


def _gpt_oss_config(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """A gpt-oss config.json with transformers' defaults for the keys it leaves out (its RoPE
    is YaRN with theta 150000 unless it says otherwise)."""
    given = {k: v for k, v in raw.items() if v is not None}
    raw = {**_GPT_OSS_KEYS, **given}
    if "rope_scaling" in given and "rope_parameters" not in given:
        del raw["rope_parameters"]  # transformers 4's layout: rope_scaling and rope_theta
    params = raw.get("rope_parameters") or raw.get("rope_scaling")
    if isinstance(params, dict) and "rope_theta" not in params and "rope_theta" not in raw:
        raw["rope_theta"] = 150000.0
    return raw


def _gemma3_text_config(raw: dict[str, Any], path: Path) -> dict[str, Any]:
    """A Gemma 3 config.json as one flat text config: a multimodal one's ``text_config`` (its
    special ids, dtype and tying from the top level), keys left out at Gemma3TextConfig's
    defaults. Refuses, naming the key, what the attention here does not compute."""
    if raw.get("model_type") == "gemma3" or "text_config" in raw:
        text = raw.get("text_config")
        if not isinstance(text, dict):
            raise ModelLoadError(f"{path}: a multimodal gemma3 config needs a text_config", path)
        top = ("bos_token_id", "eos_token_id", "tie_word_embeddings", "dtype", "torch_dtype")
        raw = {**text, **{k: raw[k] for k in top if raw.get(k) is not None}}
        logger.info("%s: gemma3 with a vision tower: its language model only is run", path)
    raw = {**_HF_DEFAULTS["gemma3"], **raw}
    every = raw["sliding_window_pattern"]
    if not isinstance(every, int) or isinstance(every, bool) or every <= 0:
        raise ModelLoadError(f"{path}: sliding_window_pattern must be a positive int", path)
    refused = {
        "attn_logit_softcapping": "attention logit soft-capping",
        "use_bidirectional_attention": "bidirectional attention",
        "attention_bias": "attention biases",
    }
    for key, what in refused.items():
        if raw.get(key):
            raise ModelLoadError(
                f"{path}: gemma3 with {key}={raw[key]!r} is not supported ({what}: the "
                "attention backends do not compute it)",
                path,
            )
    return raw


def _gemma3(raw: dict[str, Any], arch: str, max_positions: int, path: Path) -> dict[str, Any]:
    """The ``ModelConfig`` Gemma 3 fields of a config.json (``{}`` for other architectures): the
    sliding layers' RoPE (``rope_parameters["sliding_attention"]`` of transformers 5, else
    ``rope_local_base_freq`` unscaled), the score scale and the final soft-capping."""
    if arch != "gemma3":
        return {}
    params = raw.get("rope_parameters")
    local: dict[str, Any] = {"rope_theta": raw["rope_local_base_freq"]}
    if isinstance(params, dict) and isinstance(params.get("sliding_attention"), dict):
        local = {**local, "rope_parameters": params["sliding_attention"]}
    local_theta, local_scaling = _rope(local, max_positions, path)
    scalar, cap = raw["query_pre_attn_scalar"], raw.get("final_logit_softcapping")
    _positive_number(path, "query_pre_attn_scalar", scalar)
    if cap is not None:
        _positive_number(path, "final_logit_softcapping", cap)
    return dict(
        query_pre_attn_scalar=float(scalar),
        rope_local_theta=local_theta,
        rope_local_scaling=local_scaling,
        final_logit_softcapping=None if cap is None else float(cap),
    )


def load_hf_config(model_dir: Path) -> ModelConfig:
    """Parse ``config.json`` (and ``generation_config.json``'s EOS ids) into a ``ModelConfig``.

    Keys a config leaves out take Hugging Face's defaults for its model type. EOS ids are the
    config's followed by any new ones from ``generation_config.json``, without duplicates.
    Raises ``ModelLoadError`` naming the file for a missing or invalid file, an unsupported
    architecture or feature, or inconsistent shapes.
    """
    model_dir = Path(model_dir)
    path = model_dir / "config.json"
    raw = _read_json(path)
    arch = _architecture(raw, path)
    if arch == "gpt_oss":
        raw = _gpt_oss_config(raw, path)
    if arch == "mamba2":
        return _mamba2_config(raw, model_dir, path)
    defaults = _HF_DEFAULTS[arch]
    if arch == "gemma3":
        raw = _gemma3_text_config(raw, path)
    hidden = _required_int(raw, path, "hidden_size")
    heads = _required_int(raw, path, "num_attention_heads")
    _check_mlp(raw, arch, path)
    head_dim = _head_dim(raw, path, defaults, hidden, heads)
    max_positions = _optional_int(
        raw, path, "max_position_embeddings", defaults["max_position_embeddings"]
    )
    rope_theta, rope_scaling = _rope(raw, max_positions, path, arch)
    eps = raw.get("rms_norm_eps", defaults.get("rms_norm_eps", 1e-6))
    _positive_number(path, "rms_norm_eps", eps)
    moe = _moe(raw, arch, path)
    clip = raw.get("clip_qkv") if arch == "olmoe" else None
    if clip is not None:
        _positive_number(path, "clip_qkv", clip)
    bos_ids, eos = _special_ids(raw, model_dir, path)
    window, layer_types = _sliding_layers(raw, arch, path)
    gemma3 = _gemma3(raw, arch, max_positions, path)
    mamba = _hybrid_mamba(raw, arch, path)
    # a type's default where the key is absent (Falcon-H1's 8); null means every head's own
    kv_default = (
        heads if "num_key_value_heads" in raw else defaults.get("num_key_value_heads", heads)
    )
    layers = _required_int(raw, path, "num_hidden_layers")
    linear = qwen3_next_fields(raw, path, layers) if arch == "qwen3_next" else {}
    try:
        return ModelConfig(
            architecture=arch,
            vocab_size=_required_int(raw, path, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_required_int(raw, path, "intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=_optional_int(raw, path, "num_key_value_heads", kv_default),
            head_dim=head_dim,
            max_position_embeddings=max_positions,
            rms_norm_eps=float(eps),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=_attention_bias(raw, arch),
            qk_norm=arch in ("qwen3", "qwen3_moe", "olmoe"),
            qk_norm_over_heads=arch == "olmoe",
            clip_qkv=None if clip is None else float(clip),
            sliding_window=window,
            layer_types=layer_types,
            torch_dtype=_dtype(raw, path),
            bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_ids=eos,
            partial_rotary_factor=_partial_rotary(raw, arch, path),
            **moe,
            **gemma3,
            **mamba,
            **linear,
        )
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}", path) from exc


def _hybrid_mamba(raw: dict[str, Any], arch: str, path: Path) -> dict[str, Any]:
    """A hybrid's Mamba-2 fields (Granite's also its multipliers and experts, Falcon-H1's its
    multipliers and output norm; none for the other families)."""
    if arch not in ("bamba", "granitemoehybrid", "falcon_h1"):
        return {}
    if raw.get("attention_bias"):
        raise ModelLoadError(f"{path}: attention_bias=true is not supported for {arch}", path)
    fields = mamba_fields(raw, arch, path, _required_int(raw, path, "num_hidden_layers"))
    if arch == "granitemoehybrid":
        fields |= granite_fields(raw, path)
    if arch == "falcon_h1":
        fields |= falcon_h1_fields(raw, path)
    return fields


_MAMBA2_CONTEXT = 1 << 18  # a Mamba-2 config.json names no context length


def _mamba2_config(raw: dict[str, Any], model_dir: Path, path: Path) -> ModelConfig:
    """A Mamba-2 ``config.json``: no attention (its attention fields are placeholders)."""
    layers = _required_int(raw, path, "num_hidden_layers")
    eps = raw.get("layer_norm_epsilon", 1e-5)
    _positive_number(path, "layer_norm_epsilon", eps)
    bos_ids, eos = _special_ids(raw, model_dir, path)
    try:
        return ModelConfig(
            architecture="mamba2",
            vocab_size=_required_int(raw, path, "vocab_size"),
            hidden_size=_required_int(raw, path, "hidden_size"),
            intermediate_size=0,
            num_hidden_layers=layers,
            num_attention_heads=1,
            num_key_value_heads=1,
            head_dim=2,
            # no positions: the state carries them (a context limit only where one is given)
            max_position_embeddings=_optional_int(
                raw, path, "max_position_embeddings", _MAMBA2_CONTEXT
            ),
            rms_norm_eps=float(eps),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            torch_dtype=_dtype(raw, path),
            bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_ids=eos,
            **mamba_fields(raw, "mamba2", path, layers),
        )
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}", path) from exc


def _safetensors_files(model_dir: Path) -> list[tuple[Path, set[str] | None]]:
    """The weight files to read, each with the tensor names an index promises it holds."""
    if model_dir.is_file():
        if model_dir.suffix == ".safetensors":
            return [(model_dir, None)]
        if model_dir.suffix in _PICKLE_SUFFIXES:
            raise _pickle_error(model_dir)
        raise ModelLoadError(f"{model_dir}: not a safetensors file", model_dir)
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: no such file or directory", model_dir)
    index_path = model_dir / "model.safetensors.index.json"
    if index_path.is_file():
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index_path}: missing or empty weight_map", index_path)
        shards: dict[str, set[str]] = {}
        for name, shard in weight_map.items():
            shards.setdefault(str(shard), set()).add(str(name))
        files: list[tuple[Path, set[str] | None]] = []
        for shard, names in shards.items():
            shard_path = model_dir / shard
            if not shard_path.is_file():
                raise ModelLoadError(
                    f"{shard_path}: shard named in {index_path.name} does not exist", shard_path
                )
            files.append((shard_path, names))
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [(single, None)]
    found = sorted(model_dir.glob("*.safetensors"))
    if found:
        return [(p, None) for p in found]
    pickles = sorted(p for p in model_dir.iterdir() if p.suffix in _PICKLE_SUFFIXES)
    if pickles:
        raise _pickle_error(pickles[0])
    raise ModelLoadError(f"{model_dir}: no *.safetensors weights found", model_dir)


def _pickle_error(path: Path) -> ModelLoadError:
    return ModelLoadError(
        f"{path}: pickle checkpoints are not loaded (they can run arbitrary code); convert the "
        "model to safetensors, e.g. with transformers: "
        "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)",
        path,
    )


def iter_safetensors_weights(
    model_dir: Path, mapped: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield every ``(name, tensor)`` of the safetensors checkpoint in ``model_dir``, once each.

    ``model_dir`` may also be a single ``.safetensors`` file. Reads, in order of preference, a
    sharded checkpoint (``model.safetensors.index.json``: every shard it names must exist and
    hold the tensors it lists), ``model.safetensors``, or every ``*.safetensors`` in the
    directory. Tensors keep their stored names and dtypes and are read one at a time. Raises
    ``ModelLoadError`` naming the file for a missing shard, a truncated or corrupt file, a
    tensor name found twice, or a directory that holds only pickle checkpoints.

    ``mapped``: each tensor a view of a map of the file (no copy: for a consumer that copies it
    where it goes, as ``load_weights`` does), its pages dropped from this process once the next
    is asked for; its values stay readable after (read from the file again), but what is
    written into it then is lost. Otherwise each tensor is a copy of its own.
    """
    return iter_safetensors_slices(model_dir, lambda name, shape: (name, None), mapped)


# safetensors' dtype names -> torch's, for the tensors read whole with a plain read
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


def _spans(path: Path) -> dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] | None:
    """``name -> (dtype, shape, first byte, end byte)`` of the tensors of the safetensors file at
    ``path`` (already opened, so checked, by ``safe_open``) of the dtypes above; None when the
    header cannot be read so (``safe_open`` reads every tensor then)."""
    try:
        with path.open("rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
    except (OSError, ValueError, struct.error):
        return None
    spans = {}
    for name, info in header.items():
        if name == "__metadata__" or info.get("dtype") not in _SAFETENSORS_DTYPES:
            continue
        first, end = info["data_offsets"]
        spans[name] = (_SAFETENSORS_DTYPES[info["dtype"]], tuple(info["shape"]), 8 + size + first,
                       8 + size + end)  # fmt: skip
    return spans


def _read_whole(
    path: Path, spans: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] | None, name: str
) -> torch.Tensor | None:
    """Tensor ``name`` read from the file straight into a new tensor (the values
    ``safe_open.get_tensor`` gives, without mapping the file: the pages read stay in the page
    cache, not in this process's resident memory, so a load holds one tensor's copy at a time
    besides the model); None where ``spans`` does not place it."""
    span = None if spans is None else spans.get(name)
    if span is None:
        return None
    dtype, shape, first, end = span
    out = torch.empty(shape, dtype=dtype)
    if end - first != out.nbytes:
        return None
    if out.nbytes:
        with path.open("rb", buffering=0) as fh:
            fh.seek(first)
            view = out.reshape(-1).view(torch.uint8).numpy().data
            got = 0
            while got < len(view):
                n = fh.readinto(view[got:])
                if not n:
                    return None
                got += n
    return out


def _mapped_whole(
    region: mmap.mmap | None,
    spans: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] | None,
    name: str,
) -> tuple[torch.Tensor, int, int] | None:
    """Tensor ``name`` as a view of ``region`` (the file's map), with the span of the file it
    covers; None where ``spans`` does not place it or its first byte is not aligned to its
    element size (a view cannot start there)."""
    span = None if spans is None else spans.get(name)
    if span is None or region is None:
        return None
    dtype, shape, first, end = span
    size = torch.empty(0, dtype=dtype).element_size()
    if (
        end > len(region)
        or first % size
        or (end - first) != size * math.prod(shape)
        or end == first
    ):
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8, count=end - first, offset=first)
    return raw.view(dtype).view(shape), first, end


def _drop_pages(region: mmap.mmap, first: int, end: int) -> None:
    """Drop the pages of ``region`` over ``[first, end)`` from this process (read again from
    the file if touched again); nothing where the system has no ``MADV_DONTNEED``."""
    start = first - first % mmap.PAGESIZE
    if hasattr(mmap, "MADV_DONTNEED") and end > start:
        with contextlib.suppress(OSError, ValueError):
            region.madvise(mmap.MADV_DONTNEED, start, end - start)


def _map(path: Path) -> mmap.mmap | None:
    """A private map of the file at ``path`` (written pages copied, never written back); None
    where it cannot be mapped (empty, or the system refuses)."""
    try:
        with path.open("rb") as fh:
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
    except (OSError, ValueError):
        return None


# what to read of one stored tensor, given its name and shape: None to skip it, else the name
# to yield it under and the index of the part to read (None: all of it)
SliceSelector = Callable[[str, tuple[int, ...]], tuple[str, tuple[slice, ...] | None] | None]


def iter_safetensors_slices(
    model_dir: Path, select: SliceSelector, mapped: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """``iter_safetensors_weights``, reading of each tensor only what ``select`` asks for
    (``tensor[index]`` straight from the file, so a process that holds a shard of a model never
    reads the whole of it), under the name it gives; tensors it maps to None are skipped.
    ``mapped``: whole tensors as ``iter_safetensors_weights`` gives them so."""
    model_dir = Path(model_dir)
    seen: set[str] = set()
    for path, expected in _safetensors_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as f:
                spans = _spans(path)
                region = _map(path) if mapped else None
                names = list(f.keys())
                if expected is not None and not expected <= set(names):
                    missing = sorted(expected - set(names))
                    raise ModelLoadError(
                        f"{path}: lacks {len(missing)} tensor(s) the index assigns to it, "
                        f"e.g. {missing[0]!r}",
                        path,
                    )
                for name in names:
                    if name in seen:
                        raise ModelLoadError(f"{path}: tensor {name!r} appears twice", path)
                    seen.add(name)
                    part = f.get_slice(name)
                    chosen = select(name, tuple(part.get_shape()))
                    if chosen is None:
                        continue
                    new_name, index = chosen
                    if index is not None:
                        yield new_name, part[index]
                        continue
                    view = _mapped_whole(region, spans, name)
                    if view is not None and region is not None:
                        yield new_name, view[0]
                        _drop_pages(region, view[1], view[2])
                        continue
                    whole = _read_whole(path, spans, name)
                    yield new_name, f.get_tensor(name) if whole is None else whole
                    del whole
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(
                f"{path}: corrupt or truncated safetensors file: {exc}", path
            ) from exc
