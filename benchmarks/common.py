"""Helpers shared by the benchmark scripts: random-weight models and the memory roofline."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch

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
CACHE = Path(os.environ.get("FOUDRE_BENCH_CACHE", Path.home() / ".cache" / "foudre-bench"))


def random_llama(name: str = "medium", dtype: torch.dtype = torch.float32) -> Path:
    """A random-weight Llama saved as safetensors (built once with transformers, then cached)."""
    import transformers

    path = CACHE / f"llama-{name}-{str(dtype).removeprefix('torch.')}"
    if (path / "config.json").exists():
        return path
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{"medium": MEDIUM, "small": SMALL}[name])
    model = transformers.LlamaForCausalLM(cfg).to(dtype)
    model.save_pretrained(path, safe_serialization=True)
    return path


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads (the embedding table is gathered, not read)."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name and "lm_head" not in name:
            continue
        total += p.numel() * p.element_size()
    tied_lm_head = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if tied_lm_head:
        emb = next(p for n, p in model.named_parameters() if "embed_tokens" in n)
        total += emb.numel() * emb.element_size()
    return total


def measure_bandwidth(mib: int = 512, repeats: int = 8) -> float:
    """Bytes/s of weight reads by an fp32 matrix-vector product over ``mib`` MiB (> L3 cache)."""
    cols = 4096
    rows = mib * (1 << 20) // (4 * cols)
    w = torch.randn(rows, cols)
    x = torch.randn(cols)
    torch.mv(w, x)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mv(w, x)
        best = min(best, time.perf_counter() - t)
    return w.numel() * 4 / best


def machine() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = torch.get_num_threads()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads"
