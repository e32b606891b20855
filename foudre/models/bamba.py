"""Bamba (``BambaForCausalLM``): a hybrid of Mamba-2 mixers and a few attention layers.

Every layer is pre-norm: ``x + mixer(norm(x))`` then ``x + mlp(norm(x))``, where the mixer is a
Mamba-2 mixer (``layers/mamba.py``) in the layers of ``cfg.mamba_layers`` and Llama's attention
(q|k|v fused, RoPE over the first half of each head, paged KV through the attention backend) in
the others (``attn_layer_indices``). ``forward`` takes both caches: the attention layers' paged
KV (one tensor per attention layer, in order) with the backend's metadata, and the Mamba layers'
state pools with the step's ``RecurrentBatch``. The engine holds no recurrent state yet, so
``kv_cache_specs`` refuses (``RecurrentStateNotSupported``), as Mamba-2's does.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from foudre.attention import AttentionBackend
from foudre.attention.cache_spec import FullAttentionSpec
from foudre.layers.mamba import Mamba2Mixer, RecurrentBatch, RecurrentStates, RecurrentStateSpec
from foudre.layers.mlp import GatedMLP
from foudre.layers.moe import SparseMoeBlock
from foudre.layers.norm import RMSNorm
from foudre.layers.rotary import RotaryEmbedding
from foudre.models.config import ModelConfig
from foudre.models.llama import Attention, LlamaForCausalLM, LlamaModel
from foudre.models.mamba2 import RecurrentStateNotSupported, mamba_shape


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

    def mix(self, x: torch.Tensor, positions: torch.Tensor, cache: Any, step: Any) -> torch.Tensor:
        """The mixer's output: ``cache`` is ``(conv, ssm)`` pools for a Mamba layer and ``step``
        its ``RecurrentBatch``; for attention, the layer's KV pages and ``(backend,
        metadata)``."""
        if self.mamba is not None:
            conv, ssm = cache
            return self.mamba(x, conv, ssm, step)
        assert self.self_attn is not None
        backend, metadata = step
        return self.self_attn(positions, x, cache, backend, metadata)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, cache: Any, step: Any
    ) -> torch.Tensor:
        x = x + self.mix(self.input_layernorm(x), positions, cache, step)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


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

    def kv_cache_specs(self) -> list[Any]:
        raise RecurrentStateNotSupported(self.config.architecture)

    def attention_cache_specs(self) -> list[FullAttentionSpec]:
        """Per attention layer, in order, what it keeps per token in the paged cache."""
        attns = [layer.self_attn for layer in self._layers() if layer.self_attn is not None]
        return [FullAttentionSpec(a.num_kv_heads, a.head_dim, a.sliding_window) for a in attns]

    def recurrent_state_specs(self) -> list[RecurrentStateSpec]:
        """Per Mamba layer, in order, what a request keeps."""
        return [m.mamba.shape.state_spec() for m in self._layers() if m.mamba is not None]

    def new_states(self, num_slots: int, device: torch.device | str = "cpu") -> RecurrentStates:
        """State pools of ``num_slots`` requests (the stand-in for the engine's slots)."""
        dtype = self.model.embed_tokens.weight.dtype
        return RecurrentStates(self.recurrent_state_specs(), num_slots, dtype, device)

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        metadata: Any,
        states: RecurrentStates,
        batch: RecurrentBatch,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the flat tokens: the attention layers read
        and write ``kv_caches`` (one per attention layer) through ``backend``, the Mamba layers
        continue each row's state in ``states`` at ``batch.slots``."""
        x = self.embed(input_ids)
        kv = iter(kv_caches)
        mamba = iter(range(len(states.conv)))
        for layer in self._layers():
            if layer.mamba is not None:
                i = next(mamba)
                x = layer(x, positions, (states.conv[i], states.ssm[i]), batch)
            else:
                x = layer(x, positions, next(kv), (backend, metadata))
        return self.model.norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_renamed(weights))


def _renamed(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith("model.final_layernorm."):
            name = "model.norm." + name.removeprefix("model.final_layernorm.")
        yield name, tensor
