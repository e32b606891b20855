"""Shared fixtures: paths to ../shared and random Hugging Face models built from small configs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"


@pytest.fixture(scope="session")
def march_cache(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``march -> directory``: one kernel cache per ``-march`` for the session, shared by the
    checks of that build (``tests/engine/march.py``'s ``run_built_for``)."""
    dirs: dict[str, Path] = {}

    def cache(march: str) -> Path:
        if march not in dirs:
            dirs[march] = tmp_path_factory.mktemp(f"kernels-{march}")
        return dirs[march]

    return cache


@pytest.fixture(scope="session")
def stories_paths() -> tuple[str, str]:
    model, tok = STORIES / "stories260K.bin", STORIES / "tok512.bin"
    if not model.exists():
        pytest.skip("../shared/models/stories260K is not present")
    return str(model), str(tok)


def make_hf_model(path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Write a random-weight HF model of ``arch`` (float32 safetensors) into ``path``."""
    import transformers

    base: dict[str, Any] = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(overrides)
    cls = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    config = cls[0](**base)
    model = cls[1](config).to(torch.float32)
    # random init is tiny; scale up so that logits are far from uniform and greedy is decisive
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() in (2, 3):  # 3-D: the stacked experts of MoE models
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            else:  # norms
                p.uniform_(0.8, 1.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def hf_llama(tmp_path: Path) -> Path:
    return make_hf_model(tmp_path / "llama", "llama")
