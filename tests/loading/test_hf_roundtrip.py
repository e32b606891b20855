"""Checkpoints written by transformers itself: our config and weight names must agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from foudre.loading import iter_safetensors_weights, load_hf_config


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_transformers_checkpoint(tmp_path: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.conftest import make_hf_model

    overrides = {"head_dim": 32} if arch in ("mistral", "qwen3") else {}
    path = make_hf_model(tmp_path / arch, arch, tie_word_embeddings=arch == "qwen2", **overrides)
    config = load_hf_config(path)
    hf = transformers.AutoConfig.from_pretrained(path)
    assert config.architecture == arch
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert config.head_dim == head_dim == (32 if overrides else 16)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.rope_theta == hf.rope_parameters["rope_theta"] and config.rope_scaling is None
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert config.attention_bias == (arch == "qwen2") and config.qk_norm == (arch == "qwen3")
    assert config.eos_token_ids == [2] and config.bos_token_id == 1

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    expected = {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}
    loaded = dict(iter_safetensors_weights(path))
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)
