"""Shared fixtures: paths to ../shared and random Hugging Face models built from small configs.

The tests run torch on one thread per process (``OMP_NUM_THREADS=1``, inherited by the processes
they start), and pytest-xdist runs two such processes (``-n 2``, one module per worker at a time:
``--dist loadscope``): the tiny models are bound by Python, not by their matrix products, and a
thread pool's barriers on a loaded 2-core host cost several times the work (a check of the CPU
attention kernel over quantized caches: 14.6 CPU-s on two threads, 1.6 on one). Tests of what
does not depend on the thread count set the counts they compare themselves
(``torch.set_num_threads``); set ``OMP_NUM_THREADS`` to run the rest on more."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
STORIES = SHARED / "models" / "stories260K"

os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# fixtures of tests that must stay slow: builds of the kernels for other -march values (4-12 s a
# library on 2 cores, then their checks in fresh processes), Triton's interpreter in subprocesses
SLOW_FIXTURES = frozenset({"march_cache", "interpreted"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``slow`` the tests that use ``SLOW_FIXTURES`` (``-m "not slow"`` leaves them out)."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def march_cache(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``march -> directory``: one kernel cache per ``-march`` for the session, shared by the
    checks of that build (``tests/engine/march.py``'s ``run_built_for``) in every pytest-xdist
    worker (their temporary directories' parent: the builds land atomically)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent

    def cache(march: str) -> Path:
        path = root / f"kernels-{march}"
        path.mkdir(exist_ok=True)
        return path

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
    if arch == "deepseek_v3":  # its keys are expanded per attention head: no KV grouping
        base["num_key_value_heads"] = base["num_attention_heads"]
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
        "deepseek_v3": (transformers.DeepseekV3Config, transformers.DeepseekV3ForCausalLM),
        "gpt_oss": (transformers.GptOssConfig, transformers.GptOssForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    config = cls[0](**base)
    model = cls[1](config).to(torch.float32)
    # random init is tiny; scale up so that logits are far from uniform and greedy is decisive
    # (Gemma multiplies its embeddings by sqrt(hidden): drawn smaller so that its layers count)
    embed_std = base["hidden_size"] ** -0.5 if arch == "gemma3_text" else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() in (2, 3):  # 3-D: the stacked experts of MoE models
                p.normal_(0.0, 0.08 if "embed" not in name else embed_std)
            elif name.endswith(".sinks"):  # gpt-oss's attention sinks: large enough to matter
                p.normal_(0.0, 1.0)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            else:  # norms
                p.uniform_(0.8, 1.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's selection bias
                b.normal_(0.0, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture
def hf_llama(tmp_path: Path) -> Path:
    return make_hf_model(tmp_path / "llama", "llama")
