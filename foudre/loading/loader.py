"""From a model name to a ready ``LlamaForCausalLM`` and tokenizer, whatever the format
(``load_tokenizer`` picks the tokenizer class for a file or directory)."""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from foudre.layers.moe import SparseMoeBlock, clamped_swiglu
from foudre.layers.rotary import init_rotary_tables
from foudre.loading.errors import ModelLoadError
from foudre.loading.fp8_blocks import dequantize_fp8_blocks, fp8_block_size
from foudre.loading.gguf import (
    GGUFFile,
    gguf_config,
    is_gguf_file,
    iter_gguf_weights,
    load_gguf_tokenizer,
    read_gguf,
)
from foudre.loading.gguf_quant import (
    GGUFQuantPlan,
    load_gguf_quantized,
    plan_gguf_quantized,
    swap_in_quantized,
)
from foudre.loading.hf import (
    iter_safetensors_weights,
    load_generation_config,
    load_hf_config,
    resolve_model_path,
)
from foudre.loading.llama2c import load_llama2c
from foudre.loading.memory import release_freed, releasing
from foudre.loading.quantized import (
    is_quantized_checkpoint,
    load_quantized,
    read_quantization_config,
)
from foudre.loading.tokenizer import (
    HFTokenizer,
    Llama2cTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
    _read_tokenizer_config,
)
from foudre.models.config import ModelConfig
from foudre.models.llama import LlamaForCausalLM
from foudre.models.registry import build_model
from foudre.native import huge_pages
from foudre.quant import quantize_model
from foudre.quant.experts import QuantExperts
from foudre.quant.mxfp4 import MXFP4Experts
from foudre.quant.qlinear import QuantLinear, prepare_for_cpu, uses_native_kernels

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}") from None


def shared_dir() -> Path:
    """The project's ``shared/`` data folder beside the repository (``FOUDRE_SHARED`` overrides)."""
    env = os.environ.get("FOUDRE_SHARED")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3] / "shared"


def default_model() -> tuple[str, str | None]:
    """The model used when none is named: the embedded one, else stories260K from shared/."""
    embedded = Path(__file__).resolve().parents[1] / "assets" / "models" / "target"
    if (embedded / "config.json").exists():
        return str(embedded), None
    stories = shared_dir() / "models" / "stories260K"
    if (stories / "stories260K.bin").exists():
        return str(stories / "stories260K.bin"), str(stories / "tok512.bin")
    raise ModelLoadError("no --model given and no default model is available")


@dataclass(slots=True)
class LoadedModel:
    model: LlamaForCausalLM
    config: ModelConfig
    tokenizer_path: str | None
    generation_config: dict[str, Any]
    name: str

    def eos_token_ids(self, tokenizer: Tokenizer | None) -> frozenset[int]:
        """Every id that ends generation: the config's, the generation config's and the
        tokenizer's end-of-sequence tokens."""
        eos = set(self.config.eos_token_ids)
        gen_eos = self.generation_config.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos.add(gen_eos)
        elif isinstance(gen_eos, list):
            eos.update(gen_eos)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        return frozenset(eos)


def _find_llama2c_tokenizer(path: Path) -> str | None:
    for name in ("tokenizer.bin", "tok512.bin"):
        if (path.parent / name).exists():
            return str(path.parent / name)
    candidates = sorted(path.parent.glob("tok*.bin"))
    return str(candidates[0]) if candidates else None


class _NoMetaInit(TorchFunctionMode):
    """Under it, ``normal_`` on a meta tensor (a module's initialisation while the model is built
    on ``meta``: an embedding's) does nothing. The tensor holds no values either way, but torch's
    meta ``normal_`` imports ``torch._dynamo``: about 2 s of a process's first ``load_model``,
    which nothing else here needs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.Tensor.normal_ or func is nn.init.normal_:
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def load_model(
    model: str,
    tokenizer: str | None,
    dtype: str,
    device: torch.device,
    max_positions: int | None,
    revision: str | None = None,
    quantization: str | None = None,
    gguf_dequantize: bool = False,
) -> LoadedModel:
    """Load config and weights from a HF directory, a hub id, a GGUF file or a llama2.c ``.bin``.

    A GGUF file is its own tokenizer (unless ``tokenizer`` names another); its Q4_0, Q4_1, Q4_K,
    Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 linears stay quantized (``gguf_quant``) unless
    ``quantization`` re-quantizes the model, ``gguf_dequantize`` is set (training, float
    references) or ``FOUDRE_GGUF_DEQUANTIZE=1``;
    its other tensors are dequantized to the model dtype (``dtype="auto"``: the file's float
    type, bfloat16 when quantized).
    """
    path = resolve_model_path(model, revision)
    weights: Iterable[tuple[str, torch.Tensor]]
    gen: dict[str, Any]
    tok: str | None
    gguf: GGUFFile | None = None
    if is_gguf_file(path):
        gguf = read_gguf(path)
        cfg = gguf_config(gguf)
        tok = tokenizer or str(path)
        gen = {}
    elif path.is_file():
        cfg, state = load_llama2c(path)
        weights = state.items()
        tok = tokenizer or _find_llama2c_tokenizer(path)
        gen = {}
    else:
        cfg = load_hf_config(path)
        weights = iter_safetensors_weights(path, mapped=True)  # copied where it goes
        fp8_block = fp8_block_size(read_quantization_config(path), path)
        if fp8_block is not None:  # DeepSeek-V3's release: float8 weights, block scales
            weights = dequantize_fp8_blocks(weights, fp8_block)
        tok = tokenizer or str(path)
        gen = load_generation_config(path)
    torch_dtype = parse_dtype(cfg.torch_dtype if dtype == "auto" else dtype)
    with torch.device("meta"), _NoMetaInit():
        net = build_model(cfg, max_positions)
        if cfg.mxfp4_experts:
            _swap_in_mxfp4_experts(net, cfg)
    net = net.to(torch_dtype)  # still on meta: nothing is allocated before the swaps below
    plan = GGUFQuantPlan()
    if gguf is not None:
        if quantization is None and not gguf_dequantize:
            six_bit = device.type == "cpu" and uses_native_kernels(torch_dtype)
            grouped8 = device.type == "cuda" or six_bit
            plan = plan_gguf_quantized(gguf, net, grouped8, six_bit)
            swap_in_quantized(net, plan)
        weights = iter_gguf_weights(gguf, cfg, skip=plan.consumed, dtype=torch_dtype)
    checkpoint = not path.is_file() and is_quantized_checkpoint(path)
    in_place = _allocate(net, device, quantization is None and not checkpoint)
    init_rotary_tables(net, device)  # the tables built under "meta" hold no values
    net.reset_moe_stats()  # nor do the routers' counters
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    try:
        if checkpoint:
            load_quantized(net, path)  # foudre, GPTQ or AWQ checkpoint: no re-quantization
        else:
            _fill(net, weights, gguf, cfg, plan, quantization)
    except ValueError as e:
        raise ModelLoadError(f"{path}: {e}") from None
    prepare_for_cpu(net)
    release_freed()
    if in_place:
        huge_pages.seal(net)
    net.eval()
    return LoadedModel(net, cfg, tok, gen, model)


def _allocate(net: nn.Module, device: torch.device, in_place: bool) -> bool:
    """Memory for ``net`` (built on ``meta``). On the CPU, where ``in_place``, its weights go
    straight into the map they run from (``huge_pages.allocate``); not those replaced
    once loaded (a GGUF file's kept quantized linears: their layouts are built of them). Not
    ``in_place``: quantized at load, or a quantized checkpoint (whose linears are replaced
    unloaded, but each huge page a norm between them touches would be resident whole).
    Returns whether the weights went into huge pages so."""
    if device.type == "cpu" and in_place and huge_pages.allocate(net, (QuantLinear, QuantExperts)):
        return True
    huge_pages.to_empty(net, device)
    return False


def _fill(
    net: LlamaForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    gguf: GGUFFile | None,
    cfg: ModelConfig,
    plan: GGUFQuantPlan,
    quantization: str | None,
) -> None:
    """The weights into ``net`` (allocated), a tensor at a time; then a GGUF file's kept
    quantized linears, and the quantization asked for."""
    net.load_weights(releasing(weights))
    if gguf is not None:
        load_gguf_quantized(gguf, cfg, net, plan)
    if quantization is not None:
        quantize_model(net, quantization)


def _swap_in_mxfp4_experts(net: nn.Module, cfg: ModelConfig) -> None:
    """gpt-oss's experts as an MXFP4 checkpoint stores them: ``MXFP4Experts`` in every layer
    (packed blocks and scales loaded as they are, never expanded; gate|up rows interleaved as
    stored, the clamped SwiGLU reading them so)."""
    activation = partial(
        clamped_swiglu, alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit, interleaved=True
    )
    for layer in cast(LlamaForCausalLM, net).model.layers:
        block = cast(SparseMoeBlock, cast(Any, layer).mlp)
        block.experts = MXFP4Experts(
            cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, True, activation
        )


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load the tokenizer at ``path``: a model directory or a tokenizer file.

    A directory gives ``tokenizer.json`` (preferred), else ``tokenizer.model``, else
    ``tokenizer.bin`` (llama2.c); its ``tokenizer_config.json``, when present, supplies special
    tokens, ``add_bos_token`` and the chat template. A GGUF file (``.gguf`` or its magic bytes)
    gives the tokenizer stored in its metadata. Another file is read by its suffix: ``.json``,
    ``.model`` or llama2.c ``.bin``. Raises ``ModelLoadError`` naming the path otherwise.
    """
    path = Path(path).expanduser()
    if is_gguf_file(path):
        return load_gguf_tokenizer(path)
    if path.is_dir():
        for name in ("tokenizer.json", "tokenizer.model", "tokenizer.bin"):
            if (path / name).is_file():
                return load_tokenizer(path / name)
        raise ModelLoadError(
            f"{path}: no tokenizer.json, tokenizer.model or tokenizer.bin in directory", path
        )
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such tokenizer file or directory", path)
    if path.suffix == ".json":
        return HFTokenizer(path, _read_tokenizer_config(path.parent))
    if path.suffix == ".model":
        return SentencePieceTokenizer(path, _read_tokenizer_config(path.parent))
    if path.suffix == ".bin":
        return Llama2cTokenizer(path)
    raise ModelLoadError(
        f"{path}: unknown tokenizer format; expected tokenizer.json, a sentencepiece .model or "
        "a llama2.c tokenizer .bin",
        path,
    )


def load_tokenizer_for(loaded: LoadedModel) -> Tokenizer:
    if loaded.tokenizer_path is None:
        raise ModelLoadError(f"{loaded.name}: no tokenizer found; pass --tokenizer")
    return load_tokenizer(loaded.tokenizer_path)
