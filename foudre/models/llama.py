"""The Llama family (Llama 1-3, Mistral, Qwen2, Qwen3) as one model driven by ``ModelConfig``.

The forward pass takes the flattened new tokens of a whole batch (``[T]`` ids and positions) and
the paged KV cache; attention goes through the backend, so this file knows nothing of blocks.
Projections are fused (q|k|v and gate|up) to halve the matmul calls per layer.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from foudre.layers import fused
from foudre.layers.attention import AttentionBackend
from foudre.layers.linear import Linear
from foudre.layers.norm import RMSNorm
from foudre.layers.rotary import RotaryEmbedding
from foudre.models.config import ModelConfig


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = rotary
        self.scale = self.head_dim**-0.5

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = backend.forward(q, k, v, kv_cache, metadata, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused.enabled(gate_up) and gate_up.dim() == 2:
            return self.down_proj(fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        x = x + self.self_attn(positions, self.input_layernorm(x), kv_cache, backend, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.rotary = rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
        )
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; ``forward`` returns final hidden states for the flat batch."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        x = self.model.embed_tokens(input_ids)
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(positions, x, cache, backend, metadata)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab]`` for the given final hidden states."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters.

        Raises ``ValueError`` naming the tensor for an unexpected name or shape, and for any
        parameter left unloaded, so that a wrong checkpoint never runs with random weights.
        """
        cfg = self.config
        params = dict(self.named_parameters())
        fused = {
            "q_proj": ("qkv_proj", 0, cfg.q_size),
            "k_proj": ("qkv_proj", cfg.q_size, cfg.kv_size),
            "v_proj": ("qkv_proj", cfg.q_size + cfg.kv_size, cfg.kv_size),
            "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
            "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
        }
        loaded: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, start, size = name, 0, -1
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in fused:
                fused_name, start, size = fused[parts[-2]]
                target = ".".join([*parts[:-2], fused_name, parts[-1]])
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            dest = param.data if size < 0 else param.data.narrow(0, start, size)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded[target] = loaded.get(target, 0) + (tensor.shape[0] if size >= 0 else 1)
        for target, param in params.items():
            expected = (
                param.shape[0]
                if target.endswith(("qkv_proj.weight", "qkv_proj.bias", "gate_up_proj.weight"))
                else 1
            )
            if loaded.get(target, 0) != expected:
                raise ValueError(f"weight {target!r} missing from the checkpoint")
