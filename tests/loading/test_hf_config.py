"""config.json parsing for each supported architecture, and its failures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from foudre.loading import ModelLoadError, load_generation_config, load_hf_config
from foudre.models.config import ModelConfig

BASE: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
}


def _write(tmp_path: Path, name: str, data: Any) -> Path:
    (tmp_path / name).write_text(json.dumps(data))
    return tmp_path


def test_llama_defaults(tmp_path: Path) -> None:
    config = load_hf_config(_write(tmp_path, "config.json", {**BASE, "model_type": "llama"}))
    assert config.architecture == "llama"
    assert config.head_dim == 32 and config.num_key_value_heads == 8
    assert config.max_position_embeddings == 2048 and config.rms_norm_eps == 1e-6
    assert config.rope_theta == 10000.0 and config.rope_scaling is None
    assert not config.tie_word_embeddings and not config.attention_bias and not config.qk_norm
    assert config.torch_dtype == "float32" and config.eos_token_ids == []


def test_llama3_gqa_rope_scaling_and_eos_merge(tmp_path: Path) -> None:
    raw = {
        **BASE,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_key_value_heads": 2,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": True,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
    }
    _write(tmp_path, "config.json", raw)
    _write(tmp_path, "generation_config.json", {"eos_token_id": [128001, 128008, 128009]})
    config = load_hf_config(tmp_path)
    assert config.num_key_value_heads == 2 and config.head_dim == 32
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    assert config.torch_dtype == "bfloat16" and config.tie_word_embeddings
    assert config.bos_token_id == 128000
    assert config.eos_token_ids == [128001, 128008, 128009]


def test_transformers5_rope_parameters_and_dtype_key(tmp_path: Path) -> None:
    raw = {
        **BASE,
        "model_type": "llama",
        "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
        "dtype": "float16",
    }
    config = load_hf_config(_write(tmp_path, "config.json", raw))
    assert config.rope_theta == 1e6
    assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert config.torch_dtype == "float16"
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5e5}
    config = load_hf_config(_write(tmp_path, "config.json", raw))
    assert config.rope_theta == 5e5 and config.rope_scaling is None


def test_legacy_rope_scaling_type_key(tmp_path: Path) -> None:
    raw = {**BASE, "model_type": "llama", "rope_scaling": {"type": "dynamic", "factor": 2.0}}
    config = load_hf_config(_write(tmp_path, "config.json", raw))
    assert config.rope_scaling == {"rope_type": "dynamic", "factor": 2.0}


def test_mistral(tmp_path: Path) -> None:
    raw = {**BASE, "model_type": "mistral", "num_key_value_heads": 4, "head_dim": 64}
    config = load_hf_config(_write(tmp_path, "config.json", raw))
    assert config.architecture == "mistral" and config.head_dim == 64
    assert config.q_size == 512 and config.kv_size == 256
    assert config.max_position_embeddings == 4096 * 32


def test_qwen2_has_qkv_bias(tmp_path: Path) -> None:
    raw = {**BASE, "model_type": "qwen2", "num_key_value_heads": 2, "eos_token_id": 151645}
    config = load_hf_config(_write(tmp_path, "config.json", raw))
    assert config.attention_bias and not config.qk_norm and not config.tie_word_embeddings
    assert config.eos_token_ids == [151645] and config.bos_token_id is None
    raw["tie_word_embeddings"] = True
    assert load_hf_config(_write(tmp_path, "config.json", raw)).tie_word_embeddings


def test_qwen3_qk_norm_and_head_dim(tmp_path: Path) -> None:
    raw = {**BASE, "model_type": "qwen3", "num_key_value_heads": 4, "head_dim": 64}
    config = load_hf_config(_write(tmp_path, "config.json", raw))
    assert config.qk_norm and not config.attention_bias and config.head_dim == 64
    raw = {**BASE, "model_type": "qwen3", "attention_bias": True}
    config = load_hf_config(_write(tmp_path, "config.json", raw))
    assert config.attention_bias and config.head_dim == 128  # HF's Qwen3 default


def test_architecture_from_architectures_list(tmp_path: Path) -> None:
    raw = {**BASE, "architectures": ["Qwen2ForCausalLM"]}
    assert load_hf_config(_write(tmp_path, "config.json", raw)).architecture == "qwen2"


def test_unknown_architecture(tmp_path: Path) -> None:
    raw = {**BASE, "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ModelLoadError) as exc:
        load_hf_config(_write(tmp_path, "config.json", raw))
    message = str(exc.value)
    assert "config.json" in message and "gpt2" in message and "qwen3" in message


def test_missing_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config.json.*not found"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"config.json.*invalid JSON"):
        load_hf_config(tmp_path)


def test_bad_values(tmp_path: Path) -> None:
    cases: list[dict[str, Any]] = [
        {**BASE, "model_type": "llama", "hidden_size": "256"},
        {**BASE, "model_type": "llama", "num_key_value_heads": 3},
        {**BASE, "model_type": "llama", "hidden_act": "gelu"},
        {**BASE, "model_type": "llama", "torch_dtype": "int8"},
        {**BASE, "model_type": "llama", "eos_token_id": "2"},
        {k: v for k, v in BASE.items() if k != "vocab_size"} | {"model_type": "llama"},
    ]
    for raw in cases:
        with pytest.raises(ModelLoadError, match=r"config.json"):
            load_hf_config(_write(tmp_path, "config.json", raw))


def test_generation_config(tmp_path: Path) -> None:
    assert load_generation_config(tmp_path) == {}
    _write(tmp_path, "generation_config.json", {"temperature": 0.6})
    assert load_generation_config(tmp_path) == {"temperature": 0.6}
    (tmp_path / "generation_config.json").write_text("[")
    with pytest.raises(ModelLoadError, match=r"generation_config.json"):
        load_generation_config(tmp_path)


def test_every_supported_architecture_has_a_model_class() -> None:
    from foudre.models.config import SUPPORTED_ARCHITECTURES
    from foudre.models.registry import MODEL_CLASSES, model_class

    assert set(MODEL_CLASSES) == set(SUPPORTED_ARCHITECTURES)
    cfg = ModelConfig("llama", 32, 16, 32, 1, 2, 2, 8)
    cfg.architecture = "no-such-family"  # past __post_init__'s check, as a stale config would be
    with pytest.raises(ValueError, match="no-such-family"):
        model_class(cfg)
