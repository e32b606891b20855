"""Mamba-2 (``Mamba2ForCausalLM``): a stack of pre-norm Mamba-2 mixers, no attention.

Llama's interface (``forward(input_ids, positions, caches, backend, metadata)``) where every
layer is recurrent: ``kv_cache_specs`` lists a ``RecurrentStateSpec`` per layer, the runner hands
layer ``i`` its ``RecurrentCache`` and the step's ``RecurrentBatch`` (``metadata.for_layer(i)``);
positions and the attention backend go unused (the state carries the positions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import nn

from foudre.attention import AttentionBackend
from foudre.attention.cache_spec import CacheSpec, RecurrentCache
from foudre.layers.mamba import Mamba2Mixer, Mamba2Shape, RecurrentBatch
from foudre.layers.moe import SparseMoeBlock
from foudre.layers.norm import RMSNorm
from foudre.models.config import ModelConfig
from foudre.models.llama import DecodeParts, LlamaForCausalLM, LlamaModel


def mamba_shape(cfg: ModelConfig) -> Mamba2Shape:
    """The Mamba-2 mixer's sizes in ``cfg``."""
    return Mamba2Shape(
        hidden_size=cfg.hidden_size,
        num_heads=cfg.mamba_num_heads,
        head_dim=cfg.mamba_head_dim,
        state_size=cfg.mamba_state_size,
        n_groups=cfg.mamba_n_groups,
        conv_kernel=cfg.mamba_conv_kernel,
        chunk_size=cfg.mamba_chunk_size,
        conv_bias=cfg.mamba_conv_bias,
        proj_bias=cfg.mamba_proj_bias,
        eps=cfg.rms_norm_eps,
        time_step_limit=cfg.mamba_time_step_limit,
    )


class Mamba2Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mixer = Mamba2Mixer(mamba_shape(cfg))

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        cache: RecurrentCache,
        backend: AttentionBackend,
        batch: RecurrentBatch,
    ) -> torch.Tensor:
        return x + self.mixer(self.norm(x), cache, batch)

    def decode_parts(self) -> DecodeParts:
        """A pre-norm Mamba-2 mixer, no MLP."""
        return DecodeParts(self.norm, None, self.mixer, None, None, rope=False)


class Mamba2Model(LlamaModel):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        nn.Module.__init__(self)  # no RoPE
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Mamba2Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# Hugging Face's names of the backbone's parts -> ours
_HF_PREFIXES = (
    ("backbone.embeddings.", "model.embed_tokens."),
    ("backbone.embedding.", "model.embed_tokens."),  # older checkpoints
    ("backbone.norm_f.", "model.norm."),
    ("backbone.layers.", "model.layers."),
)


class Mamba2ForCausalLM(LlamaForCausalLM):
    """Mamba-2 language model over a flat batch; ``forward`` returns the final hidden states."""

    model_class = Mamba2Model

    def kv_cache_specs(self) -> list[CacheSpec]:
        """Per layer (all Mamba), what a request keeps."""
        return [cast(Mamba2Block, b).mixer.shape.state_spec() for b in self.model.layers]

    def moe_blocks(self) -> dict[int, SparseMoeBlock]:
        return {}

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in; ``ValueError`` naming the tensor for an unknown
        name, a wrong shape, a repeat, and any parameter the checkpoint lacks."""
        load_named(self, weights, self.config, _rename)


def _rename(name: str) -> str:
    for theirs, ours in _HF_PREFIXES:
        if name.startswith(theirs):
            return ours + name[len(theirs) :]
    return name


def _hf_name(name: str) -> str:
    """The checkpoint's name of our parameter ``name``."""
    for theirs, ours in _HF_PREFIXES:
        if name.startswith(ours) and theirs != "backbone.embedding.":
            return theirs + name[len(ours) :]
    return name


def load_named(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    cfg: ModelConfig,
    rename: Callable[[str], str],
) -> None:
    """Copy tensors, ``rename``d to ``model``'s parameter names, into them, checking names and
    shapes, that none comes twice and that none is missing (a tied head needs none); errors
    name the checkpoint's tensor."""
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for theirs, tensor in weights:
        name = rename(theirs)
        if cfg.tie_word_embeddings and name == "lm_head.weight":
            continue
        param = params.get(name)
        if param is None:
            raise ValueError(f"unexpected weight {theirs!r} for {cfg.architecture}")
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(
                f"weight {theirs!r} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(param.shape)} (from the config)"
            )
        if name in seen:
            raise ValueError(f"weight {theirs!r} is given twice")
        seen.add(name)
        with torch.no_grad():
            param.copy_(tensor)
    for name in params:
        if name not in seen:
            raise ValueError(f"weight {_hf_name(name)!r} missing from the checkpoint")
