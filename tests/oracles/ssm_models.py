"""Random-weight state-space and hybrid models for the oracle tests (Mamba-2, Bamba, Granite
4.0 hybrids), drawn one way, and the pieces those tests share."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from foudre.attention.base import GroupedMetadata
from foudre.attention.cache_spec import CacheSpec, RecurrentStateSpec
from foudre.layers.mamba import RecurrentBatch


def save_random(family: str, config: dict[str, Any], path: Path, seed: int = 0) -> Path:
    """A random-weight transformers ``{family}ForCausalLM`` of ``config`` saved in ``path``:
    weights large enough that the logits are far from uniform, and the SSM's own parameters
    so that the state matters (dt about 0.3-1, decay per token exp(dt A) about 0.6-0.99: a
    token still moves the logits dozens of tokens later)."""
    import transformers

    torch.manual_seed(seed)
    hf_config = getattr(transformers, f"{family}Config")(**config)
    model = getattr(transformers, f"{family}ForCausalLM")(hf_config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.5).log())
            elif name.endswith("dt_bias"):
                p.uniform_(-1.0, 0.5)
            elif name.endswith(".D"):
                p.uniform_(0.5, 1.5)
            elif p.dim() in (2, 3):
                p.normal_(0.0, 0.08 if "embed" not in name else 1.0)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            else:  # norms
                p.uniform_(0.8, 1.2)
    model.save_pretrained(path, safe_serialization=True)
    return path


def prompt(n: int, seed: int) -> list[int]:
    """``n`` random token ids (3..255) from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 256, (n,), generator=g).tolist()


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    """transformers' float32 logits of every position of ``ids``."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def step_metadata(specs: list[CacheSpec], attention: Any, batch: RecurrentBatch) -> GroupedMetadata:
    """A step's metadata as the runner builds it for a model of these per-layer specs: the
    attention layers read ``attention``, the recurrent layers the ``RecurrentBatch``."""
    of_layer = [1 if isinstance(s, RecurrentStateSpec) else 0 for s in specs]
    return GroupedMetadata([attention, batch], of_layer)
