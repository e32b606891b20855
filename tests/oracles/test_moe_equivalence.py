"""Oracle: the mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against Hugging
Face transformers on the same random weights: several expert counts, top-k 1, 2 and 4, a shared
expert, dense layers mixed in; checkpoints with experts per expert, fused, and sharded."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from foudre import LLM, SamplingParams
from foudre.loading.errors import ModelLoadError
from tests.conftest import make_hf_model
from tests.oracles.test_hf_equivalence import PROMPTS, _hf_model, _last_logits

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral-8-top2": ("mixtral", {"num_local_experts": 8, "num_experts_per_tok": 2}),
    "mixtral-4-top1-tied": (
        "mixtral",
        {"num_local_experts": 4, "num_experts_per_tok": 1, "tie_word_embeddings": True},
    ),
    "qwen2-moe-shared-dense-mixed": (
        "qwen2_moe",
        {
            "num_hidden_layers": 3,
            "num_experts": 6,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 80,
            "mlp_only_layers": [1],
        },
    ),
    "qwen2-moe-sparse-step": (
        "qwen2_moe",
        {
            "num_hidden_layers": 4,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "decoder_sparse_step": 2,
            "norm_topk_prob": True,
        },
    ),
    "qwen3-moe-16-top4": (
        "qwen3_moe",
        {
            "num_experts": 16,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "head_dim": 24,
        },
    ),
    "qwen3-moe-no-norm-dense-first": (
        "qwen3_moe",
        {
            "num_experts": 5,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 40,
            "norm_topk_prob": False,
            "mlp_only_layers": [0],
        },
    ),
    "olmoe-top2-clip": (
        "olmoe",
        {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 48, "clip_qkv": 2.0},
    ),
}


def _check_against_hf(path: Path, hf: Any, case: str, **llm_args: Any) -> LLM:
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, **llm_args)
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        torch.testing.assert_close(_last_logits(llm, prompt).cpu(), ref, rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref_ids = hf.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref_ids, case
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    return llm


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(tmp_path: Path, case: str) -> None:
    arch, overrides = CASES[case]
    path = make_hf_model(tmp_path / case, arch, **overrides)
    hf = _hf_model(path)
    hf.generation_config.eos_token_id = None
    llm = _check_against_hf(path, hf, case)
    cfg = llm.engine.runner.model.config
    assert cfg.is_moe
    # every token the engine computed went to top-k experts of every sparse layer
    counts = llm.metrics()["moe_expert_tokens"]
    sparse = [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_layer(i)]
    assert sorted(counts) == sparse
    if overrides.get("mlp_only_layers") or overrides.get("decoder_sparse_step", 1) > 1:
        assert len(sparse) < cfg.num_hidden_layers  # dense layers mixed in
    totals = {sum(c) for c in counts.values()}
    assert len(totals) == 1 and totals.pop() % cfg.num_experts_per_tok == 0
    assert all(len(c) == cfg.num_experts for c in counts.values())


def test_fused_and_sharded_checkpoints(tmp_path: Path) -> None:
    """Experts stored stacked (transformers 5's in-memory names) or across shards load alike."""
    arch, overrides = CASES["qwen2-moe-shared-dense-mixed"]
    src = make_hf_model(tmp_path / "src", arch, **overrides)
    hf = _hf_model(src)
    hf.generation_config.eos_token_id = None
    fused = tmp_path / "fused"
    fused.mkdir()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)
    save_file(state, str(fused / "model.safetensors"), metadata={"format": "pt"})
    (fused / "config.json").write_text((src / "config.json").read_text())
    _check_against_hf(fused, hf, "fused")

    sharded = tmp_path / "sharded"
    hf.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    _check_against_hf(sharded, hf, "sharded")


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    path = make_hf_model(tmp_path / "m", "mixtral", num_local_experts=4, num_experts_per_tok=2)
    from safetensors.torch import load_file

    state = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    del state[name]
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=re.escape(repr(name))):  # as the file names it
        LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)


def test_missing_stacked_experts_are_named(tmp_path: Path) -> None:
    """A checkpoint of stacked experts (transformers 5's names) without a layer's
    ``down_proj``: the error names that tensor."""
    src = make_hf_model(
        tmp_path / "src",
        "qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
    )
    state = {k: v.contiguous() for k, v in _hf_model(src).state_dict().items()}
    del state["model.layers.1.mlp.experts.down_proj"]
    path = tmp_path / "fused"
    path.mkdir()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"'model\.layers\.1\.mlp\.experts\.down_proj "):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)


@pytest.mark.parametrize(
    "key,value", [("scoring_func", "sigmoid"), ("topk_method", "group_limited_greedy")]
)
def test_unknown_routing_variant_is_refused(tmp_path: Path, key: str, value: str) -> None:
    path = make_hf_model(
        tmp_path / "m", "qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
    )
    raw = json.loads((path / "config.json").read_text())
    raw[key] = value
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=f"routing {key}={value!r}"):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    raw[key], raw["num_experts_per_tok"] = None, 9  # more experts per token than experts
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="num_experts_per_tok=9"):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
