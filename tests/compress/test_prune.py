"""``foudre prune``: smaller shapes, valid in foudre and transformers; pruning nothing is exact."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from foudre.compress.model import full_sequence_logits, load_for_eval
from foudre.compress.prune import prune, prune_model


def test_prune_nothing_is_the_identity(trained: Path) -> None:
    model, tok = load_for_eval(str(trained))
    same = prune_model(model)
    ids = tok.encode("Lily saw a big red ball.")
    torch.testing.assert_close(full_sequence_logits(same, ids), full_sequence_logits(model, ids))


def test_pruned_checkpoint_is_smaller_and_loads_alike(
    tmp_path: Path, corpus: Path, trained: Path
) -> None:
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "pruned"
    summary = prune(
        str(trained),
        out,
        heads=0.5,
        ffn=0.5,
        layers=1,
        calibration=str(corpus),
        calibration_tokens=2048,
        distill_steps=3,
        progress=False,
    )
    assert summary["parameters_after"] < summary["parameters_before"]  # type: ignore[operator]
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (
        2,
        2,
        1,
    )
    assert cfg["intermediate_size"] == 32 and cfg["head_dim"] == 8 and cfg["hidden_size"] == 32

    model, tok = load_for_eval(str(out))
    assert model.model.layers[0].self_attn.qkv_proj.weight.shape == (2 * 8 + 2 * 8, 32)
    ids = tok.encode("Tom and his mom went to the park.")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert hf.model.layers[0].self_attn.q_proj.weight.shape == (16, 32)
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_sequence_logits(model, ids), theirs, atol=1e-4, rtol=1e-4)
