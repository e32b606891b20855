"""Calibration: run the model on token sequences and collect each linear's inputs.

The model runs without a KV cache through ``CausalBackend`` (each sequence alone, causal),
so the activations are exactly those the served model computes for the same prompt.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from foudre.models.causal import causal_hidden
from foudre.models.llama import LlamaForCausalLM


def run_sequence(model: LlamaForCausalLM, ids: Sequence[int]) -> torch.Tensor:
    """Final hidden states ``[T, hidden]`` of one sequence, computed from position 0."""
    device = model.model.embed_tokens.weight.device
    t = torch.as_tensor(list(ids), dtype=torch.long, device=device)
    return causal_hidden(model, t.view(1, -1))[0]


def default_calibration(
    vocab_size: int, num_sequences: int = 8, seq_len: int = 64
) -> list[list[int]]:
    """Deterministic pseudo-random token ids (seed 0), used when no calibration is given.

    Random tokens exercise every channel but not the statistics of real text; pass real
    tokenized text for the best GPTQ/AWQ/mixed results.
    """
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (num_sequences, seq_len), generator=g).tolist()


@torch.no_grad()
def capture_inputs(
    model: LlamaForCausalLM,
    names: Iterable[str],
    calibration: Sequence[Sequence[int]],
    max_tokens: int | None = None,
) -> dict[str, torch.Tensor]:
    """Float32 inputs ``[tokens, in_features]`` of each named linear over the calibration set
    (at most ``max_tokens`` rows each, evenly subsampled)."""
    modules = dict(model.named_modules())
    store: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    handles = []
    for name in store:
        mod: nn.Module = modules[name]

        def hook(_m: nn.Module, args: tuple[torch.Tensor, ...], name: str = name) -> None:
            store[name].append(args[0].detach().reshape(-1, args[0].shape[-1]).float().cpu())

        handles.append(mod.register_forward_pre_hook(hook))
    try:
        for ids in calibration:
            run_sequence(model, ids)
    finally:
        for h in handles:
            h.remove()
    out = {}
    for name, chunks in store.items():
        x = torch.cat(chunks)
        if max_tokens is not None and x.shape[0] > max_tokens:
            idx = torch.linspace(0, x.shape[0] - 1, max_tokens).long()
            x = x[idx]
        out[name] = x
    return out
