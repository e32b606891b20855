"""Mamba-2 (``Mamba2ForCausalLM``): a stack of pre-norm Mamba-2 mixers, no attention.

The model math only: ``forward`` takes the flat tokens of a batch of rows, the recurrent state
pools and the step's ``RecurrentBatch`` (``layers/mamba.py``, which also describes what the
engine integration needs). The engine does not hold recurrent state yet, so ``kv_cache_specs``
refuses with ``RecurrentStateNotSupported``: ``LLM(...)`` on a Mamba-2 checkpoint stops there
with that error instead of running without its state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import cast

import torch
from torch import nn

from foudre.layers.linear import Linear
from foudre.layers.mamba import (
    Mamba2Mixer,
    Mamba2Shape,
    RecurrentBatch,
    RecurrentStates,
    RecurrentStateSpec,
)
from foudre.layers.norm import RMSNorm
from foudre.models.config import ModelConfig


class RecurrentStateNotSupported(NotImplementedError):
    """The engine cannot serve a model with recurrent (Mamba) layers yet."""

    def __init__(self, architecture: str) -> None:
        super().__init__(
            f"{architecture}: recurrent state cache not yet supported by the engine (its Mamba "
            "layers need a state slot per request); the model runs only through its own forward"
        )


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
        self, x: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor, batch: RecurrentBatch
    ) -> torch.Tensor:
        return x + self.mixer(self.norm(x), conv, ssm, batch)


class Mamba2Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
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


class Mamba2ForCausalLM(nn.Module):
    """Mamba-2 language model over a flat batch; ``forward`` returns the final hidden states."""

    def __init__(self, cfg: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        del max_positions  # no positions: the state carries them
        self.config = cfg
        self.model = Mamba2Model(cfg)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.vocab_size = cfg.vocab_size

    def recurrent_state_specs(self) -> list[RecurrentStateSpec]:
        """Per Mamba layer (all of them), what a request keeps."""
        return [cast(Mamba2Block, b).mixer.shape.state_spec() for b in self.model.layers]

    def kv_cache_specs(self) -> list[object]:
        raise RecurrentStateNotSupported(self.config.architecture)

    def new_states(self, num_slots: int, device: torch.device | str = "cpu") -> RecurrentStates:
        """State pools of ``num_slots`` requests (the stand-in for the engine's slots)."""
        dtype = self.model.embed_tokens.weight.dtype
        return RecurrentStates(self.recurrent_state_specs(), num_slots, dtype, device)

    def forward(
        self, input_ids: torch.Tensor, states: RecurrentStates, batch: RecurrentBatch
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` of the flat tokens ``input_ids [T]``; each row
        continues from its slot's state, left updated."""
        x = self.model.embed_tokens(input_ids)
        for i, block in enumerate(self.model.layers):
            x = block(x, states.conv[i], states.ssm[i], batch)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def reset_moe_stats(self) -> None:
        """No experts (the loader resets every model's)."""

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
