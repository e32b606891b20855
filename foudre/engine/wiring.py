"""How an engine is put together from its configuration: the device, the model, the KV-cache
manager, the scheduler, the model runner and the proposer. Plain functions: ``LLMEngine`` calls
them once and keeps what they build."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from foudre.attention import get_backend
from foudre.attention.cache_spec import KVCacheGroup, kv_cache_groups
from foudre.config import EngineConfig
from foudre.engine.kv_cache import KVCacheManager
from foudre.engine.policies import make_policy
from foudre.engine.scheduler import Scheduler
from foudre.engine.state_slots import StateSlots
from foudre.loading.loader import LoadedModel, default_model, load_model
from foudre.models.config import ModelConfig
from foudre.models.llama import LlamaForCausalLM
from foudre.runner.model_runner import ModelRunner, StatePlan
from foudre.runner.model_runner import state_plan as model_state_plan
from foudre.speculative.proposers import Proposer
from foudre.speculative.registry import ProposerContext, make_proposer

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_max_model_len(config: EngineConfig, mcfg: ModelConfig) -> int:
    """``max_model_len`` as given or the model's (a sliding window does not limit it: every
    attention backend computes the window). ``ValueError`` above the model's positions."""
    max_len = config.max_model_len or mcfg.max_position_embeddings
    if max_len > mcfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's "
            f"max_position_embeddings {mcfg.max_position_embeddings}"
        )
    return max_len


def load(config: EngineConfig, device: torch.device) -> tuple[str, LoadedModel]:
    """The model named by ``config`` (the embedded default when none is), and its name."""
    model, default_tok = (config.model, None) if config.model else default_model()
    loaded = load_model(
        model,
        config.tokenizer or default_tok,
        config.dtype,
        device,
        None,
        config.revision,
        config.quantization,
    )
    return model, loaded


def check_capacity(num_blocks: int, config: EngineConfig, max_model_len: int) -> None:
    if num_blocks * config.block_size < max_model_len:
        raise ValueError(
            f"the KV cache holds {num_blocks * config.block_size} tokens, fewer than "
            f"max_model_len {max_model_len}; give more KV memory or a smaller max_model_len"
        )


def kv_groups(model: LlamaForCausalLM, parallel: bool) -> list[KVCacheGroup]:
    """The model's KV cache groups (``attention/cache_spec.py``): by sliding window, so that
    window layers return the blocks behind their window; one group of full attention across
    parallel ranks (their windows then keep their blocks): the engine's shard is one pipeline
    stage, whose layers may all slide where another stage's attend to everything."""
    groups = kv_cache_groups(model.kv_cache_specs())
    if parallel:  # (the engine's shard holds one stage's layers: the others may need all)
        if any(g.window is not None for g in groups):
            logger.info("KV cache: one group across parallel ranks (windows keep their blocks)")
        return [KVCacheGroup(None, tuple(sorted(i for g in groups for i in g.layers)))]
    if len(groups) > 1:
        windows = sorted({g.window or 0 for g in groups})
        logger.info(
            "KV cache: %d layer groups of %d layers (windows %s; 0: full attention)",
            len(groups),
            len(groups[0].layers),
            windows,
        )
    return groups


def block_manager(
    config: EngineConfig,
    num_blocks: int,
    max_model_len: int,
    model: LlamaForCausalLM | None = None,
    groups: Sequence[KVCacheGroup] = (),
    states: StatePlan | None = None,
) -> KVCacheManager:
    """The KV-cache manager; ``model``'s rotary tells it the RoPE position offset of a
    sequence (LongRoPE: see ``RotaryEmbedding``), which the scheduler passes on to the rows;
    ``groups``, the layers' cache groups (none: one group of full attention); ``states``, a
    recurrent model's state slots."""
    contiguous = config.kv_allocation == "contiguous"
    rotary = None if model is None else getattr(model.model, "rotary", None)
    slots = None
    if states is not None:
        slots = StateSlots(
            states.num_slots, states.num_snapshots, states.snapshot_every, states.bytes_per_slot
        )
    return KVCacheManager(
        num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        reserve_tokens=max_model_len if contiguous else None,
        copy_on_write=config.copy_on_write,
        rope_offset=rotary.position_offset if rotary and rotary.original is not None else None,
        windows=[g.window for g in groups] or [None],
        states=slots,
    )


def scheduler(config: EngineConfig, kv: KVCacheManager, max_model_len: int) -> Scheduler:
    max_batched = config.max_num_batched_tokens
    if not config.enable_chunked_prefill:
        max_batched = max(max_batched, max_model_len)
    return Scheduler(
        kv,
        max_batched,
        config.max_num_seqs,
        max_model_len,
        config.enable_chunked_prefill,
        make_policy(config.scheduling_policy, config.max_num_seqs, config.batch_wait_ms),
    )


def runner(
    config: EngineConfig,
    model: LlamaForCausalLM,
    num_blocks: int,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    groups: Sequence[KVCacheGroup] | None = None,
    states: StatePlan | None = None,
) -> ModelRunner:
    return ModelRunner(
        model,
        get_backend(config.attention_backend, device, config.kv_cache_dtype),
        num_blocks,
        config.block_size,
        device,
        dtype,
        config.seed,
        config.kv_cache_dtype,
        decode_graphs=not config.enforce_eager,
        max_num_seqs=config.max_num_seqs,
        max_model_len=max_model_len,
        kv_groups=groups,
        num_state_slots=0 if states is None else states.total_slots,
        num_scratch_state_slots=0 if states is None else states.num_scratch,
    )


def state_plan(
    config: EngineConfig, model: LlamaForCausalLM, device: torch.device
) -> StatePlan | None:
    """A recurrent model's state slots (None for a transformer); ``ValueError`` naming what a
    recurrent model cannot run with yet (tensor or pipeline parallelism)."""
    plan = model_state_plan(model, config, device)
    if plan is None:
        return None
    arch = model.config.architecture
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        raise ValueError(
            f"tensor_parallel_size / pipeline_parallel_size: {arch} has recurrent layers, "
            "which the parallel runners do not hold yet; run it on one device"
        )
    if config.enable_prefix_caching and plan.num_snapshots == 0:
        logger.info("prefix caching: no snapshots of the recurrent state, so no prefix hits")
    logger.info(
        "recurrent state: %d slots of %d bytes (max_num_seqs at most that), %d prefix-cache "
        "snapshots (every %d blocks)",
        plan.num_slots,
        plan.bytes_per_slot,
        plan.num_snapshots,
        plan.snapshot_every,
    )
    return plan


def proposer(
    config: EngineConfig,
    device: torch.device,
    dtype: torch.dtype,
    vocab_size: int,
    max_model_len: int,
    num_blocks: int,
) -> Proposer | None:
    """The speculative proposer ``config`` asks for (a draft model gets a KV cache of its own,
    as many blocks as the target's), or None."""
    return make_proposer(
        ProposerContext(
            config,
            device,
            dtype,
            vocab_size,
            max_model_len,
            num_blocks,
            lambda: KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching),
        )
    )
