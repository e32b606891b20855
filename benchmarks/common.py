"""Helpers shared by the benchmark scripts: random-weight models and the memory roofline."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from foudre.bench.roofline import machine, measure_bandwidth, weight_bytes

__all__ = [
    "CACHE",
    "MEDIUM",
    "MEDIUM_32K",
    "SMALL",
    "machine",
    "measure_bandwidth",
    "random_llama",
    "weight_bytes",
]

# The "medium" model of ../shared/BASELINES.md: 494.7M parameters.
MEDIUM: dict[str, Any] = dict(
    vocab_size=32000,
    hidden_size=1536,
    intermediate_size=4096,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)
SMALL: dict[str, Any] = dict(
    MEDIUM, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=2048
)
# The medium model with its context raised to 32k tokens by Llama-3.1-style RoPE scaling.
MEDIUM_32K: dict[str, Any] = dict(
    MEDIUM,
    max_position_embeddings=32768,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 4096,
    },
)
CACHE = Path(os.environ.get("FOUDRE_BENCH_CACHE", Path.home() / ".cache" / "foudre-bench"))


def random_llama(name: str = "medium", dtype: torch.dtype = torch.float32) -> Path:
    """A random-weight Llama saved as safetensors (built once with transformers, then cached)."""
    import transformers

    path = CACHE / f"llama-{name}-{str(dtype).removeprefix('torch.')}"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        **{"medium": MEDIUM, "small": SMALL, "medium-32k": MEDIUM_32K}[name]
    )
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path


def with_llama2_tokenizer(model: Path) -> Path:
    """``model`` (a random Llama of vocabulary 32,000) beside the Llama 2 tokenizer that its
    vocabulary stands for: a directory of links to its files plus ``tokenizer.model``, for what
    needs a tokenizer (the server)."""
    out = model.parent / f"{model.name}-llama2-tokenizer"
    if not (out / "tokenizer.model").exists():
        out.mkdir(exist_ok=True)
        for f in model.iterdir():
            if not (out / f.name).exists():
                (out / f.name).symlink_to(f.resolve())
        tok = Path(__file__).resolve().parents[2] / "shared" / "models" / "llama2-tokenizer"
        (out / "tokenizer.model").write_bytes((tok / "tokenizer.model").read_bytes())
    return out
