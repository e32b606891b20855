"""Falcon-H1 (``FalconH1ForCausalLM``): every decoder layer runs attention and a Mamba-2 mixer
side by side on the same normed input, then a gated MLP::

    h = norm(x)
    x = x + ssm_out * mamba(ssm_in * h) + attn_out * attention(attn_in * h)
    x = x + down_mult * mlp(norm(x))                 (the MLP's gate times gate_mult)

with muP multipliers throughout (``ModelConfig``'s Falcon-H1 block): the embeddings and the
logits are scaled, the mixer's in_proj output is scaled per section (z, x, B, C, dt), and the
keys are scaled (here folded into the attention's score scale: ``q . (m k) = m (q . k)``).
The mixer is ``layers/mamba.Mamba2Mixer`` (its output gate normed after or before the gate, or
not at all: ``mamba_gate_norm``), the attention Llama's (q|k|v fused, RoPE, paged KV).

Caches: a layer holds both a paged KV cache and a recurrent state, so ``kv_cache_specs`` lists
two entries per decoder layer, interleaved: entry ``2 i`` is layer ``i``'s attention
(``FullAttentionSpec``), entry ``2 i + 1`` its mixer's state (``RecurrentStateSpec``). The
runner hands cache ``j`` and ``metadata.for_layer(j)`` for each entry as for any model, and
``forward_layers`` gives decoder layer ``i`` both: ``kv_caches[2 i]`` with the attention
metadata ``for_layer(2 i)``, and ``kv_caches[2 i + 1]`` with the step's ``RecurrentBatch``
``for_layer(2 i + 1)``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from foudre.attention import AttentionBackend
from foudre.attention.base import GroupedMetadata
from foudre.attention.cache_spec import CacheSpec, FullAttentionSpec
from foudre.layers import fused
from foudre.layers.mamba import Mamba2Mixer, Mamba2Shape
from foudre.layers.mlp import GatedMLP
from foudre.layers.moe import SparseMoeBlock
from foudre.layers.norm import RMSNorm
from foudre.layers.rotary import RotaryEmbedding
from foudre.models.bamba import bamba_names
from foudre.models.config import ModelConfig
from foudre.models.llama import Attention, DecodeParts, LlamaForCausalLM, LlamaModel
from foudre.models.mamba2 import mamba_shape


class FalconH1Mixer(Mamba2Mixer):
    """The Mamba-2 mixer with Falcon-H1's input multiplier and its per-section multipliers of
    in_proj's output (transformers' ``mup_vector``: z, x, B, C, dt)."""

    def __init__(self, shape: Mamba2Shape, in_multiplier: float, sections: tuple[float, ...]):
        super().__init__(shape)
        self.in_multiplier = in_multiplier
        inner, bc = shape.intermediate_size, shape.n_groups * shape.state_size
        bounds = [0, inner, 2 * inner, 2 * inner + bc, 2 * inner + 2 * bc, shape.projection_size]
        # the sections whose multiplier is not 1: (first, end, multiplier)
        self.sections = [(bounds[i], bounds[i + 1], m) for i, m in enumerate(sections) if m != 1.0]

    def project(self, x: torch.Tensor) -> torch.Tensor:
        if self.in_multiplier != 1.0:
            x = x * self.in_multiplier
        out = self.in_proj(x)
        for lo, hi, m in self.sections:
            out[..., lo:hi] *= m
        return out


class FalconH1MLP(GatedMLP):
    """``down_mult * down_proj(silu(gate_mult * gate) * up)``: on the CPU the gate scaled in
    place and ``fused.silu_mul`` (``GatedMLP``'s kernel, which the native decode step runs)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size)
        self.gate_multiplier, self.down_multiplier = cfg.mlp_multipliers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused.enabled(gate_up) and gate_up.dim() == 2:
            if self.gate_multiplier != 1.0:
                gate_up[:, : self.intermediate_size] *= self.gate_multiplier
            act = fused.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            act = up * F.silu(gate * self.gate_multiplier)
        return self.down_proj(act) * self.down_multiplier


def falcon_mixer(cfg: ModelConfig) -> FalconH1Mixer:
    shape = dataclasses.replace(
        mamba_shape(cfg), out_proj_bias=cfg.mamba_out_proj_bias, gate_norm=cfg.mamba_gate_norm
    )
    return FalconH1Mixer(shape, cfg.ssm_in_multiplier, cfg.ssm_multipliers)


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mamba = falcon_mixer(cfg)
        self.self_attn = Attention(cfg, rotary, index)
        self.self_attn.scale *= cfg.key_multiplier  # the keys' multiplier, on the scores
        self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.feed_forward = FalconH1MLP(cfg)
        self.attn_in, self.attn_out = cfg.attention_in_multiplier, cfg.attention_out_multiplier
        self.ssm_out = cfg.ssm_out_multiplier

    def decode_parts(self) -> DecodeParts | None:
        """Both mixers on the one normed input, each with its multipliers (the keys' folded into
        the attention's scale), then the pre-norm MLP with its own (None where the mixer or the
        MLP was replaced by another kind)."""
        mlp, mixer = self.feed_forward, self.mamba
        if not isinstance(mlp, FalconH1MLP) or not isinstance(mixer, FalconH1Mixer):
            return None
        return DecodeParts(
            self.input_layernorm, self.self_attn, mixer, self.pre_ff_layernorm, mlp,
            parallel=True,
            attn_multipliers=(self.attn_in, self.attn_out),
            mamba_multipliers=(mixer.in_multiplier, self.ssm_out),
            mamba_sections=tuple(mixer.sections),
            mlp_multipliers=(mlp.gate_multiplier, mlp.down_multiplier),
        )  # fmt: skip

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        caches: tuple[Any, Any],
        backend: AttentionBackend,
        metadata: tuple[Any, Any],
    ) -> torch.Tensor:
        """``caches``: the layer's KV pages and its ``RecurrentCache``; ``metadata``: the
        attention metadata and the step's ``RecurrentBatch``."""
        (kv, state), (attn_meta, batch) = caches, metadata
        h = self.input_layernorm(x)
        mixed = self.mamba(h, state, batch) * self.ssm_out
        attn = self.self_attn(positions, h * self.attn_in, kv, backend, attn_meta)
        x = x + (mixed + attn * self.attn_out)
        return x + self.feed_forward(self.pre_ff_layernorm(x))


class FalconH1Model(LlamaModel):
    layer_class = FalconH1DecoderLayer


class FalconH1ForCausalLM(LlamaForCausalLM):
    """Falcon-H1's decoder; Llama's interface where it does not differ (weight loading: the
    checkpoint's ``q/k/v_proj`` and ``gate/up_proj`` go into the fused parameters,
    ``model.final_layernorm`` is our ``model.norm``). Two cache entries per decoder layer,
    attention at even indices and the Mamba state at odd ones (see the module docstring)."""

    model_class: type[LlamaModel] = FalconH1Model

    def _layers(self) -> list[FalconH1DecoderLayer]:
        return [cast(FalconH1DecoderLayer, layer) for layer in self.model.layers]

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        """None: Falcon-H1's MLPs are dense."""
        return {}

    def kv_cache_specs(self) -> list[CacheSpec]:
        """Per decoder layer ``i``: entry ``2 i`` its attention's K and V per token, entry
        ``2 i + 1`` its mixer's state slot per request."""
        specs: list[CacheSpec] = []
        for layer in self._layers():
            a = layer.self_attn
            specs.append(FullAttentionSpec(a.num_kv_heads, a.head_dim, a.sliding_window))
            specs.append(layer.mamba.shape.state_spec())
        return specs

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        m = self.config.embedding_multiplier
        return x * m if m != 1.0 else x

    def forward_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[Any],
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        """The decoder layers; ``metadata`` is a ``GroupedMetadata`` over the two entries per
        layer (the attention's metadata, the step's ``RecurrentBatch``)."""
        layers = self._layers()
        if not isinstance(metadata, GroupedMetadata) or len(kv_caches) != 2 * len(layers):
            raise TypeError(
                "FalconH1ForCausalLM takes two caches per layer (KV pages, recurrent state) "
                "and a GroupedMetadata naming each one's metadata"
            )
        for i, layer in enumerate(layers):
            caches = (kv_caches[2 * i], kv_caches[2 * i + 1])
            meta = (metadata.for_layer(2 * i), metadata.for_layer(2 * i + 1))
            x = layer(positions, x, caches, backend, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        m = self.config.lm_head_multiplier
        return logits * m if m != 1.0 else logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(bamba_names(weights))
