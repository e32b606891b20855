"""The proposer behind each ``speculative_method``: one factory per name, built from the
engine's configuration and what the engine knows of its target."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from foudre.attention import get_backend
from foudre.attention.cache_spec import recurrent_layers
from foudre.config import EngineConfig
from foudre.loading.loader import default_model, load_model
from foudre.speculative.proposers import BlockManager, DraftModelProposer, NgramProposer, Proposer


@dataclass(slots=True)
class ProposerContext:
    """What a proposer may need of its engine: the configuration, the target's device, dtype,
    vocabulary and context, and a factory of block managers the size of the target's pool."""

    config: EngineConfig
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    num_blocks: int
    make_block_manager: Callable[[], BlockManager]


def _ngram(ctx: ProposerContext) -> Proposer:
    cfg = ctx.config
    return NgramProposer(cfg.num_speculative_tokens, cfg.ngram_min, cfg.ngram_max)


def _draft(ctx: ProposerContext) -> Proposer:
    cfg = ctx.config
    draft_name = cfg.speculative_model
    if draft_name is None:
        embedded = default_model()[0]
        if cfg.model is not None or not embedded.endswith("target"):
            raise ValueError(
                "speculative_method='draft' needs speculative_model (a draft model with the "
                "target's tokenizer); only the embedded target has a default draft"
            )
        draft_name = str(Path(embedded).parent / "draft")
    dtype = cfg.dtype if cfg.dtype != "auto" else str(ctx.dtype).removeprefix("torch.")
    draft = load_model(
        draft_name, None, dtype, ctx.device, None, None, cfg.speculative_quantization
    )
    if recurrent_layers(draft.model.kv_cache_specs()):
        raise ValueError(
            f"speculative_model: {draft.config.architecture} has recurrent layers, whose state "
            "a draft model does not keep; use a transformer draft or speculative_method='ngram'"
        )
    if draft.config.max_position_embeddings < ctx.max_model_len:
        raise ValueError(
            f"the draft model's max_position_embeddings {draft.config.max_position_embeddings}"
            f" is below max_model_len {ctx.max_model_len}"
        )
    return DraftModelProposer(
        draft.model,
        get_backend(cfg.attention_backend, ctx.device),
        cfg.num_speculative_tokens,
        ctx.make_block_manager(),
        ctx.num_blocks,
        ctx.device,
        next(draft.model.parameters()).dtype,
        ctx.vocab_size,
        cfg.seed,
        decode_graphs=not cfg.enforce_eager,
        max_num_seqs=cfg.max_num_seqs,
        max_model_len=ctx.max_model_len,
    )


PROPOSERS: dict[str, Callable[[ProposerContext], Proposer]] = {
    "draft": _draft,
    "ngram": _ngram,
}


def make_proposer(ctx: ProposerContext) -> Proposer | None:
    """The proposer of ``ctx.config.speculative_method`` (None without speculation);
    ``ValueError`` for an unknown method."""
    method = ctx.config.speculative_method
    if method is None:
        return None
    factory = PROPOSERS.get(method)
    if factory is None:
        raise ValueError(
            f"speculative_method must be one of {', '.join(PROPOSERS)}, got {method!r}"
        )
    return factory(ctx)
