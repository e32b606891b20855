"""Bamba (``BambaForCausalLM``): a hybrid of Mamba-2 mixers and a few attention layers.

Every layer is pre-norm: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``, where the mixer is a
Mamba-2 mixer (``layers/mamba.py``) in the layers of ``cfg.mamba_layers`` and Llama's attention
(q|k|v fused, RoPE over the first half of each head, paged KV through the attention backend) in
the others (``attn_layer_indices``). ``forward`` takes both caches: the attention layers' paged
KV (one tensor per attention layer, in order) with the backend's metadata, and the Mamba layers'
state pools with the step's ``RecurrentBatch``: ``kv_cache_specs`` lists a ``FullAttentionSpec``
for each attention layer and a ``RecurrentStateSpec`` for each Mamba layer, and the runner hands
layer ``i`` its cache (KV pages or ``RecurrentCache``) and ``metadata.for_layer(i)`` (the
attention metadata of its cache group, or the ``RecurrentBatch``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from foudre.attention import AttentionBackend
from foudre.attention.cache_spec import CacheSpec, FullAttentionSpec
from foudre.layers.mamba import Mamba2Mixer
from foudre.layers.mlp import GatedMLP
from foudre.layers.moe import SparseMoeBlock
from foudre.layers.norm import RMSNorm
from foudre.layers.rotary import RotaryEmbedding
from foudre.models.config import ModelConfig
from foudre.models.llama import Attention, DecodeParts, LlamaForCausalLM, LlamaModel
from foudre.models.mamba2 import mamba_shape


class BambaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mamba: Mamba2Mixer | None = None
        self.self_attn: Attention | None = None
        if index in cfg.mamba_layers:
            self.mamba = Mamba2Mixer(mamba_shape(cfg))
        else:
            self.self_attn = Attention(cfg, rotary, index)
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def mix(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cache: Any,
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        """The mixer's output: ``cache`` is the layer's ``RecurrentCache`` and ``metadata`` the
        step's ``RecurrentBatch`` for a Mamba layer; its KV pages and the backend's metadata
        for attention."""
        if self.mamba is not None:
            return self.mamba(x, cache, metadata)
        assert self.self_attn is not None
        return self.self_attn(positions, x, cache, backend, metadata)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cache: Any,
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        x = x + self.mix(positions, self.input_layernorm(x), cache, backend, metadata)
        return x + self.feed_forward(self.pre_ff_layernorm(x))

    def decode_parts(self) -> DecodeParts:
        """A pre-norm mixer (Mamba-2, or attention with RoPE), then a pre-norm MLP."""
        return DecodeParts(
            self.input_layernorm, self.self_attn, self.mamba, self.pre_ff_layernorm,
            self.feed_forward, rope=self.self_attn is not None,
        )  # fmt: skip


class BambaModel(LlamaModel):
    layer_class = BambaDecoderLayer


class BambaForCausalLM(LlamaForCausalLM):
    """Bamba's decoder; Llama's interface where it does not differ (embedding, logits, weight
    loading: the checkpoint's ``q/k/v_proj`` and ``gate/up_proj`` go into the fused
    parameters, ``model.final_layernorm`` is our ``model.norm``)."""

    model_class: type[LlamaModel] = BambaModel

    def _layers(self) -> list[BambaDecoderLayer]:
        return [layer for layer in self.model.layers if isinstance(layer, BambaDecoderLayer)]

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        """None: Bamba's MLPs are dense."""
        return {}

    def kv_cache_specs(self) -> list[CacheSpec]:
        """Per layer: K and V per token for attention, a state slot per request for Mamba."""
        specs: list[CacheSpec] = []
        for layer in self._layers():
            if layer.mamba is not None:
                specs.append(layer.mamba.shape.state_spec())
            else:
                a = layer.self_attn
                assert a is not None
                specs.append(FullAttentionSpec(a.num_kv_heads, a.head_dim, a.sliding_window))
        return specs

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(bamba_names(weights))


def bamba_names(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's ``model.final_layernorm`` is our ``model.norm`` (Bamba, Falcon-H1)."""
    for name, tensor in weights:
        if name.startswith("model.final_layernorm."):
            name = "model.norm." + name.removeprefix("model.final_layernorm.")
        yield name, tensor
