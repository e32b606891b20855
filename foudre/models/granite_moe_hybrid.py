"""Granite 4.0 hybrids (``GraniteMoeHybridForCausalLM``): Bamba's layout of Mamba-2 mixers and
attention layers (``models/bamba.py``, whose forward and caches it shares) with Granite's
differences:

- the MLP of every layer is a mixture of experts (``layers/moe.SparseMoeBlock``: softmax over
  the top-k router logits) plus a shared MLP every token goes through, or that shared MLP alone
  where ``num_local_experts`` is 0;
- embeddings times ``embedding_multiplier``; each sublayer's output times
  ``residual_multiplier`` before its residual add; attention scores scaled by
  ``attention_multiplier``; logits divided by ``logits_scaling``;
- attention with RoPE over whole heads (``position_embedding_type: rope``) or with no positions
  at all (NoPE, the default).

Checkpoint names: ``block_sparse_moe.router.layer`` is the router ``gate``,
``block_sparse_moe.input_linear`` / ``output_linear`` the stacked experts' ``gate_up_proj`` /
``down_proj``, ``shared_mlp.input_linear`` / ``output_linear`` the shared MLP's.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from foudre.attention import AttentionBackend
from foudre.layers.mamba import Mamba2Mixer
from foudre.layers.mlp import GatedMLP
from foudre.layers.moe import SparseMoeBlock
from foudre.layers.norm import RMSNorm
from foudre.layers.rotary import RotaryEmbedding
from foudre.models.bamba import BambaDecoderLayer, BambaForCausalLM
from foudre.models.config import ModelConfig
from foudre.models.llama import Attention, DecodeParts, LlamaModel
from foudre.models.mamba2 import mamba_shape


class GraniteAttention(Attention):
    """Llama's attention scaled by ``attention_multiplier``, with or without RoPE."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__(cfg, rotary, index)
        if cfg.attention_multiplier is not None:
            self.scale = cfg.attention_multiplier
        self.use_rope = cfg.use_rope

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
        if self.use_rope:
            q, k = self.rotary(positions, q, k)
        o = backend.forward(q, k, v, kv_cache, metadata, self.scale, window=self.sliding_window)
        return self.o_proj(o.reshape(t, self.q_size))


class GraniteMoeHybridDecoderLayer(BambaDecoderLayer):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        nn.Module.__init__(self)  # Bamba's mixer choice, Granite's MLP and multiplier
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: Attention | None = None
        if index in cfg.mamba_layers:
            self.mamba = Mamba2Mixer(mamba_shape(cfg))
        else:
            self.self_attn = GraniteAttention(cfg, rotary, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # the experts with the shared MLP inside (named ``mlp`` as Llama's, which is where
        # Llama's loader puts ``block_sparse_moe``), or the shared MLP alone
        self.mlp: SparseMoeBlock | GatedMLP
        if cfg.num_experts:
            self.mlp = SparseMoeBlock(
                cfg.hidden_size,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                cfg.moe_intermediate_size,
                renormalize=True,
                shared_intermediate_size=cfg.shared_expert_intermediate_size,
            )
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cache: Any,
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        m = self.residual_multiplier
        x = x + self.mix(positions, self.input_layernorm(x), cache, backend, metadata) * m
        return x + self.mlp(self.post_attention_layernorm(x)) * m

    def decode_parts(self) -> DecodeParts:
        """Bamba's, both sublayers' outputs times ``residual_multiplier``, RoPE or none."""
        attn = self.self_attn
        rope = isinstance(attn, GraniteAttention) and attn.use_rope
        return DecodeParts(
            self.input_layernorm, attn, self.mamba, self.post_attention_layernorm, self.mlp,
            self.residual_multiplier, rope,
        )  # fmt: skip


class GraniteMoeHybridModel(LlamaModel):
    layer_class = GraniteMoeHybridDecoderLayer

    def make_rotary(self, cfg: ModelConfig, max_positions: int) -> None:
        """No table worth its memory without RoPE (NoPE, the default: a GGUF may claim a
        context of 2^20 positions)."""
        super().make_rotary(cfg, max_positions if cfg.use_rope else 1)


class GraniteMoeHybridForCausalLM(BambaForCausalLM):
    """Granite 4.0's hybrid decoder: Bamba's forward and caches, Granite's layers."""

    model_class = GraniteMoeHybridModel

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().embed(input_ids) * self.config.embedding_multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return super().compute_logits(hidden) / self.config.logits_scaling

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        layers = self._layers()
        return {
            i: layer.mlp
            for i, layer in enumerate(layers)
            if isinstance(layer, GraniteMoeHybridDecoderLayer)
            and isinstance(layer.mlp, SparseMoeBlock)
        }

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_granite_names(weights, self.config.num_experts > 0))


def _granite_names(
    weights: Iterable[tuple[str, torch.Tensor]], experts: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    shared = "mlp.shared_expert" if experts else "mlp"
    renames = {
        "block_sparse_moe.router.layer.weight": "mlp.gate.weight",
        "block_sparse_moe.input_linear.weight": "mlp.experts.gate_up_proj",
        "block_sparse_moe.output_linear.weight": "mlp.experts.down_proj",
        "shared_mlp.input_linear.weight": f"{shared}.gate_up_proj.weight",
        "shared_mlp.output_linear.weight": f"{shared}.down_proj.weight",
    }
    for name, tensor in weights:
        head, _, tail = name.partition(".layers.")
        index, _, rest = tail.partition(".")
        if rest in renames:
            name = f"{head}.layers.{index}.{renames[rest]}"
        yield name, tensor
