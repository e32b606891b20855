"""Fixtures shared by the quantization tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import make_hf_model


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random HF Llama wide enough (256) for K-quant blocks, GQA 4:2."""
    return make_hf_model(
        tmp_path_factory.mktemp("llama"),
        "llama",
        vocab_size=384,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
