"""Checkpoints written by transformers itself: our config and weight names must agree."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from foudre.loading import iter_safetensors_weights, load_hf_config


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_transformers_checkpoint(tmp_path: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    from tests.conftest import make_hf_model

    overrides = {"head_dim": 32} if arch in ("mistral", "qwen3") else {}
    path = make_hf_model(tmp_path / arch, arch, tie_word_embeddings=arch == "qwen2", **overrides)
    config = load_hf_config(path)
    hf = transformers.AutoConfig.from_pretrained(path)
    assert config.architecture == arch
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert config.head_dim == head_dim == (32 if overrides else 16)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.rms_norm_eps == hf.rms_norm_eps
    assert config.rope_theta == hf.rope_parameters["rope_theta"] and config.rope_scaling is None
    assert config.tie_word_embeddings == (arch == "qwen2")
    assert config.attention_bias == (arch == "qwen2") and config.qk_norm == (arch == "qwen3")
    assert config.eos_token_ids == [2] and config.bos_token_id == 1

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    expected = {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}
    loaded = dict(iter_safetensors_weights(path))
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert loaded.keys() == expected.keys()
    assert all(torch.equal(loaded[k], expected[k]) for k in expected)


@pytest.mark.parametrize(
    "arch,overrides",
    [
        ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
        (
            "qwen2_moe",
            {
                "num_hidden_layers": 3,
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 24,
                "shared_expert_intermediate_size": 40,
                "mlp_only_layers": [1],
            },
        ),
        ("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 24}),
        ("olmoe", {"num_experts": 4, "num_experts_per_tok": 1, "clip_qkv": 3.0}),
    ],
)
def test_moe_checkpoint_written_back_as_transformers_writes_it(
    tmp_path: Path, arch: str, overrides: dict
) -> None:
    """foudre's ``save_hf`` of an MoE model: the same tensors under the same names and a config
    that both transformers and foudre read back to the same model."""
    pytest.importorskip("transformers")
    from foudre.loading.loader import load_model
    from foudre.loading.writer import save_hf
    from tests.conftest import make_hf_model

    src = make_hf_model(tmp_path / "src", arch, **overrides)
    cpu = torch.device("cpu")
    model = load_model(str(src), None, "float32", cpu, None).model
    out = save_hf(model, tmp_path / "out")
    written, original = dict(iter_safetensors_weights(out)), dict(iter_safetensors_weights(src))
    assert written.keys() == original.keys()
    assert all(torch.equal(written[k], original[k]) for k in original)
    assert load_hf_config(out) == load_hf_config(src)
    import transformers

    ids = torch.tensor([[1, 5, 9, 33, 7, 100]])
    with torch.no_grad():
        a = transformers.AutoModelForCausalLM.from_pretrained(src)(ids).logits
        b = transformers.AutoModelForCausalLM.from_pretrained(out)(ids).logits
    assert torch.equal(a, b)


def test_save_hf_names_the_dtype_it_writes(tmp_path: Path) -> None:
    """A bfloat16 model is written as bfloat16 and says so: loading it back with dtype "auto"
    keeps bfloat16 (the config used to claim float32 whatever was written)."""
    from foudre.loading.loader import load_model
    from foudre.loading.writer import save_hf
    from tests.conftest import make_hf_model

    src = make_hf_model(tmp_path / "src", "llama")
    cpu = torch.device("cpu")
    model = load_model(str(src), None, "bfloat16", cpu, None).model
    out = save_hf(model, tmp_path / "out")
    assert load_hf_config(out).torch_dtype == "bfloat16"
    assert {t.dtype for _, t in iter_safetensors_weights(out)} == {torch.bfloat16}
    again = load_model(str(out), None, "auto", cpu, None).model
    assert next(again.parameters()).dtype == torch.bfloat16
