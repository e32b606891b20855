"""Oracle: Granite 4.0 hybrids (``GraniteMoeHybridForCausalLM``: Mamba-2 mixers, attention with
or without RoPE, mixtures of experts with a shared MLP, Granite's multipliers) against
transformers on random small configs, float32, through the stand-in driver of
``hybrid_driver.py`` (a state slot and paged KV blocks per request)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foudre.loading.loader import load_model
from foudre.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM
from tests.oracles.hybrid_driver import HybridDriver
from tests.oracles.ssm_models import hf_logits as _hf_logits
from tests.oracles.ssm_models import prompt as _prompt
from tests.oracles.ssm_models import save_random

BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=32,
    shared_intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    layer_types=["mamba", "attention", "mamba", "attention"],
    num_local_experts=4,
    num_experts_per_tok=2,
    mamba_n_heads=8,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    embedding_multiplier=1.5,
    residual_multiplier=0.7,
    attention_multiplier=0.3,
    logits_scaling=2.0,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CASES: dict[str, dict[str, Any]] = {
    "nope-moe": {},
    "rope-moe": {"position_embedding_type": "rope"},
    # no experts (the shared MLP alone), attention first, a tied head
    "dense-tied": {
        "num_local_experts": 0,
        "layer_types": ["attention", "mamba", "mamba"],
        "num_hidden_layers": 3,
        "tie_word_embeddings": True,
        "position_embedding_type": "rope",
    },
}


def make_granite(path: Path, seed: int = 0, **overrides: Any) -> Path:
    return save_random("GraniteMoeHybrid", {**BASE, **overrides}, path, seed)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import transformers

    path = make_granite(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    hf = transformers.GraniteMoeHybridForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf = hf.eval()
    hf.generation_config.eos_token_id = None
    ours = load_model(str(path), None, "float32", torch.device("cpu"), None).model
    assert isinstance(ours, GraniteMoeHybridForCausalLM)
    return path, hf, ours


def test_chunked_prefill_and_mixed_batch(pair: Any) -> None:
    """A prompt in odd chunks then token by token, beside a second prompt that starts later
    and decodes alongside: every position's logits are transformers' of the whole sequence."""
    _, hf, ours = pair
    long, short = _prompt(37, 3), _prompt(9, 4)
    driver = HybridDriver(ours, 2, 48)
    got: list[list[torch.Tensor]] = [[], []]
    at = [0, 0]
    sizes = [(5, 0), (11, 4), (1, 3), (9, 1), (3, 1), *[(1, 0)] * 8]
    for a, b in sizes:
        rows = [(r, p[at[r] : at[r] + n]) for r, (p, n) in enumerate(((long, a), (short, b))) if n]
        for (r, ids), out in zip(rows, driver.step(rows), strict=True):
            got[r].append(out)
            at[r] += len(ids)
    assert at == [len(long), len(short)]
    torch.testing.assert_close(torch.cat(got[0]), _hf_logits(hf, long), atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(got[1]), _hf_logits(hf, short), atol=1e-4, rtol=0)


def test_greedy_ids_equal_generate(pair: Any) -> None:
    _, hf, ours = pair
    prompts = [_prompt(n, 20 + n) for n in (5, 17, 30)]
    steps = 10
    want = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False)
        want.append(out[0, len(p) :].tolist())
    driver = HybridDriver(ours, 3, 48)
    logits = driver.step(list(enumerate(prompts)))
    got = [[int(lg[-1].argmax())] for lg in logits]
    for _ in range(steps - 1):
        logits = driver.step([(r, [g[-1]]) for r, g in enumerate(got)])
        for g, lg in zip(got, logits, strict=True):
            g.append(int(lg[-1].argmax()))
    assert got == want


@pytest.mark.parametrize(
    ("arch", "change", "named"),
    [
        ("bamba", {"attn_layer_indices": [7]}, "attn_layer_indices"),
        ("bamba", {"attention_bias": True}, "attention_bias"),
        ("bamba", {"mamba_n_heads": 7}, "expand \\* hidden_size"),
        ("granitemoehybrid", {"layer_types": ["mamba", "conv", "mamba", "mamba"]}, "layer_types"),
        ("granitemoehybrid", {"position_embedding_type": "alibi"}, "position_embedding_type"),
        ("granitemoehybrid", {"residual_multiplier": 0}, "residual_multiplier"),
    ],
)
def test_bad_hybrid_configs_name_the_key(
    tmp_path: Path, arch: str, change: dict[str, Any], named: str
) -> None:
    import json

    import transformers

    from foudre.loading.errors import ModelLoadError
    from foudre.loading.hf import load_hf_config
    from tests.oracles.test_bamba import BASE as BAMBA

    config = transformers.BambaConfig(**BAMBA) if arch == "bamba" else None
    config = config or transformers.GraniteMoeHybridConfig(**BASE)
    config.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ModelLoadError, match=named):
        load_hf_config(tmp_path)
