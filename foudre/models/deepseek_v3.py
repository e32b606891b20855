"""DeepSeek-V3 (and R1, Kimi-K2): multi-head latent attention over a paged latent cache, and
a mixture of experts with sigmoid, group-limited routing.

Multi-head latent attention (MLA). Per token the layer computes one latent ``c`` of
``kv_lora_rank`` values (``kv_a_proj_with_mqa`` then ``kv_a_layernorm``) and one rotated key
``k_r`` of ``qk_rope_head_dim`` values, both shared by all heads; head ``h``'s key is
``[W_UK[h] c, k_r]`` and its value ``W_UV[h] c`` (``kv_b_proj`` = ``[W_UK; W_UV]`` per head).
The cache keeps only ``[c, k_r]`` (``LatentAttentionSpec``): ``kv_lora_rank +
qk_rope_head_dim`` values per token and layer, where plain KV would keep ``num_heads *
(qk_head_dim + v_head_dim)``. Two ways to compute the same attention::

    expanded   k[h] = [W_UK[h] c, k_r], v[h] = W_UV[h] c          per-head K/V, dims 192 / 128
               o[h] = softmax(q[h] . k[h] * scale) v[h]
    absorbed   q'[h] = [q_nope[h] W_UK[h], q_rope[h]]               W_UK folded into the query
               o'[h] = softmax(q'[h] . [c, k_r] * scale) [c, k_r]   one shared KV "head"
               o[h]  = W_UV[h] o'[h][:kv_lora_rank]                 W_UV applied after

since ``q_nope[h] . (W_UK[h] c) = (q_nope[h] W_UK[h]) . c``. The absorbed form is plain
multi-query attention with one KV head of ``kv_lora_rank + qk_rope_head_dim`` whose values are
its keys, which every paged backend computes as it is (the cache spec aliases V to K). A step
over the paged cache (``attention/latent.LatentMetadata``) runs each row the cheaper way: a row
whose context is all new (a prompt computed whole) in the expanded form among its own tokens,
its latents stored for later; every other row (decode, later prompt chunks, prefix hits,
resumed preemptions, speculative verification) absorbed, through the backend, reading only
latents. For a long prompt the expanded form is the smaller product (per head and pair of
tokens ``qk_head_dim + v_head_dim`` multiply-adds against ``2 (kv_lora_rank +
qk_rope_head_dim)``: 320 against 1152 in DeepSeek-V3); for one new token over a long context,
reading the latents is the smaller read. Whole sequences
without a cache (``CausalBackend``: training, evaluation, calibration) run expanded too.

The softmax scale is ``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim)``
squared where the config's rope scaling gives ``mscale_all_dim`` (the released models do).

Without ``q_lora_rank`` the query is one projection; it is kept as ``q_b_proj`` (the
checkpoint's ``q_proj``) with no ``q_a_proj``. Checkpoints whose RoPE pairs are interleaved
(``rope_interleave``, the default) have those rows permuted at load to the rotate-half layout,
which gives the same rotated vectors. Multi-token-prediction layers (the checkpoint's layers
past ``num_hidden_layers``) are skipped at load.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from foudre.attention import AttentionBackend
from foudre.attention.cache_spec import CacheSpec, LatentAttentionSpec
from foudre.attention.causal import CausalBackend
from foudre.attention.latent import LatentMetadata
from foudre.layers import fused
from foudre.layers.linear import MAX_ROWS, Linear
from foudre.layers.norm import RMSNorm
from foudre.layers.parallel import TensorParallel
from foudre.layers.rotary import RotaryEmbedding
from foudre.models.config import ModelConfig
from foudre.models.llama import DecodeParts, DecoderLayer, LlamaForCausalLM, LlamaModel

logger = logging.getLogger("foudre")
_CAUSAL = CausalBackend()  # the expanded form's attention among a row's own tokens


def softmax_scale(cfg: ModelConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` when the rope
    scaling (YaRN) gives ``mscale_all_dim``."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    scaling = cfg.rope_scaling or {}
    m_all = scaling.get("mscale_all_dim")
    factor = float(scaling.get("factor") or 1.0)
    if scaling.get("rope_type", "default") != "default" and m_all and factor > 1:
        mscale = 0.1 * float(m_all) * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class LatentProjection(nn.Module):
    """``kv_b_proj``: per head, the ``qk_nope_head_dim`` rows of W_UK then the ``v_head_dim``
    rows of W_UV, over the latent (``weight`` ``[heads * (nope + v), kv_lora_rank]``, the
    checkpoint's layout). Not a linear layer: the absorbed form multiplies by its halves
    per head, so quantization leaves it in float."""

    def __init__(self, heads: int, nope: int, v: int, rank: int) -> None:
        super().__init__()
        self.heads, self.nope, self.v, self.rank = heads, nope, v, rank
        self.weight = nn.Parameter(torch.empty(heads * (nope + v), rank))

    def halves(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [heads, nope, rank], W_UV [heads, v, rank])``, views of ``weight``."""
        w = self.weight.view(self.heads, self.nope + self.v, self.rank)
        return w[:, : self.nope], w[:, self.nope :]


class LatentAttention(nn.Module):
    """Multi-head latent attention (see the module's docstring)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        self.num_heads = h = cfg.num_attention_heads
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_head_dim, self.rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.qk_head_dim = self.nope + self.rope
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        q_in = hidden
        if cfg.q_lora_rank is not None:
            self.q_a_proj = Linear(hidden, cfg.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            q_in = cfg.q_lora_rank
        self.q_b_proj = Linear(q_in, h * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden, self.rank + self.rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.rank, 1e-6)
        self.kv_b_proj = LatentProjection(h, self.nope, self.v_head_dim, self.rank)
        self.o_proj = Linear(h * self.v_head_dim, hidden, bias=bias)
        self.rotary = rotary
        self.scale = softmax_scale(cfg)

    def project(
        self, positions: torch.Tensor, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q_nope [T, H, nope], q_rope [T, H, rope], latent [T, rank], k_rope [T, 1, rope])``,
        the rope parts rotated."""
        t = x.shape[0]
        q_in = x
        if self.q_a_proj is not None and self.q_a_layernorm is not None:
            q_in = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_in).view(t, self.num_heads, self.qk_head_dim)
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_rope, k_rope = self.rotary(
            positions, q_rope.contiguous(), k_rope.reshape(t, 1, self.rope).contiguous()
        )
        return q_nope, q_rope, latent, k_rope

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        q_nope, q_rope, latent, k_rope = self.project(positions, x)
        parts = (q_nope, q_rope, latent, k_rope)
        if kv_cache.numel() == 0:  # whole sequences without a cache
            o = self.expanded(*parts, kv_cache, backend, metadata)
        elif isinstance(metadata, LatentMetadata):
            o = self.paged(*parts, kv_cache, backend, metadata)
        else:  # a step laid out without the split (CUDA graphs' decode steps)
            o = self.absorbed(*parts, kv_cache, backend, metadata)
        return self.o_proj(o.reshape(x.shape[0], self.num_heads * self.v_head_dim))

    def paged(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_cache: torch.Tensor,
        backend: AttentionBackend,
        metadata: LatentMetadata,
    ) -> torch.Tensor:
        """Attention outputs ``[T, H, v_head_dim]`` of a step over the latent cache: the rows
        whose context is all new in the expanded form, among their own tokens (their latents
        stored for later steps), the others absorbed through the backend."""
        if not metadata.fresh:
            return self.absorbed(q_nope, q_rope, latent, k_rope, kv_cache, backend, metadata.inner)
        assert metadata.fresh_tokens is not None and metadata.fresh_slots is not None
        fresh = metadata.fresh_tokens
        kv = torch.cat([latent[fresh].unsqueeze(1), k_rope[fresh].to(latent.dtype)], dim=-1)
        pages = kv_cache[0]  # [blocks, block_size, 1, D]: K, and V, of the latent cache
        pages.view(-1, 1, pages.shape[-1]).index_copy_(0, metadata.fresh_slots, kv)
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, self.v_head_dim)
        for start, n in metadata.fresh:
            rows = slice(start, start + n)
            parts = (q_nope[rows], q_rope[rows], latent[rows], k_rope[rows])
            out[rows] = self.expanded(*parts, kv_cache, _CAUSAL, (1, n))
        if metadata.inner is not None and metadata.rest is not None:
            rest = metadata.rest
            parts = (q_nope[rest], q_rope[rest], latent[rest], k_rope[rest])
            out[rest] = self.absorbed(*parts, kv_cache, backend, metadata.inner)
        return out

    def absorbed(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_cache: Any,
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        """Attention outputs ``[T, H, v_head_dim]`` through the latent cache: multi-query
        attention of the queries ``[q_nope W_UK, q_rope]`` over the one shared ``[latent,
        k_rope]`` per token (stored by the backend as K; V is the same memory), then W_UV."""
        weight = self.kv_b_proj.weight
        native = self._native(q_nope)
        if native:  # (the native decode step's kernels: native/decode_mla.h)
            q_latent = fused.latent_absorb(q_nope, weight, self.v_head_dim)
        else:
            w_uk = self.kv_b_proj.halves()[0]
            q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, rank]
        q = torch.cat([q_latent, q_rope.to(q_latent.dtype)], dim=-1)
        kv = torch.cat([latent.unsqueeze(1), k_rope.to(latent.dtype)], dim=-1)  # [T, 1, D]
        o = backend.forward(q, kv, kv, kv_cache, metadata, self.scale)
        if native:
            return fused.latent_unabsorb(o, weight, self.nope)
        w_uv = self.kv_b_proj.halves()[1]
        o_latent = o[..., : self.rank].transpose(0, 1)  # [H, T, rank]
        return torch.bmm(o_latent, w_uv.transpose(1, 2)).transpose(0, 1)  # [T, H, v]

    def _native(self, q_nope: torch.Tensor) -> bool:
        """Whether the absorbed form's products run natively (``fused.latent_absorb`` and
        ``latent_unabsorb``, what the native decode step calls): a decode-sized CPU step
        (at most ``MAX_ROWS`` tokens), no autograd, no autocast. Elsewhere ``torch.bmm``."""
        weight = self.kv_b_proj.weight
        return (
            q_nope.shape[0] <= MAX_ROWS.get(q_nope.dtype, 0)
            and fused.enabled(q_nope, weight)
            and weight.is_contiguous()
            and q_nope.stride(2) == 1
            and not torch.is_autocast_enabled("cpu")
        )

    def expanded(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        k_rope: torch.Tensor,
        kv_cache: Any,
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        """Attention outputs ``[T, H, v_head_dim]`` with per-head keys ``[W_UK c, k_rope]`` and
        values ``W_UV c`` (the backend's heads padded with zeros to one width: zeros add
        nothing to a score, and the values' padding is cut from the output)."""
        t, h = q_nope.shape[0], self.num_heads
        kv = torch.nn.functional.linear(latent, self.kv_b_proj.weight).view(t, h, -1)
        k_nope, v = kv.split([self.nope, self.v_head_dim], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(t, h, self.rope)], dim=-1)
        width = max(self.qk_head_dim, self.v_head_dim)
        q, k, v = (_pad(z, width) for z in (q, k, v))
        o = backend.forward(q, k, v, kv_cache, metadata, self.scale)
        return o[..., : self.v_head_dim]


def _pad(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` padded with zeros along its last axis to ``width``."""
    extra = width - x.shape[-1]
    return x if extra == 0 else torch.nn.functional.pad(x, (0, extra))


class DeepseekV3DecoderLayer(DecoderLayer):
    """The Llama layer with latent attention (its MLP: dense in the first
    ``first_k_dense_replace`` layers, then DeepSeek's experts, as the config routes them)."""

    attention_class = LatentAttention

    def decode_parts(self) -> DecodeParts | None:
        """Pre-norm latent attention (``latent``), pre-norm MLP (dense, or DeepSeek's experts
        with their shared experts)."""
        if self.tp is not None:
            return None
        return DecodeParts(
            self.input_layernorm,
            None,
            None,
            self.post_attention_layernorm,
            self.mlp,
            latent=self.self_attn,
        )


class DeepseekV3Model(LlamaModel):
    layer_class = DeepseekV3DecoderLayer

    def make_rotary(self, cfg: ModelConfig, max_positions: int) -> None:
        """One table for the decoupled RoPE key and query parts (``qk_rope_head_dim``)."""
        self.rotary = RotaryEmbedding(
            cfg.qk_rope_head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling
        )


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """DeepSeek-V3 with the interface of ``LlamaForCausalLM`` (``forward``, ``embed``,
    ``forward_layers``, ``compute_logits``, the MoE statistics), which it inherits; its own are
    the layers, the cache specs and the checkpoint's names."""

    model_class = DeepseekV3Model

    def set_tensor_parallel(self, tp: TensorParallel, vocab_size: int) -> None:
        raise ValueError(
            f"{self.config.architecture} (multi-head latent attention) does not run tensor-parallel"
        )

    def kv_cache_specs(self) -> list[CacheSpec]:
        """Per layer, the latent and the rotated key of each token (one vector for all heads)."""
        cfg = self.config
        spec = LatentAttentionSpec(cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        return [spec] * len(self.model.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face-named tensors, as ``LlamaForCausalLM.load_weights`` checks them, after
        renaming DeepSeek's (``shared_experts``, the router's bias, ``q_proj``), permuting
        interleaved RoPE rows, and skipping the multi-token-prediction layers."""
        super().load_weights(self._renamed(weights))

    def _renamed(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        skipped: set[int] = set()
        for name, tensor in weights:
            m = _LAYER.match(name)
            if m is not None and int(m.group(1)) >= cfg.num_hidden_layers:
                skipped.add(int(m.group(1)))  # multi-token prediction: not run here
                continue
            name = name.replace(".mlp.shared_experts.", ".mlp.shared_expert.")
            name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
            name = name.replace(".self_attn.q_proj.", ".self_attn.q_b_proj.")
            if cfg.rope_interleave and name.endswith(_ROPE_ROWS):
                tensor = self._deinterleave(name, tensor)
            yield name, tensor
        if skipped:
            logger.info(
                "skipped %d multi-token-prediction layer(s) of the checkpoint (layers %s)",
                len(skipped),
                ", ".join(map(str, sorted(skipped))),
            )

    def _deinterleave(self, name: str, w: torch.Tensor) -> torch.Tensor:
        """``w``'s RoPE rows (the last ``qk_rope_head_dim`` of each head's query, or of the
        latent projection) from interleaved pairs to rotate-half order (evens, then odds)."""
        cfg = self.config
        rope = cfg.qk_rope_head_dim
        perm = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        if name.endswith("kv_a_proj_with_mqa.weight") or name.endswith("kv_a_proj_with_mqa.bias"):
            head = w.shape[0]
            groups = w.reshape(1, head, *w.shape[1:])
        else:  # q_b_proj: per head
            head = cfg.qk_nope_head_dim + rope
            if w.shape[0] % head:
                return w  # the shape check in load_weights names it
            groups = w.reshape(w.shape[0] // head, head, *w.shape[1:])
        if groups.shape[1] < rope:
            return w
        out = groups.clone()
        out[:, head - rope :] = groups[:, head - rope :][:, perm]
        return out.reshape(w.shape)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_ROPE_ROWS = ("q_b_proj.weight", "kv_a_proj_with_mqa.weight", "kv_a_proj_with_mqa.bias")
