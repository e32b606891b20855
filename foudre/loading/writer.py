"""Writing checkpoints: foudre's model as a Hugging Face directory (``config.json``,
``model.safetensors`` under the Hugging Face names, ``generation_config.json``, the tokenizer
files), which transformers and foudre both load.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from foudre.models.config import ModelConfig
from foudre.models.llama import LlamaForCausalLM

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "tokenizer.bin",
)


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The weights under Hugging Face names: fused q|k|v and gate|up split back, no tied head,
    experts one tensor per expert and projection (Mixtral's ``block_sparse_moe.experts.{e}.w1``
    names, the others' ``mlp.experts.{e}.gate_proj``), as transformers writes them, in the
    model's own dtypes; Phi-3's fused q|k|v and gate|up stay fused, as its checkpoints store
    them."""
    cfg = model.config
    if cfg.architecture == "gpt_oss":
        return _gpt_oss_state_dict(model)
    fused = cfg.architecture == "phi3"
    out: dict[str, torch.Tensor] = {}
    mixtral = cfg.architecture == "mixtral"
    parts = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    for name, tensor in model.state_dict().items():
        t = tensor.detach().contiguous()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if mixtral:
            name = name.replace(".mlp.", ".block_sparse_moe.")
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith(".experts"):  # stacked [E, ...]: one tensor per expert
            if leaf not in ("gate_up_proj", "down_proj"):
                raise ValueError(f"{name}: quantized experts are not written as a checkpoint")
            for e, w in enumerate(t):
                if leaf == "down_proj":
                    out[f"{prefix}.{e}.{parts[2]}.weight"] = w.contiguous()
                else:
                    gate, up = w.split(w.shape[0] // 2, dim=0)
                    out[f"{prefix}.{e}.{parts[0]}.weight"] = gate.contiguous()
                    out[f"{prefix}.{e}.{parts[1]}.weight"] = up.contiguous()
        elif fused:
            out[name] = t
        elif prefix.endswith("qkv_proj"):
            base = prefix.removesuffix("qkv_proj")
            q, k, v = t.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=0)
            for part, value in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{base}{part}.{leaf}"] = value.contiguous()
        elif prefix.endswith("gate_up_proj"):
            base = prefix.removesuffix("gate_up_proj")
            gate, up = t.split(t.shape[0] // 2, dim=0)
            out[f"{base}gate_proj.{leaf}"] = gate.contiguous()
            out[f"{base}up_proj.{leaf}"] = up.contiguous()
        else:
            out[name] = t
    return out


def _gpt_oss_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """gpt-oss's weights as transformers names and lays them out: q|k|v split back (weights and
    biases), the router under ``mlp.router``, the experts stacked with gate and up interleaved
    in the columns of ``gate_up_proj`` ``[E, hidden, 2I]`` and ``down_proj`` ``[E, I,
    hidden]``. ``ValueError`` for packed (MXFP4) or quantized experts."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach()
        prefix, _, leaf = name.rpartition(".")
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if prefix.endswith("qkv_proj"):
            base = prefix.removesuffix("qkv_proj")
            q, k, v = t.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=0)
            for part, value in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{base}{part}.{leaf}"] = value.contiguous()
        elif prefix.endswith(".mlp.gate"):
            out[f"{prefix.removesuffix('gate')}router.{leaf}"] = t.contiguous()
        elif prefix.endswith(".experts"):
            if leaf not in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                raise ValueError(f"{name}: packed or quantized experts are not written")
            if leaf.startswith("gate_up_proj"):  # [gate | up] rows -> gate, up interleaved
                gate, up = t.chunk(2, dim=1)
                t = torch.stack([gate, up], dim=2).flatten(1, 2)
            if leaf in ("gate_up_proj", "down_proj"):  # [E, out, in] -> [E, in, out]
                t = t.transpose(1, 2)
            out[name] = t.contiguous()
        else:
            out[name] = t.contiguous()
    return out


def hf_config_dict(cfg: ModelConfig, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """``config.json`` content that transformers and foudre both read as ``cfg``, its
    ``torch_dtype`` the float type of the weights written (``cfg``'s when not given)."""
    eos: int | list[int] | None = cfg.eos_token_ids
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    elif not eos:
        eos = None
    if cfg.architecture not in _HF_CLASSES:  # DeepSeek-V3's keys are not written
        raise ValueError(f"writing {cfg.architecture} checkpoints is not supported")
    raw: dict[str, Any] = {
        "architectures": [_HF_CLASSES[cfg.architecture]],
        "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "torch_dtype": cfg.torch_dtype if dtype is None else str(dtype).removeprefix("torch."),
    }
    if cfg.rope_scaling:
        raw["rope_parameters"] = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
        raw["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.sliding_window is not None:
        raw["sliding_window"] = cfg.sliding_window
        raw["use_sliding_window"] = True
        if cfg.layer_types is not None:
            raw["layer_types"] = list(cfg.layer_types)
    if cfg.num_experts:
        raw.update(_moe_config(cfg))
    if cfg.architecture == "phi3":
        raw.update(_phi3_config(cfg))
    if cfg.architecture == "gemma3":
        _gemma3_config(cfg, raw)
    return raw


def _phi3_config(cfg: ModelConfig) -> dict[str, Any]:
    """Phi-3's own keys: the rotated fraction, the original context of LongRoPE (at the top
    level, where transformers reads it first), and no pad id (its default, 32000, may lie
    past a small vocabulary)."""
    raw: dict[str, Any] = {"partial_rotary_factor": cfg.partial_rotary_factor, "pad_token_id": None}
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    raw["rope_parameters"]["partial_rotary_factor"] = cfg.partial_rotary_factor
    if cfg.rope_scaling:
        raw["rope_parameters"].update(cfg.rope_scaling)
        original = cfg.rope_scaling.get("original_max_position_embeddings")
        if original is not None:
            raw["original_max_position_embeddings"] = original
    return raw


def _gemma3_config(cfg: ModelConfig, raw: dict[str, Any]) -> None:
    """``raw`` made a ``gemma3_text`` config: its activation, score scale, soft-capping, and
    RoPE per layer type as transformers 5 writes it; every layer's type given (none slides
    without a window: Gemma3TextConfig's defaults would make five in six slide)."""
    for key in ("hidden_act", "rope_theta", "rope_scaling", "use_sliding_window"):
        raw.pop(key, None)
    scalar = cfg.query_pre_attn_scalar or cfg.head_dim
    layer_types = cfg.layer_types
    if layer_types is None:  # one kind everywhere: the window's, or full attention
        kind = "full_attention" if cfg.sliding_window is None else "sliding_attention"
        layer_types = (kind,) * cfg.num_hidden_layers
    raw.update(
        model_type="gemma3_text",
        hidden_activation="gelu_pytorch_tanh",
        # transformers' config field is an int
        query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
        final_logit_softcapping=cfg.final_logit_softcapping,
        attn_logit_softcapping=None,
        sliding_window=cfg.sliding_window,
        layer_types=list(layer_types),
        rope_parameters={
            "full_attention": {
                "rope_type": "default",
                **(cfg.rope_scaling or {}),
                "rope_theta": cfg.rope_theta,
            },
            "sliding_attention": {
                "rope_type": "default",
                **(cfg.rope_local_scaling or {}),
                "rope_theta": cfg.rope_local_theta,
            },
        },
    )


def _moe_config(cfg: ModelConfig) -> dict[str, Any]:
    """The mixture-of-experts keys of ``config.json`` for ``cfg``'s architecture."""
    if cfg.architecture == "gpt_oss":  # every layer sparse, its clamped SwiGLU
        return {
            "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.num_experts_per_tok,
            "intermediate_size": cfg.moe_intermediate_size,
            "swiglu_alpha": cfg.swiglu_alpha,
            "swiglu_limit": cfg.swiglu_limit,
        }
    raw: dict[str, Any] = {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob,
    }
    if cfg.architecture in ("mixtral", "olmoe"):  # every layer sparse, experts of this size
        dense = cfg.mlp_only_layers or cfg.decoder_sparse_step != 1
        if dense or cfg.shared_expert_intermediate_size:
            raise ValueError(f"{cfg.architecture} has neither dense layers nor shared experts")
        raw["intermediate_size"] = cfg.moe_intermediate_size
        if cfg.architecture == "mixtral":
            raw["num_local_experts"] = raw.pop("num_experts")
        else:
            raw["clip_qkv"] = cfg.clip_qkv
        return raw
    raw.update(
        moe_intermediate_size=cfg.moe_intermediate_size,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
    )
    if cfg.architecture == "qwen2_moe":
        raw["shared_expert_intermediate_size"] = cfg.shared_expert_intermediate_size
        raw["qkv_bias"] = cfg.attention_bias
    return raw


def save_hf(
    model: LlamaForCausalLM, output: str | Path, tokenizer_source: str | Path | None = None
) -> Path:
    """Write ``model`` as a Hugging Face directory: config.json, model.safetensors,
    generation_config.json, and the tokenizer files found at ``tokenizer_source`` (a directory,
    or a single tokenizer file copied under its standard name). Returns the directory."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    write_configs(out, hf_config_dict(model.config, float_dtype(model)), model.config)
    save_file(hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_source is not None:
        copy_tokenizer(tokenizer_source, out)
    return out


def float_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of ``model``'s floating-point parameters (float32 when it has none)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def write_configs(out: Path, raw: dict[str, Any], cfg: ModelConfig) -> None:
    """``config.json`` (``raw``) and ``generation_config.json`` (``cfg``'s BOS and EOS ids)."""
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    generation: dict[str, Any] = {"bos_token_id": cfg.bos_token_id}
    if cfg.eos_token_ids:
        eos = cfg.eos_token_ids
        generation["eos_token_id"] = eos[0] if len(eos) == 1 else list(eos)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def copy_tokenizer(source: str | Path, output: Path) -> None:
    """Copy the tokenizer at ``source`` (directory or file) into ``output`` (no-op if same)."""
    src = Path(source)
    if src.is_file():
        from foudre.loading.gguf import is_gguf_file, load_gguf_tokenizer

        if is_gguf_file(src):  # the vocabulary lives in the file's metadata: export it
            tok = load_gguf_tokenizer(src)
            save = getattr(tok, "save", None)
            if save is None:
                raise ValueError(f"{src}: cannot export this GGUF file's tokenizer")
            save(output)
            return
        name = src.name if src.suffix != ".bin" else "tokenizer.bin"
        files = [(src, name)]
        if src.suffix == ".json" and (src.parent / "tokenizer_config.json").is_file():
            files.append((src.parent / "tokenizer_config.json", "tokenizer_config.json"))
    else:
        files = [(src / n, n) for n in TOKENIZER_FILES if (src / n).is_file()]
    for path, name in files:
        dest = output / name
        if dest.resolve() != path.resolve():
            shutil.copyfile(path, dest)
