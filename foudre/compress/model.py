"""foudre's Llama as a plain full-sequence model: build, forward, export as a HF directory.

The inference model runs over a paged KV cache; for training and evaluation the same modules
run through ``CausalBackend`` (``foudre/runner/attention/causal.py``), which attends causally
within each row of a ``[B, T]`` batch and keeps no cache. The forward therefore has exactly the
weights and numerics of the served model.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from foudre.loading.loader import load_model
from foudre.loading.tokenizer import Tokenizer, load_tokenizer
from foudre.models.config import ModelConfig
from foudre.models.llama import LlamaForCausalLM
from foudre.runner.attention.causal import causal_hidden

_HF_CLASSES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "tokenizer.bin",
)


def causal_logits(
    model: LlamaForCausalLM, ids: torch.Tensor, kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """Float32 logits ``[B, T, vocab]``: row ``i``'s token ``t`` sees tokens ``0..t`` of row i."""
    hidden = causal_hidden(model, ids, kv_cache_dtype)
    return model.compute_logits(hidden)


def full_sequence_logits(
    model: LlamaForCausalLM, ids: list[int] | torch.Tensor, kv_cache_dtype: str = "auto"
) -> torch.Tensor:
    """Float32 logits ``[T, vocab]`` of one sequence, computed in a single forward."""
    t = torch.as_tensor(ids, dtype=torch.long, device=model.lm_head.weight.device)
    return causal_logits(model, t.view(1, -1), kv_cache_dtype)[0]


def new_model(cfg: ModelConfig, seed: int = 0) -> LlamaForCausalLM:
    """A freshly initialised float32 model: N(0, 0.02) weights, residual outputs scaled by
    1/sqrt(2 * layers) (GPT-2's rule), unit norms. Deterministic for a given ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    std = 0.02
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2:
                if name.endswith("bias"):
                    p.zero_()
                else:
                    p.fill_(1.0)
                continue
            scale = (
                std / math.sqrt(2 * cfg.num_hidden_layers)
                if name.endswith(("o_proj.weight", "down_proj.weight"))
                else std
            )
            p.copy_(torch.randn(p.shape, generator=generator) * scale)
    return model


def load_trainable(path: str, tokenizer: str | None = None) -> tuple[LlamaForCausalLM, str | None]:
    """Any model foudre loads (HF dir, llama2.c ``.bin``), as float32 on CPU, in train mode;
    with the path of its tokenizer (None when none was found)."""
    loaded = load_model(path, tokenizer, "float32", torch.device("cpu"), None)
    loaded.model.train()
    return loaded.model, loaded.tokenizer_path


def load_for_eval(
    path: str, tokenizer: str | None = None, quantization: str | None = None
) -> tuple[LlamaForCausalLM, Tokenizer]:
    """A model foudre loads, as float32 on CPU in eval mode (weights quantized at load when
    ``quantization`` names a method), with its tokenizer."""
    loaded = load_model(path, tokenizer, "float32", torch.device("cpu"), None, None, quantization)
    loaded.model.requires_grad_(False)
    if loaded.tokenizer_path is None:
        raise ValueError(f"{path}: no tokenizer found; pass --tokenizer")
    return loaded.model, load_tokenizer(loaded.tokenizer_path)


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The weights under Hugging Face names: fused q|k|v and gate|up split back, no tied head."""
    cfg = model.config
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        t = tensor.detach().float().contiguous()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        prefix, _, leaf = name.rpartition(".")
        if prefix.endswith("qkv_proj"):
            base = prefix.removesuffix("qkv_proj")
            q, k, v = t.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=0)
            for part, value in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                out[f"{base}{part}.{leaf}"] = value.contiguous()
        elif prefix.endswith("gate_up_proj"):
            base = prefix.removesuffix("gate_up_proj")
            gate, up = t.split(cfg.intermediate_size, dim=0)
            out[f"{base}gate_proj.{leaf}"] = gate.contiguous()
            out[f"{base}up_proj.{leaf}"] = up.contiguous()
        else:
            out[name] = t
    return out


def hf_config_dict(cfg: ModelConfig) -> dict[str, Any]:
    """``config.json`` content that transformers and foudre both read as ``cfg``."""
    eos: int | list[int] | None = cfg.eos_token_ids
    if isinstance(eos, list) and len(eos) == 1:
        eos = eos[0]
    elif not eos:
        eos = None
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
        "torch_dtype": "float32",
    }
    if cfg.rope_scaling:
        raw["rope_parameters"] = {**cfg.rope_scaling, "rope_theta": cfg.rope_theta}
        raw["rope_scaling"] = dict(cfg.rope_scaling)
    if cfg.sliding_window is not None:
        raw["sliding_window"] = cfg.sliding_window
        raw["use_sliding_window"] = True
    return raw


def save_hf(
    model: LlamaForCausalLM, output: str | Path, tokenizer_source: str | Path | None = None
) -> Path:
    """Write ``model`` as a Hugging Face directory: config.json, model.safetensors,
    generation_config.json, and the tokenizer files found at ``tokenizer_source`` (a directory,
    or a single tokenizer file copied under its standard name). Returns the directory."""
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    (out / "config.json").write_text(json.dumps(hf_config_dict(cfg), indent=2) + "\n")
    generation: dict[str, Any] = {"bos_token_id": cfg.bos_token_id}
    if cfg.eos_token_ids:
        generation["eos_token_id"] = (
            cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else list(cfg.eos_token_ids)
        )
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    save_file(hf_state_dict(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_source is not None:
        copy_tokenizer(tokenizer_source, out)
    return out


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


def num_parameters(model: torch.nn.Module) -> int:
    """Distinct parameters (a tied head counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
