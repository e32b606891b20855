"""Qwen3-Next (``Qwen3NextForCausalLM``): gated DeltaNet layers with a gated attention layer every
few (``full_attention_interval``), and a mixture of experts with a gated shared expert in every
sparse layer.

Every layer is pre-norm, ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``, every RMSNorm
zero-centred (``(1 + weight) * x / rms(x)``: ``OffsetRMSNorm``). The mixer is either

- a gated DeltaNet (``layers/gated_deltanet.py``) in the layers of ``cfg.linear_layers``: a
  state slot per request (``RecurrentStateSpec``), or
- gated attention: q (with an output gate per head) | k | v, q and k zero-centred RMSNorms per
  head, RoPE over the first ``partial_rotary_factor`` of each head, paged KV through the
  backend, the output times ``sigmoid(gate)`` before ``o_proj``.

The MLP is ``layers/moe.SparseMoeBlock`` (softmax top-k, renormalised when
``norm_topk_prob``, plus ``sigmoid(shared_expert_gate(x)) * shared_expert(x)``: Qwen2-MoE's
variant), or a dense gated MLP in ``mlp_only_layers``. ``forward`` is Llama's: layer ``i`` gets
its cache (KV pages or ``RecurrentCache``) and ``metadata.for_layer(i)``.

Checkpoint names are transformers'; ``q_proj`` (per head: query rows, then gate rows) is split
into our fused ``qkv_proj``'s query and ``output_gate``. The multi-token-prediction weights
(``mtp.*``) are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Any, cast

import torch
from torch import nn

from foudre.attention import AttentionBackend
from foudre.attention.cache_spec import CacheSpec, FullAttentionSpec
from foudre.layers import fused
from foudre.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetShape
from foudre.layers.linear import Linear
from foudre.layers.mlp import GatedMLP
from foudre.layers.moe import SparseMoeBlock
from foudre.layers.norm import OffsetRMSNorm
from foudre.layers.rotary import RotaryEmbedding
from foudre.models.config import ModelConfig
from foudre.models.llama import (
    Attention,
    DecodeParts,
    LlamaForCausalLM,
    LlamaModel,
    sparse_block,
)

logger = logging.getLogger(__name__)


def deltanet_shape(cfg: ModelConfig) -> GatedDeltaNetShape:
    """The gated DeltaNet's sizes in ``cfg``."""
    return GatedDeltaNetShape(
        hidden_size=cfg.hidden_size,
        num_k_heads=cfg.linear_num_key_heads,
        num_v_heads=cfg.linear_num_value_heads,
        key_head_dim=cfg.linear_key_head_dim,
        value_head_dim=cfg.linear_value_head_dim,
        conv_kernel=cfg.linear_conv_kernel,
        eps=cfg.rms_norm_eps,
    )


class GatedAttention(nn.Module):
    """Attention whose output is gated per channel by ``sigmoid(output_gate(x))``, with
    zero-centred q/k norms per head and (partial) RoPE."""

    # (what the native decode step reads of an attention layer: it attends to every key, and
    # no sinks join the softmax)
    sliding_window: int | None = None
    sinks: torch.Tensor | None = None

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.output_gate = Linear(cfg.hidden_size, self.q_size, bias=False)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
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
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        o = backend.forward(q, k, v, kv_cache, metadata, self.scale)
        o = o.reshape(t, self.q_size)
        gate = self.output_gate(x)
        if fused.enabled(o, gate):  # (the C++ the native decode step runs: the same bits)
            return self.o_proj(fused.sigmoid_gate(o, gate))
        return self.o_proj(o * torch.sigmoid(gate))


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.linear_attn: GatedDeltaNet | None = None
        self.self_attn: GatedAttention | None = None
        if index in cfg.linear_layers:
            self.linear_attn = GatedDeltaNet(deltanet_shape(cfg))
        else:
            self.self_attn = GatedAttention(cfg, rotary)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: SparseMoeBlock | GatedMLP
        if cfg.is_sparse_layer(index):
            self.mlp = sparse_block(cfg)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def decode_parts(self) -> DecodeParts:
        """A pre-norm mixer (gated DeltaNet, or gated attention with partial RoPE), then a
        pre-norm MLP (experts with a gated shared expert, or dense), every norm ``(1 + w)``."""
        attn = self.self_attn
        return DecodeParts(
            self.input_layernorm,
            cast("Attention | None", attn),
            None,
            self.post_attention_layernorm,
            self.mlp,
            rope=attn is not None,
            offset=True,
            deltanet=self.linear_attn,
            output_gate=None if attn is None else attn.output_gate,
        )

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cache: Any,
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        """``cache`` and ``metadata``: the layer's ``RecurrentCache`` and the step's
        ``RecurrentBatch`` for a DeltaNet layer; its KV pages and the backend's metadata for
        attention."""
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            h = self.linear_attn(h, cache, metadata)
        else:
            assert self.self_attn is not None
            h = self.self_attn(positions, h, cache, backend, metadata)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3NextModel(LlamaModel):
    layer_class = Qwen3NextDecoderLayer
    norm_class = OffsetRMSNorm


class Qwen3NextForCausalLM(LlamaForCausalLM):
    """Qwen3-Next's decoder; Llama's interface where it does not differ (embedding, logits, the
    experts' weight loading)."""

    model_class: type[LlamaModel] = Qwen3NextModel

    def _layers(self) -> list[Qwen3NextDecoderLayer]:
        return [cast(Qwen3NextDecoderLayer, layer) for layer in self.model.layers]

    def set_tensor_parallel(self, tp: Any, vocab_size: int) -> None:
        raise NotImplementedError("Qwen3-Next does not run tensor-parallel yet")

    def kv_cache_specs(self) -> list[CacheSpec]:
        """Per layer: K and V per token for attention, a state slot per request for DeltaNet."""
        specs: list[CacheSpec] = []
        for layer in self._layers():
            if layer.linear_attn is not None:
                specs.append(layer.linear_attn.shape.state_spec())
            else:
                a = layer.self_attn
                assert a is not None
                specs.append(FullAttentionSpec(a.num_kv_heads, a.head_dim))
        return specs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named tensors, as ``LlamaForCausalLM.load_weights`` checks them, after
        splitting each ``q_proj`` into query and output gate and skipping ``mtp.*``."""
        super().load_weights(self._renamed(weights))

    def _renamed(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        skipped = 0
        for name, tensor in weights:
            if name.startswith("mtp."):
                skipped += 1  # multi-token prediction: not run here
                continue
            if name.endswith(".self_attn.q_proj.weight"):
                heads, dim = cfg.num_attention_heads, cfg.head_dim
                if tuple(tensor.shape[:1]) != (2 * heads * dim,):
                    raise ValueError(
                        f"weight {name!r} has shape {tuple(tensor.shape)}, expected "
                        f"({2 * heads * dim}, {cfg.hidden_size}) (query and gate per head)"
                    )
                per_head = tensor.reshape(heads, 2, dim, -1)
                yield name, per_head[:, 0].reshape(heads * dim, -1)
                gate = name.removesuffix("q_proj.weight") + "output_gate.weight"
                yield gate, per_head[:, 1].reshape(heads * dim, -1)
                continue
            yield name, tensor
        if skipped:
            logger.info("skipped %d multi-token-prediction tensor(s) of the checkpoint", skipped)
