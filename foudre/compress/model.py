"""foudre's Llama as a plain full-sequence model: build, load, forward. Export as a Hugging Face
directory is ``foudre.loading.writer`` (``save_hf``).

The inference model runs over a paged KV cache; for training and evaluation the same modules
run through ``CausalBackend`` (``foudre/attention/causal.py``), which attends causally
within each row of a ``[B, T]`` batch and keeps no cache. The forward therefore has exactly the
weights and numerics of the served model.
"""

from __future__ import annotations

import math

import torch

from foudre.loading.loader import load_model, load_tokenizer
from foudre.loading.tokenizer import Tokenizer
from foudre.models.causal import causal_hidden
from foudre.models.config import ModelConfig
from foudre.models.llama import LlamaForCausalLM
from foudre.models.registry import build_model


def causal_logits(
    model: LlamaForCausalLM, ids: torch.Tensor, kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """Float32 logits ``[B, T, vocab]``: row ``i``'s token ``t`` sees tokens ``0..t`` of row i."""
    hidden = causal_hidden(model, ids, kv_cache_dtype)
    return model.compute_logits(hidden)


def full_sequence_logits(
    model: LlamaForCausalLM, ids: list[int] | torch.Tensor, kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """Float32 logits ``[T, vocab]`` of one sequence, computed in a single forward."""
    t = torch.as_tensor(ids, dtype=torch.long, device=model.model.embed_tokens.weight.device)
    return causal_logits(model, t.view(1, -1), kv_cache_dtype)[0]


def new_model(cfg: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised float32 model: N(0, 0.02) weights, residual outputs scaled by
    1/sqrt(2 * layers) (GPT-2's rule), unit norms. Deterministic for a given ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    model = build_model(cfg)  # the architecture's class (Phi-3's, not the exact Llama)
    std = 0.02
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
                continue
            scale = (
                std / math.sqrt(2 * cfg.num_hidden_layers)
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else std
            )
            p.copy_(torch.randn(p.shape, generator=generator) * scale)
    return model


def load_trainable(path: str, tokenizer: str | None = None) -> tuple[LlamaForCausalLM, str | None]:
    """Any model foudre loads (HF dir, llama2.c ``.bin``), as float32 on CPU, in train mode;
    with the path of its tokenizer (None when none was found)."""
    loaded = load_model(path, tokenizer, "float32", torch.device("cpu"), None, gguf_dequantize=True)
    loaded.model.train()
    return loaded.model, loaded.tokenizer_path


def load_for_eval(
    path: str, tokenizer: str | None = None, quantization: str | None = None
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """A model foudre loads, as float32 on CPU in eval mode (weights quantized at load when
    ``quantization`` names a method), with its tokenizer."""
    loaded = load_model(path, tokenizer, "float32", torch.device("cpu"), None, None, quantization)
    loaded.model.requires_grad_(False)
    if loaded.tokenizer_path is None:
        raise ValueError(f"{path}: no tokenizer found; pass --tokenizer")
    return loaded.model, load_tokenizer(loaded.tokenizer_path)


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
