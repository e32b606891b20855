"""Structured pruning: whole layers, whole KV groups of attention heads, FFN channels.

Importance is measured on calibration text:

* layers: the increase of the calibration loss when the layer is skipped, removed greedily one
  at a time (each removal re-measures the others);
* attention: per KV group (a KV head with the query heads that share it, removed together so
  that GQA stays valid), the sum over its query heads of the mean L2 norm of the head's output
  (the input of ``o_proj``) times the Frobenius norm of its ``o_proj`` columns;
* FFN: per channel, the mean |silu(gate) * up| times the L2 norm of its ``down_proj`` column.

Without calibration text, activations are taken as 1 (weight norms only) and layers are ranked
by the norm of their output projections. Every layer keeps the same number of heads and
channels (one config for all), chosen per layer by its own scores.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import cast

import torch

from foudre.compress.data import fixed_batches, read_split, token_stream
from foudre.compress.model import load_trainable, num_parameters
from foudre.layers.mlp import GatedMLP
from foudre.loading.loader import load_tokenizer
from foudre.loading.writer import hf_state_dict, save_hf
from foudre.models.causal import causal_hidden
from foudre.models.llama import DecoderLayer, LlamaForCausalLM
from foudre.models.registry import build_model

log = logging.getLogger(__name__)


@torch.no_grad()
def _calibration_loss(
    model: LlamaForCausalLM, batches: list[tuple[torch.Tensor, torch.Tensor]]
) -> float:
    from foudre.compress.train import evaluate_loss

    return evaluate_loss(model, batches)


def _layers(model: LlamaForCausalLM) -> list[DecoderLayer]:
    return [cast(DecoderLayer, layer) for layer in model.model.layers]


def _mlp(layer: DecoderLayer) -> GatedMLP:
    assert isinstance(layer.mlp, GatedMLP), "pruning mixture-of-experts layers is not supported"
    return layer.mlp


@torch.no_grad()
def rank_layers_to_drop(
    model: LlamaForCausalLM, batches: list[tuple[torch.Tensor, torch.Tensor]] | None, n: int
) -> list[int]:
    """Indices (into the original layers) of the ``n`` layers to remove, least important first."""
    original = _layers(model)
    remaining = list(range(len(original)))
    dropped: list[int] = []
    if n >= len(original):
        raise ValueError(f"cannot remove {n} of {len(original)} layers")
    for _ in range(n):
        scores: dict[int, float] = {}
        for idx in remaining:
            if batches:
                kept = [original[i] for i in remaining if i != idx]
                model.model.layers = torch.nn.ModuleList(kept)
                scores[idx] = _calibration_loss(model, batches)
            else:
                layer = original[idx]
                scores[idx] = float(
                    layer.self_attn.o_proj.weight.norm() + _mlp(layer).down_proj.weight.norm()
                )
        best = min(scores, key=lambda i: scores[i])
        dropped.append(best)
        remaining.remove(best)
    model.model.layers = torch.nn.ModuleList(original)
    return dropped


@torch.no_grad()
def measure_activations(
    model: LlamaForCausalLM, batches: list[tuple[torch.Tensor, torch.Tensor]] | None
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per layer: mean L2 norm of each query head's output ``[heads]``, and mean |activation|
    of each FFN channel ``[intermediate]``, over the calibration batches (ones without)."""
    cfg = model.config
    n_layers = len(model.model.layers)
    head_act = [torch.zeros(cfg.num_attention_heads) for _ in range(n_layers)]
    ffn_act = [torch.zeros(cfg.intermediate_size) for _ in range(n_layers)]
    if not batches:
        return [a + 1 for a in head_act], [a + 1 for a in ffn_act]
    count = 0
    hooks = []
    for i, layer in enumerate(_layers(model)):

        def attn_hook(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], i: int = i) -> None:
            x = args[0].float().view(-1, cfg.num_attention_heads, cfg.head_dim)
            head_act[i] += x.norm(dim=-1).sum(0)

        def ffn_hook(_m: torch.nn.Module, args: tuple[torch.Tensor, ...], i: int = i) -> None:
            ffn_act[i] += args[0].float().abs().reshape(-1, cfg.intermediate_size).sum(0)

        hooks.append(layer.self_attn.o_proj.register_forward_pre_hook(attn_hook))
        hooks.append(_mlp(layer).down_proj.register_forward_pre_hook(ffn_hook))
    model.eval()
    try:
        for x, _ in batches:
            causal_hidden(model, x)
            count += x.numel()
    finally:
        for h in hooks:
            h.remove()
    return [a / count for a in head_act], [a / count for a in ffn_act]


def _keep(scores: torch.Tensor, n_keep: int) -> torch.Tensor:
    """Indices of the ``n_keep`` highest scores, in their original order."""
    return torch.topk(scores, n_keep).indices.sort().values


@torch.no_grad()
def prune_model(
    model: LlamaForCausalLM,
    heads: float = 0.0,
    ffn: float = 0.0,
    layers: int = 0,
    batches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> LlamaForCausalLM:
    """A new, smaller model: ``layers`` layers removed, then a fraction ``heads`` of the KV
    groups and a fraction ``ffn`` of the FFN channels removed from every remaining layer.

    The original model is left unchanged. Its weights are copied, never re-initialised, so with
    nothing removed the new model computes exactly what the original does.
    """
    cfg = model.config
    if cfg.is_moe:
        raise ValueError("pruning mixture-of-experts models is not supported")
    if not (0 <= heads < 1 and 0 <= ffn < 1):
        raise ValueError("--heads and --ffn are fractions to remove, in [0, 1)")
    dropped = rank_layers_to_drop(model, batches, layers) if layers else []
    kept_layers = [i for i in range(cfg.num_hidden_layers) if i not in dropped]
    state = hf_state_dict(model)
    head_act, ffn_act = measure_activations(model, batches)

    groups = cfg.num_attention_heads // cfg.num_key_value_heads
    kv_keep = max(1, cfg.num_key_value_heads - round(heads * cfg.num_key_value_heads))
    ffn_keep = max(1, cfg.intermediate_size - round(ffn * cfg.intermediate_size))
    d = cfg.head_dim
    new_state: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if not name.startswith("model.layers."):
            new_state[name] = tensor
    for new_i, old_i in enumerate(kept_layers):
        p, q = f"model.layers.{old_i}.", f"model.layers.{new_i}."
        o_w = state[p + "self_attn.o_proj.weight"]
        head_norms = o_w.view(o_w.shape[0], cfg.num_attention_heads, d).norm(dim=(0, 2))
        head_scores = (head_act[old_i] * head_norms).view(cfg.num_key_value_heads, groups).sum(1)
        kv_idx = _keep(head_scores, kv_keep)
        q_heads = (kv_idx.view(-1, 1) * groups + torch.arange(groups)).reshape(-1)
        q_rows = (q_heads.view(-1, 1) * d + torch.arange(d)).reshape(-1)
        kv_rows = (kv_idx.view(-1, 1) * d + torch.arange(d)).reshape(-1)
        down = state[p + "mlp.down_proj.weight"]
        ffn_idx = _keep(ffn_act[old_i] * down.norm(dim=0), ffn_keep)
        for name, tensor in state.items():
            if not name.startswith(p):
                continue
            leaf = name[len(p) :]
            if leaf.startswith("self_attn.q_proj."):
                tensor = tensor[q_rows]
            elif leaf.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
                tensor = tensor[kv_rows]
            elif leaf == "self_attn.o_proj.weight":
                tensor = tensor[:, q_rows]
            elif leaf.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
                tensor = tensor[ffn_idx]
            elif leaf == "mlp.down_proj.weight":
                tensor = tensor[:, ffn_idx]
            new_state[q + leaf] = tensor.contiguous()
    new_cfg = dataclasses.replace(
        cfg,
        num_hidden_layers=len(kept_layers),
        num_attention_heads=kv_keep * groups,
        num_key_value_heads=kv_keep,
        intermediate_size=ffn_keep,
        head_dim=d,
        eos_token_ids=list(cfg.eos_token_ids),
        # the kept layers keep their kinds (sliding or global)
        layer_types=None
        if cfg.layer_types is None
        else tuple(cfg.layer_types[i] for i in kept_layers),
    )
    pruned = build_model(new_cfg, model.model.rotary.max_positions)
    pruned.load_weights(new_state.items())
    pruned.eval()
    log.info(
        "pruned: dropped layers %s, kept %d KV heads, %d FFN channels", dropped, kv_keep, ffn_keep
    )
    return pruned


def prune(
    model_path: str,
    output: str | Path,
    *,
    tokenizer: str | None = None,
    heads: float = 0.0,
    ffn: float = 0.0,
    layers: int = 0,
    calibration: str | None = None,
    calibration_tokens: int = 16384,
    calibration_seq_len: int = 256,
    distill_steps: int = 0,
    config: str | None = None,
    alpha: float = 0.5,
    temperature: float = 2.0,
    progress: bool = True,
) -> dict[str, object]:
    """``foudre prune``: write the pruned model (optionally recovered by ``distill_steps`` of
    logit distillation from the unpruned model on the calibration file's training part) to
    ``output`` as a Hugging Face directory. Returns a summary."""
    from foudre.compress.distill import distill_loss_fn
    from foudre.compress.train import TrainConfig, load_run_config, run_training

    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    model, tok_path = load_trainable(model_path, tokenizer)
    model.eval()
    if tok_path is None:
        raise ValueError(f"{model_path}: no tokenizer found; pass --tokenizer")
    tok = load_tokenizer(tok_path)
    batches = None
    split = None
    if calibration is not None:
        split = read_split([calibration])
        stream = token_stream(tok, split.train)
        seq_len = min(calibration_seq_len, model.config.max_position_embeddings)
        n_batches = max(1, calibration_tokens // (8 * seq_len))
        batches = fixed_batches(stream, 8, seq_len, n_batches)
    elif distill_steps:
        raise ValueError("--distill-steps needs --calibration text to train on")
    pruned = prune_model(model, heads=heads, ffn=ffn, layers=layers, batches=batches)
    summary: dict[str, object] = {
        "parameters_before": num_parameters(model),
        "parameters_after": num_parameters(pruned),
        "config": {
            "num_hidden_layers": pruned.config.num_hidden_layers,
            "num_attention_heads": pruned.config.num_attention_heads,
            "num_key_value_heads": pruned.config.num_key_value_heads,
            "intermediate_size": pruned.config.intermediate_size,
            "head_dim": pruned.config.head_dim,
        },
    }
    if batches:
        summary["calibration_loss_before"] = _calibration_loss(model, batches)
        summary["calibration_loss_pruned"] = _calibration_loss(pruned, batches)
    if distill_steps:
        assert split is not None
        cfg = load_run_config(config).train if config else TrainConfig(lr=3e-4, warmup_steps=10)
        cfg = dataclasses.replace(
            cfg,
            steps=distill_steps,
            seq_len=min(cfg.seq_len, pruned.config.max_position_embeddings),
        )
        model.requires_grad_(False)
        pruned.train()
        heldout = token_stream(tok, split.heldout) if split.heldout else None
        run_training(
            pruned,
            cfg,
            token_stream(tok, split.train),
            heldout,
            out,
            loss_fn=distill_loss_fn(model, alpha, temperature),
            progress=progress,
        )
        if batches:
            summary["calibration_loss_distilled"] = _calibration_loss(pruned, batches)
    save_hf(pruned, out, tok_path)
    (out / "prune_log.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


__all__ = ["measure_activations", "prune", "prune_model", "rank_layers_to_drop"]
