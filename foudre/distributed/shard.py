"""One rank's shard of a model: its config, its modules, its slices of the weights.

A rank never holds the whole model: from a safetensors checkpoint it reads only its slices
(``safe_open(...).get_slice(name)[rows]``); GGUF and llama2.c files yield whole tensors, one at
a time, which are cut at once. Quantization (``int8``, ``int4``) happens after the cut, each
rank rounding its own slices; the methods that calibrate through forwards of the whole model
(GPTQ, AWQ) are refused. Imported GPTQ and AWQ checkpoints are cut as codes (rows, or columns
in whole groups: ``loading.quantized.load_quantized``), each linear's packed tensors read
whole, one linear at a time; foudre's own quantized format (fused, packed) is refused.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any, cast

import torch
from torch import nn

from foudre.config import EngineConfig
from foudre.distributed.errors import ParallelConfigError
from foudre.distributed.experts import ExpertShard
from foudre.distributed.plan import ParallelPlan, check_parallel
from foudre.layers.linear import Linear
from foudre.layers.moe import Experts, SparseMoeBlock
from foudre.layers.parallel import TensorParallel
from foudre.layers.rotary import init_rotary_tables
from foudre.loading.errors import ModelLoadError
from foudre.loading.gguf import gguf_config, is_gguf_file, iter_gguf_weights, read_gguf
from foudre.loading.hf import (
    iter_safetensors_slices,
    iter_safetensors_weights,
    load_generation_config,
    load_hf_config,
    resolve_model_path,
)
from foudre.loading.llama2c import load_llama2c
from foudre.loading.loader import (
    LoadedModel,
    _find_llama2c_tokenizer,
    default_model,
    parse_dtype,
)
from foudre.loading.quantized import (
    is_quantized_checkpoint,
    load_quantized,
    read_quantization_config,
)
from foudre.models.config import ModelConfig
from foudre.models.llama import DecoderLayer, LlamaForCausalLM
from foudre.models.registry import build_model
from foudre.quant import quantize_model
from foudre.quant.qlinear import prepare_for_cpu

logger = logging.getLogger(__name__)

# quantization methods a shard applies to its own slices (round to nearest, no calibration)
SHARDED_QUANTIZATION = (None, "int8", "int4")


def model_source(config: EngineConfig) -> tuple[str, str | None]:
    """The model name and tokenizer of ``config`` (the default model when it names none)."""
    if config.model:
        return config.model, config.tokenizer
    name, tok = default_model()
    return name, config.tokenizer or tok


def read_config(config: EngineConfig) -> ModelConfig:
    """The model's config, read without its weights; ``ParallelConfigError`` when the engine's
    parallel sizes cannot split it (checked before any worker starts)."""
    name, _ = model_source(config)
    path = resolve_model_path(name, config.revision)
    if is_gguf_file(path):
        cfg = gguf_config(read_gguf(path))
    elif path.is_file():
        cfg, _ = load_llama2c(path)
    else:
        qc = read_quantization_config(path)
        if qc is not None and qc.get("quant_method") == "foudre":
            raise ParallelConfigError(
                "tensor_parallel_size",
                f"{path}: foudre's own quantized checkpoints do not load sharded (GPTQ and AWQ "
                "ones do); load the float model with quantization=int8 or int4",
            )
        cfg = load_hf_config(path)
    if config.quantization not in SHARDED_QUANTIZATION:
        raise ParallelConfigError(
            "quantization",
            f"quantization {config.quantization!r} does not run sharded; use int8 or int4",
        )
    check_parallel(cfg, config.tensor_parallel_size, config.pipeline_parallel_size)
    return cfg


def load_shard(
    config: EngineConfig, device: torch.device, plan: ParallelPlan, tp: TensorParallel | None
) -> LoadedModel:
    """This rank's shard of ``config.model``, its weights loaded (``LoadedModel.config`` is the
    whole model's; the shard's own is ``model.config``). ``ModelLoadError`` as ``load_model``."""
    name, tokenizer = model_source(config)
    path = resolve_model_path(name, config.revision)
    gen: dict[str, Any] = {}
    tok: str | None = tokenizer or str(path)
    weights: Iterable[tuple[str, torch.Tensor]]
    if is_gguf_file(path):
        gguf = read_gguf(path)
        cfg = gguf_config(gguf)
        if plan.rank == 0 and any(
            t.type_name not in ("F32", "F16", "BF16") for t in gguf.tensors.values()
        ):
            logger.warning(
                "%s: sharded GGUF weights are dequantized at load (each rank holds its slice in "
                "%s; quantization=int8|int4 re-quantizes the slices)",
                path.name,
                cfg.torch_dtype,
            )
        weights = _cut(_unfused(iter_gguf_weights(gguf, cfg), cfg), plan, cfg)
    elif path.is_file():
        cfg, state = load_llama2c(path)
        tok = tokenizer or _find_llama2c_tokenizer(path)
        weights = _cut(state.items(), plan, cfg)
    else:
        cfg = load_hf_config(path)
        gen = load_generation_config(path)
        if _stores_fused(cfg) and plan.tensor_parallel_size > 1:
            if is_quantized_checkpoint(path):
                raise ParallelConfigError(
                    "tensor_parallel_size",
                    f"{cfg.architecture}'s quantized checkpoints store qkv_proj and "
                    "gate_up_proj fused, which are not cut for tensor parallelism",
                )
            # each rank reads the fused tensors whole, one at a time, and keeps its slices
            weights = _cut(_unfused(iter_safetensors_weights(path), cfg), plan, cfg)
        else:
            weights = iter_safetensors_slices(path, partial(plan.select, cfg))
    check_parallel(cfg, plan.tensor_parallel_size, plan.pipeline_parallel_size)
    net = _build(
        cfg, plan, parse_dtype(cfg.torch_dtype if config.dtype == "auto" else config.dtype)
    )
    net = net.to_empty(device=device)
    init_rotary_tables(net, device)
    net.reset_moe_stats()
    if net.config.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    rows = net.config.vocab_size
    try:
        if not path.is_file() and is_quantized_checkpoint(path):  # GPTQ, AWQ: cut codes
            load_quantized(net, path, partial(plan.select, cfg), lambda w: _pad_vocab(w, rows))
        else:
            net.load_weights(_pad_vocab(weights, rows))
            if config.quantization is not None:
                quantize_model(net, config.quantization)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    prepare_for_cpu(net)  # as load_model
    if tp is not None:
        net.set_tensor_parallel(tp, cfg.vocab_size)
    net.eval()
    return LoadedModel(net, cfg, tok, gen, name)


def _build(cfg: ModelConfig, plan: ParallelPlan, dtype: torch.dtype) -> LlamaForCausalLM:
    """The shard's modules on the meta device: the local config's model, without the embedding
    off the first stage nor the head off the last (zero-row stand-ins), its experts cut."""
    local = plan.local_config(cfg)
    first_layer = plan.layers(cfg.num_hidden_layers).start
    with torch.device("meta"), warnings.catch_warnings():
        # the zero-row stand-ins have nothing to initialise, and torch says so
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors")
        net = build_model(local)
        net.first_layer = first_layer
        if not plan.is_first_stage:
            net.model.embed_tokens = nn.Embedding(0, cfg.hidden_size)
        if not plan.is_last_stage:
            net.lm_head = Linear(cfg.hidden_size, 0, bias=False)
        if plan.tensor_parallel_size > 1:
            for layer in net.model.layers:
                block = cast(DecoderLayer, layer).mlp
                if isinstance(block, SparseMoeBlock):
                    experts = plan.expert_range(cfg.num_experts)
                    own = Experts(len(experts), cfg.hidden_size, cfg.moe_intermediate_size)
                    block.experts = ExpertShard(own, experts.start, len(experts), cfg.num_experts)
    return net.to(dtype)


def _cut(
    weights: Iterable[tuple[str, torch.Tensor]], plan: ParallelPlan, cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Whole tensors (GGUF, llama2.c) cut to this rank's slices as they come."""
    for name, tensor in weights:
        chosen = plan.select(cfg, name, tuple(tensor.shape))
        if chosen is not None:
            new_name, index = chosen
            yield new_name, tensor if index is None else tensor[index].contiguous()


def _stores_fused(cfg: ModelConfig) -> bool:
    """Whether ``cfg``'s checkpoints store q|k|v and gate|up fused (Phi-3 / Phi-4)."""
    return cfg.architecture == "phi3"


def _unfused(
    weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The fused ``qkv_proj`` and ``gate_up_proj`` tensors of a checkpoint that stores them so,
    as their parts (``q_proj``, ``k_proj``, ``v_proj``; ``gate_proj``, ``up_proj``: views), so
    that ``ParallelPlan.select`` cuts each part by heads or rows as for the other families."""
    if not _stores_fused(cfg):
        yield from weights
        return
    qkv = {"q_proj": cfg.q_size, "k_proj": cfg.kv_size, "v_proj": cfg.kv_size}
    for name, tensor in weights:
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".qkv_proj"):
            stem = prefix.removesuffix("qkv_proj")
            for part, rows in zip(qkv, tensor.split(list(qkv.values())), strict=True):
                yield f"{stem}{part}.{leaf}", rows
        elif prefix.endswith(".gate_up_proj"):
            stem = prefix.removesuffix("gate_up_proj")
            gate, up = tensor.chunk(2)
            yield f"{stem}gate_proj.{leaf}", gate
            yield f"{stem}up_proj.{leaf}", up
        else:
            yield name, tensor


def _pad_vocab(
    weights: Iterable[tuple[str, torch.Tensor]], rows: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The embedding and head slices padded with zero rows to the shard's ``rows`` (the last
    rank's share of a vocabulary that ``T`` does not divide)."""
    for name, tensor in weights:
        if name in ("model.embed_tokens.weight", "lm_head.weight") and tensor.shape[0] < rows:
            pad = tensor.new_zeros(rows - tensor.shape[0], *tensor.shape[1:])
            tensor = torch.cat([tensor, pad])
        yield name, tensor
