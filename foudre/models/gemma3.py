"""Gemma 3's text model (``Gemma3ForCausalLM``; the language model of the multimodal
``Gemma3ForConditionalGeneration`` too, its vision tower left out).

It is the Llama model of ``llama.py`` with Gemma's changes, each a layer swapped or a few lines:

- every norm is ``OffsetRMSNorm``, ``(1 + weight)`` times the normalised input, in float32;
- each decoder layer norms its sublayers' inputs and outputs: ``input_layernorm`` and
  ``post_attention_layernorm`` around attention, ``pre_feedforward_layernorm`` and
  ``post_feedforward_layernorm`` around the MLP, the residual adding the post-normed output;
- the MLP is GeGLU, ``down(gelu_tanh(gate) * up)``;
- q and k are normed per head, scores scaled by ``query_pre_attn_scalar**-0.5``;
- layers alternate between a sliding window (most of them: five in six in Gemma 3) and global
  attention (``ModelConfig.layer_types``), each kind with its own RoPE table: the sliding ones
  ``rope_local_theta`` without scaling, the global ones ``rope_theta`` and ``rope_scaling``;
- the token embeddings are multiplied by ``sqrt(hidden_size)`` (rounded to the embedding's
  dtype first, as the reference does), and logits optionally soft-capped.

Parameter names are Llama's (fused ``qkv_proj`` and ``gate_up_proj``), so loading, quantization
and tensor parallelism treat it as they treat Llama.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from foudre.attention import AttentionBackend
from foudre.layers import fused
from foudre.layers.mlp import GatedMLP
from foudre.layers.norm import OffsetRMSNorm
from foudre.layers.parallel import TensorParallel
from foudre.layers.rotary import RotaryEmbedding
from foudre.models.config import ModelConfig
from foudre.models.llama import Attention, DecodeParts, LlamaForCausalLM, LlamaModel

logger = logging.getLogger(__name__)


class GeGLUMLP(GatedMLP):
    """``down_proj(gelu_tanh(gate) * up)`` with ``gate | up = gate_up_proj(x)``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused.enabled(gate_up) and gate_up.dim() == 2:
            return self.down_proj(fused.gelu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(Attention):
    """Llama's attention with Gemma's q/k norms (per head, ``1 + weight``) and score scale."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__(cfg, rotary, index)
        self.q_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # type: ignore[assignment]
        self.k_norm = OffsetRMSNorm(cfg.head_dim, cfg.rms_norm_eps)  # type: ignore[assignment]
        scalar = cfg.query_pre_attn_scalar or cfg.head_dim
        self.scale = float(scalar) ** -0.5


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(h, eps)
        self.self_attn = Gemma3Attention(cfg, rotary, index)
        self.post_attention_layernorm = OffsetRMSNorm(h, eps)
        self.pre_feedforward_layernorm = OffsetRMSNorm(h, eps)
        self.mlp = GeGLUMLP(h, cfg.intermediate_size)
        self.post_feedforward_layernorm = OffsetRMSNorm(h, eps)
        # tensor parallelism: the partial sums of o_proj and down_proj are added across ranks
        # before their post-norms, which need the whole output (None: one device)
        self.tp: TensorParallel | None = None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(x), kv_cache, backend, metadata)
        if self.tp is not None:
            attn = self.tp.all_reduce(attn)
        x = x + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(x))
        if self.tp is not None:
            mlp = self.tp.all_reduce(mlp)
        return x + self.post_feedforward_layernorm(mlp)

    def decode_parts(self) -> DecodeParts | None:
        """``(1 + weight)`` norms around both sublayers, GeGLU (none for a parallel shard)."""
        if self.tp is not None:
            return None
        return DecodeParts(
            self.input_layernorm, self.self_attn, None, self.pre_feedforward_layernorm,
            self.mlp, offset=True, gelu=True, mixer_out_norm=self.post_attention_layernorm,
            mlp_out_norm=self.post_feedforward_layernorm,
        )  # fmt: skip


class Gemma3Model(LlamaModel):
    """Gemma's layers and final norm; two RoPE tables: the global layers' (``rotary``, the name
    the rest of the engine reads for the model's positions) and the sliding layers'."""

    layer_class = Gemma3DecoderLayer
    norm_class = OffsetRMSNorm

    def make_rotary(self, cfg: ModelConfig, max_positions: int) -> None:
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.rotary_local = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_local_theta, cfg.rope_local_scaling
        )

    def layer_rotary(self, cfg: ModelConfig, index: int) -> RotaryEmbedding:
        return self.rotary if cfg.layer_window(index) is None else self.rotary_local


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's decoder; the interface of ``LlamaForCausalLM`` (whose methods it inherits
    where Gemma does not differ: the layer loop, tensor parallelism, weight loading)."""

    model_class = Gemma3Model

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__(cfg, max_positions)
        self.softcap = cfg.final_logit_softcapping

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings ``[T, hidden]`` of ``input_ids``, times ``sqrt(hidden)``."""
        x = super().embed(input_ids)
        return x * embed_scale(self.config.hidden_size, x.dtype)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab]``, soft-capped (in the model's dtype, as the reference
        does) when the config asks."""
        logits = self.lm_head(hidden)
        if self.tp is not None:
            logits = self.tp.all_gather(logits)[:, : self.vocab_size]
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``LlamaForCausalLM.load_weights`` over the text model's tensors; a multimodal
        checkpoint's language model (``model.language_model.*``, or ``language_model.model.*``
        and ``language_model.lm_head.*`` as older transformers saved it) is read under the text
        model's names, its vision tower and projector skipped (said once in the log)."""
        super().load_weights(_text_weights(weights))


def _text_weights(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterator[tuple[str, torch.Tensor]]:
    skipped = 0
    for name, tensor in weights:
        text = text_model_name(name)
        if text is None:
            skipped += 1
            continue
        yield text, tensor
    if skipped:
        logger.info("gemma3: %d vision tower and projector tensors skipped (text only)", skipped)


def text_model_name(name: str) -> str | None:
    """The text model's name for tensor ``name`` of a checkpoint: a multimodal one's language
    model tensors renamed (``model.language_model.*``, ``language_model.model.*``,
    ``language_model.lm_head.*``), None for its vision tower's and projector's, any other name
    unchanged."""
    for prefix, new in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return new + name[len(prefix) :]
    return None if name.startswith(_VISION_PREFIXES) else name


_LANGUAGE_MODEL_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)


@cache
def embed_scale(hidden_size: int, dtype: torch.dtype) -> float:
    """``sqrt(hidden_size)`` rounded to float32 then to ``dtype``, as transformers' Gemma
    scales its embeddings (a bfloat16 model multiplies by 48.0 where sqrt(2304) is 48, but by
    45.25 where it is 45.2548...)."""
    return float(torch.tensor(hidden_size**0.5, dtype=torch.float32).to(dtype))
