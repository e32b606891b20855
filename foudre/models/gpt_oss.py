"""OpenAI's gpt-oss: the Llama layout with four differences, each behind the layers it needs.

- attention sinks: each head has a learned logit ``sinks[h]`` that joins its softmax
  denominator (a key of value zero), passed to the backend (``forward(..., sinks=)``), which
  every backend applies;
- alternating sliding-window and full attention (``layer_types``), q/k/v *and* o projections
  with biases, YaRN RoPE (``layers/rotary.py``);
- a mixture of experts in every layer: a router with a bias, top-k of its logits then a softmax
  over the chosen k (the same weights as a softmax over all then renormalised, which
  ``layers/moe.route`` computes), experts with biases and a clamped SwiGLU
  (``layers/moe.ClampedSwiGLUExperts``).

Checkpoint names are transformers' (``mlp.router.*``, ``mlp.experts.gate_up_proj`` ``[E,
hidden, 2I]`` with gate and up interleaved in its columns, ``mlp.experts.down_proj`` ``[E, I,
hidden]`` and their ``*_bias``); ``load_weights`` maps them onto the fused, row-major
parameters.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from foudre.layers.linear import Linear
from foudre.layers.moe import ClampedSwiGLUExperts
from foudre.layers.rotary import RotaryEmbedding
from foudre.models.config import ModelConfig
from foudre.models.llama import (
    Attention,
    DecodeParts,
    DecoderLayer,
    LlamaForCausalLM,
    LlamaModel,
    sparse_block,
)


class GptOssAttention(Attention):
    """Llama's attention with an o_proj bias (``attention_bias``) and per-head sinks."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__(cfg, rotary, index)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.sinks = nn.Parameter(torch.zeros(cfg.num_attention_heads))


class GptOssDecoderLayer(DecoderLayer):
    """The Llama layer with gpt-oss's attention and, in every layer, its experts."""

    attention_class = GptOssAttention

    def decode_parts(self) -> DecodeParts | None:
        """Llama's parts, the attention's window and sinks and the experts run natively too
        (none for a tensor-parallel shard)."""
        if self.tp is not None:
            return None
        return DecodeParts(
            self.input_layernorm,
            self.self_attn,
            None,
            self.post_attention_layernorm,
            self.mlp,
            attention_window=True,
        )

    def feed_forward(self, cfg: ModelConfig, index: int) -> nn.Module:
        experts = ClampedSwiGLUExperts(
            cfg.num_experts,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            alpha=cfg.swiglu_alpha,
            limit=cfg.swiglu_limit,
        )
        return sparse_block(cfg, router_bias=True, experts=experts)


class GptOssModel(LlamaModel):
    """Embeddings, gpt-oss's decoder layers and the final norm (``LlamaModel``'s parts)."""

    layer_class = GptOssDecoderLayer


class GptOssForCausalLM(LlamaForCausalLM):
    """gpt-oss (``GptOssForCausalLM``): ``LlamaForCausalLM``'s interface (forward, logits,
    MoE statistics) over gpt-oss's layers. Tensor and pipeline parallelism are refused by the
    plan (``distributed/plan.check_parallel``)."""

    model_class = GptOssModel

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named tensors into the model: q/k/v (weights and biases) into
        ``qkv_proj``, ``mlp.router`` into ``mlp.gate``; float experts' interleaved
        ``gate_up_proj`` ``[E, hidden, 2I]`` de-interleaved and transposed into ``[E, 2I,
        hidden]`` (gate rows, then up rows), ``down_proj`` ``[E, I, hidden]`` transposed; MXFP4
        experts (``*_blocks``, ``*_scales`` and biases, into the buffers of an ``MXFP4Experts``
        the loader put in place) as stored. ``ValueError`` naming the tensor for an unexpected
        name or shape, one given twice, or a parameter left unloaded."""
        cfg = self.config
        params: dict[str, torch.Tensor] = dict(self.named_parameters())
        params |= {n: b for n, b in self.named_buffers() if ".mlp.experts." in n}
        qkv = {"q_proj": (0, cfg.q_size), "k_proj": (cfg.q_size, cfg.kv_size)}
        qkv["v_proj"] = (cfg.q_size + cfg.kv_size, cfg.kv_size)
        loaded: dict[str, int] = {}
        for name, tensor in weights:
            if "rotary_emb" in name or (cfg.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, tensor, part = _destination(name, tensor, cfg.mxfp4_experts)
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            dest = param.data
            if part is not None:
                start, size = qkv[part]
                dest = dest.narrow(0, start, size)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            key = f"{target}:{part}"
            if key in loaded:
                raise ValueError(f"weight {name!r} is given twice")
            dest.copy_(tensor)
            loaded[key] = dest.numel()
            loaded[target] = loaded.get(target, 0) + dest.numel()
        for target, param in params.items():
            if loaded.get(target, 0) != param.numel():
                raise ValueError(f"weight {_checkpoint_name(target)!r} missing from the checkpoint")


_QKV = re.compile(r"^(.*\.self_attn)\.(q_proj|k_proj|v_proj)\.(weight|bias)$")


def _destination(
    name: str, tensor: torch.Tensor, packed: bool
) -> tuple[str, torch.Tensor, str | None]:
    """(parameter name, the tensor in its layout, the part of qkv_proj or None) of a
    transformers tensor name; ``packed``: MXFP4 experts, whose tensors load as stored."""
    m = _QKV.match(name)
    if m is not None:
        return f"{m.group(1)}.qkv_proj.{m.group(3)}", tensor, m.group(2)
    name = name.replace(".mlp.router.", ".mlp.gate.")
    if packed:
        return name, tensor, None
    if name.endswith(".mlp.experts.gate_up_proj") and tensor.dim() == 3:
        # [E, hidden, 2I], gate in the even columns, up in the odd: [E, 2I, hidden] gate | up
        tensor = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1).transpose(1, 2)
    elif name.endswith(".mlp.experts.gate_up_proj_bias") and tensor.dim() == 2:
        tensor = torch.cat([tensor[..., 0::2], tensor[..., 1::2]], dim=-1)
    elif name.endswith(".mlp.experts.down_proj") and tensor.dim() == 3:
        tensor = tensor.transpose(1, 2)  # [E, I, hidden] -> [E, hidden, I]
    return name, tensor, None


def _checkpoint_name(target: str) -> str:
    """The checkpoint's name for the model parameter ``target`` (q_proj's for qkv_proj)."""
    target = target.replace(".mlp.gate.", ".mlp.router.")
    return target.replace(".qkv_proj.", ".q_proj.")
