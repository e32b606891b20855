"""The Llama family (Llama 1-3, Mistral, Qwen2, Qwen3) and its mixtures of experts (Mixtral,
Qwen2-MoE, Qwen3-MoE, OLMoE) as one model driven by ``ModelConfig``.

The forward pass takes the flattened new tokens of a whole batch (``[T]`` ids and positions) and
the paged KV cache; attention goes through the backend, so this file knows nothing of blocks.
Projections are fused (q|k|v and gate|up) to halve the matmul calls per layer. A sparse layer's
MLP is a ``layers/moe.SparseMoeBlock``; the model only says which variant (from the config).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from foudre.attention import AttentionBackend
from foudre.attention.base import GroupedMetadata
from foudre.attention.cache_spec import CacheSpec, FullAttentionSpec
from foudre.layers.linear import Linear
from foudre.layers.mlp import GatedMLP
from foudre.layers.moe import RoutedRows, SparseMoeBlock
from foudre.layers.norm import RMSNorm
from foudre.layers.parallel import TensorParallel, parallel_embedding
from foudre.layers.rotary import RotaryEmbedding
from foudre.models.config import ModelConfig

if TYPE_CHECKING:
    from foudre.layers.gated_deltanet import GatedDeltaNet
    from foudre.layers.mamba import Mamba2Mixer


# What a decoder layer declares of itself for the native CPU decode step (``runner/cpu_decode.py``,
# which runs a whole decode step's layers in one C++ call): a class declares its parts with a
# ``decode_parts`` method of its own (in its class body, not inherited), so that a subclass that
# computes otherwise (another attention, MLP or residual form) declares its own, or none, and
# runs in Python. The native step checks the parts against what the C++ reads and holds them.
@dataclass(frozen=True, slots=True)
class DecodeParts:
    """A decoder layer as the C++ layers run it: ``x += residual * mixer(norm(x))``, then,
    with a ``post_norm``, ``x += residual * mlp(post_norm(x))`` (Gemma: each sublayer's output
    normed, ``mixer_out_norm`` / ``mlp_out_norm``, before it is added); the mixer is attention
    (``attn``, rotating q and k by its own tables where ``rope``) or a Mamba-2 mixer
    (``mamba``); the MLP a ``GatedMLP`` (GeGLU where ``gelu``) or a ``SparseMoeBlock``;
    ``offset``: every norm of the layer is Gemma's ``(1 + weight)`` form; ``attention_window``:
    the C++ applies the attention's sliding window and sinks itself, and runs gpt-oss's experts
    (a window then limits no step).

    ``parallel`` (Falcon-H1): both mixers, ``attn`` and ``mamba``, on the one normed input, each
    input times its multiplier (``attn_multipliers`` / ``mamba_multipliers``: (in, out)) and
    each output times its own, ``x += mamba_out + attn_out``; ``mamba_sections``: (first, end,
    multiplier) column ranges of in_proj's output scaled before the mixer's step;
    ``mlp_multipliers``: (gate, down), the gate scaled before its SiLU, the MLP's output after
    down_proj."""

    norm: nn.Module
    attn: Attention | None
    mamba: Mamba2Mixer | None
    post_norm: nn.Module | None
    mlp: nn.Module | None
    residual: float = 1.0
    rope: bool = True
    offset: bool = False
    gelu: bool = False
    mixer_out_norm: nn.Module | None = None
    mlp_out_norm: nn.Module | None = None
    parallel: bool = False
    attn_multipliers: tuple[float, float] = (1.0, 1.0)
    mamba_multipliers: tuple[float, float] = (1.0, 1.0)
    mamba_sections: tuple[tuple[int, int, float], ...] = ()
    mlp_multipliers: tuple[float, float] = (1.0, 1.0)
    # Qwen3-Next: a gated DeltaNet mixer (in place of attn and mamba), and the attention's
    # output gate (``output_gate``: o times its sigmoid before o_proj)
    deltanet: GatedDeltaNet | None = None
    output_gate: nn.Module | None = None
    attention_window: bool = False
    # DeepSeek-V3: multi-head latent attention as the mixer (a LatentAttention; attn is None)
    latent: nn.Module | None = None


def declared_parts(layer: nn.Module) -> DecodeParts | None:
    """The parts ``layer``'s own class declares (None: its class declares none)."""
    declare = type(layer).__dict__.get("decode_parts")
    return None if declare is None else declare(layer)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        # the sliding window of layer `index` (None: full causal attention), which every
        # attention backend applies
        self.sliding_window = cfg.layer_window(index)
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=False)
        # q/k norm over each head (qwen3), or over all heads at once (olmoe)
        self.norm_over_heads = cfg.qk_norm_over_heads
        q_width = self.q_size if cfg.qk_norm_over_heads else self.head_dim
        k_width = self.kv_size if cfg.qk_norm_over_heads else self.head_dim
        self.q_norm = RMSNorm(q_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(k_width, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.clip_qkv = cfg.clip_qkv
        self.rotary = rotary
        self.scale = self.head_dim**-0.5
        # per-head logits in the softmax's denominator (gpt-oss), which the backends apply
        self.sinks: torch.Tensor | None = None

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
        if self.norm_over_heads and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if not self.norm_over_heads and self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        o = backend.forward(
            q, k, v, kv_cache, metadata, self.scale, window=self.sliding_window, sinks=self.sinks
        )
        return self.o_proj(o.reshape(t, self.q_size))


def sparse_block(cfg: ModelConfig, **variant: Any) -> SparseMoeBlock:
    """A sparse layer's mixture of experts as ``cfg`` describes it (its routing, shared
    experts, groups); ``variant``: what a family adds (a router bias, other experts)."""
    return SparseMoeBlock(
        cfg.hidden_size,
        cfg.num_experts,
        cfg.num_experts_per_tok,
        cfg.moe_intermediate_size,
        renormalize=cfg.norm_topk_prob,
        shared_intermediate_size=cfg.shared_expert_intermediate_size,
        shared_gate=cfg.shared_expert_gate,
        scoring=cfg.moe_scoring_func,
        n_group=cfg.n_group,
        topk_group=cfg.topk_group,
        routed_scaling_factor=cfg.routed_scaling_factor,
        **variant,
    )


class DecoderLayer(nn.Module):
    """Pre-norm attention, then pre-norm MLP, each added to the residual. A family changes its
    parts by subclassing: ``attention_class`` (built as ``(cfg, rotary, index)``) and
    ``feed_forward`` (a dense ``GatedMLP``, or ``sparse_block`` where the layer is sparse)."""

    attention_class: type[nn.Module] = Attention
    # (typed as the Llama family's: what the paths built for its exact layout read)
    self_attn: Attention
    mlp: GatedMLP | SparseMoeBlock

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = cast(Attention, self.attention_class(cfg, rotary, index))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = cast(GatedMLP | SparseMoeBlock, self.feed_forward(cfg, index))
        # tensor parallelism: o_proj and the MLP's down projections are row-parallel, so each
        # rank's output is a partial sum, added across ranks here (None: one device)
        self.tp: TensorParallel | None = None

    def decode_parts(self) -> DecodeParts | None:
        """Pre-norm attention, pre-norm MLP (none for a tensor-parallel shard)."""
        if self.tp is not None:
            return None
        return DecodeParts(
            self.input_layernorm, self.self_attn, None, self.post_attention_layernorm, self.mlp
        )

    def feed_forward(self, cfg: ModelConfig, index: int) -> nn.Module:
        """Layer ``index``'s MLP."""
        if cfg.is_sparse_layer(index):
            return sparse_block(cfg)
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size)

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
        x = x + attn
        mlp = self.mlp(self.post_attention_layernorm(x))
        if self.tp is not None:
            mlp = self.tp.all_reduce(mlp)
        return x + mlp


class LlamaModel(nn.Module):
    """Embeddings, decoder layers (``layer_class``, each given its RoPE table by
    ``layer_rotary``) and the final norm (``norm_class``)."""

    layer_class: type[nn.Module] = DecoderLayer
    norm_class: type[nn.Module] = RMSNorm

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.make_rotary(cfg, max_positions)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            self.layer_class(cfg, self.layer_rotary(cfg, i), i)
            for i in range(cfg.num_hidden_layers)
        )
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps)

    def make_rotary(self, cfg: ModelConfig, max_positions: int) -> None:
        """The RoPE tables: ``rotary``, the one the engine reads for the model's positions."""
        self.rotary = RotaryEmbedding(
            cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling, cfg.rotary_dim
        )

    def layer_rotary(self, cfg: ModelConfig, index: int) -> RotaryEmbedding:
        """The RoPE table of layer ``index``."""
        return self.rotary


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; ``forward`` returns final hidden states for the flat batch.

    A shard of a parallel model (``foudre/distributed``) is this class built from the shard's
    config (its heads, its slice of the MLP and vocabulary, its pipeline stage's layers) with
    ``set_tensor_parallel``; it then runs as ``embed`` (first stage), ``forward_layers``, then
    the final norm and ``compute_logits`` (last stage)."""

    model_class: type[LlamaModel] = LlamaModel  # a family's own layers

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.model_class(cfg, max_positions or cfg.max_position_embeddings)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tp: TensorParallel | None = None
        self.vocab_size = cfg.vocab_size  # the whole vocabulary's (a shard holds a slice)
        self.first_layer = 0  # the whole model's index of layer 0 (a pipeline stage's shard)
        # which rows the routers count, one for all the sparse blocks (None: a dense model)
        blocks = list(self.moe_blocks().values())
        self.routed_rows: RoutedRows | None = None
        if blocks:
            self.routed_rows = shared = RoutedRows(blocks[0].expert_tokens.device)
            for block in blocks:
                block.routed_rows = shared

    def set_tensor_parallel(self, tp: TensorParallel, vocab_size: int) -> None:
        """Make this model one tensor-parallel shard of a model of ``vocab_size`` tokens: its
        layers add their row-parallel outputs across ``tp``, its embedding and logits are
        vocabulary-parallel."""
        self.tp = tp
        self.vocab_size = vocab_size
        for layer in self.model.layers:
            cast(DecoderLayer, layer).tp = tp

    def kv_cache_specs(self) -> list[CacheSpec]:
        """What each of this model's layers keeps per token in the paged cache: K and V of its
        KV heads (with the layer's sliding window, if any)."""
        attns = [cast(DecoderLayer, layer).self_attn for layer in self.model.layers]
        return [FullAttentionSpec(a.num_kv_heads, a.head_dim, a.sliding_window) for a in attns]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        x = self.embed(input_ids)
        x = self.forward_layers(x, positions, kv_caches, backend, metadata)
        return self.model.norm(x)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embeddings ``[T, hidden]`` of ``input_ids``."""
        if self.tp is not None:
            return parallel_embedding(input_ids, self.model.embed_tokens.weight, self.tp)
        return self.model.embed_tokens(input_ids)

    def forward_layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        backend: AttentionBackend,
        metadata: Any,
    ) -> torch.Tensor:
        """The decoder layers over the hidden states ``x`` (before the final norm); with cache
        groups (``GroupedMetadata``), each layer reads its group's metadata."""
        if isinstance(metadata, GroupedMetadata):
            for i, (layer, cache) in enumerate(zip(self.model.layers, kv_caches, strict=True)):
                x = layer(positions, x, cache, backend, metadata.for_layer(i))
            return x
        for layer, cache in zip(self.model.layers, kv_caches, strict=True):
            x = layer(positions, x, cache, backend, metadata)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[N, vocab]`` for the given final hidden states."""
        logits = self.lm_head(hidden)
        if self.tp is not None:  # each rank's slice of the vocabulary, then the padding cut
            logits = self.tp.all_gather(logits)[:, : self.vocab_size]
        return logits.float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the fused parameters.

        Experts come per expert (``mlp.experts.{e}.gate_proj.weight``, Mixtral's
        ``block_sparse_moe.experts.{e}.w1.weight``) or stacked (``mlp.experts.gate_up_proj``
        ``[E, 2I, hidden]``, ``mlp.experts.down_proj``). Raises ``ValueError`` naming the
        tensor for an unexpected name or shape, a piece loaded twice, and any parameter (or
        expert) left unloaded, so that a wrong checkpoint never runs with random weights.
        """
        cfg = self.config
        params = dict(self.named_parameters())
        qkv = {
            "q_proj": (0, cfg.q_size),
            "k_proj": (cfg.q_size, cfg.kv_size),
            "v_proj": (cfg.q_size + cfg.kv_size, cfg.kv_size),
        }
        covered: dict[str, int] = {}
        pieces: set[tuple[str, int, int]] = set()  # (parameter, expert or -1, first row)
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if cfg.tie_word_embeddings and name == "lm_head.weight":
                continue
            target, expert, part = _destination(name)
            param = params.get(target)
            if param is None or expert >= (param.shape[0] if expert >= 0 else 0):
                raise ValueError(f"unexpected weight {name!r} for {cfg.architecture}")
            dest = param.data if expert < 0 else param.data[expert]
            start = 0
            if part in qkv:
                start, size = qkv[part]
                dest = dest.narrow(0, start, size)
            elif part is not None:  # gate_proj, up_proj: the halves of gate_up_proj
                half = dest.shape[0] // 2
                start = 0 if part == "gate_proj" else half
                dest = dest.narrow(0, start, half)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
                )
            if (target, expert, start) in pieces:
                raise ValueError(f"weight {name!r} is given twice")
            pieces.add((target, expert, start))
            dest.copy_(tensor)
            covered[target] = covered.get(target, 0) + dest.numel()
        for target, param in params.items():
            if covered.get(target, 0) != param.numel():
                missing = _missing_expert(target, param, pieces, cfg.architecture) or target
                raise ValueError(f"weight {missing!r} missing from the checkpoint")

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        """The mixture-of-experts blocks by layer index (the whole model's), empty for a dense
        model."""
        mlps = (cast(DecoderLayer, layer).mlp for layer in self.model.layers)
        first = self.first_layer
        return {first + i: mlp for i, mlp in enumerate(mlps) if isinstance(mlp, SparseMoeBlock)}

    def reset_moe_stats(self) -> None:
        """Zero every block's count of tokens routed to each expert."""
        for block in self.moe_blocks().values():
            block.reset_stats()

    def count_moe_rows(self, rows: int) -> None:
        """Count only the first ``rows`` rows of the next forwards in the routers' statistics
        (the rest pad the batch): one fill of the tensor the blocks share, so CUDA graphs
        captured over it count what each replay says."""
        if self.routed_rows is not None:
            self.routed_rows.set(rows)

    @contextmanager
    def moe_counting(self, on: bool) -> Iterator[None]:
        """Within the block, the routers count the tokens they route only when ``on``."""
        routed = self.routed_rows
        if routed is None:
            yield
            return
        before = routed.on
        try:
            routed.on = on
            yield
        finally:
            routed.on = before

    def moe_expert_tokens(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since the counts were last reset, by layer index."""
        blocks = self.moe_blocks()
        if not blocks:
            return {}
        counts = torch.stack([b.expert_tokens for b in blocks.values()]).tolist()
        return dict(zip(blocks, counts, strict=True))


# Mixtral's (and transformers 4's) names for the routed experts' projections
_EXPERT_PARTS = {
    "w1": "gate_proj",
    "w3": "up_proj",
    "w2": "down_proj",
    "gate_proj": "gate_proj",
    "up_proj": "up_proj",
    "down_proj": "down_proj",
}
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj"}
_FUSED |= {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _destination(name: str) -> tuple[str, int, str | None]:
    """(parameter name, expert index or -1, the part of a fused parameter or None) of a
    Hugging Face tensor name."""
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral
    m = _EXPERT.match(name)
    if m is not None:
        part = _EXPERT_PARTS[m.group(3)]
        if part == "down_proj":
            return f"{m.group(1)}.down_proj", int(m.group(2)), None
        return f"{m.group(1)}.gate_up_proj", int(m.group(2)), part
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        return ".".join([*parts[:-2], _FUSED[parts[-2]], parts[-1]]), -1, parts[-2]
    return name, -1, None


def _missing_expert(
    target: str, param: torch.Tensor, pieces: set[tuple[str, int, int]], architecture: str
) -> str | None:
    """The checkpoint name of the first expert projection ``target`` lacks, if it holds
    experts: per expert, as the architecture's checkpoints name them (Mixtral's
    ``block_sparse_moe.experts.{e}.w3.weight``), or the stacked tensor when none of it came."""
    prefix, _, leaf = target.rpartition(".")
    if not prefix.endswith(".experts") or (target, -1, 0) in pieces:
        return None
    if architecture != "mixtral" and not any(piece[0] == target for piece in pieces):
        return f"{target} (or its per-expert tensors {prefix}.{{e}}.*.weight)"
    half = param.shape[1] // 2
    parts = [("gate_proj", 0), ("up_proj", half)] if leaf == "gate_up_proj" else [(leaf, 0)]
    if architecture == "mixtral":
        prefix = prefix.replace(".mlp.", ".block_sparse_moe.")
        names = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
        parts = [(names[part], start) for part, start in parts]
    for e in range(param.shape[0]):
        for part, start in parts:
            if (target, e, start) not in pieces:
                return f"{prefix}.{e}.{part}.weight"
    return None
