"""Mixture-of-experts GGUF files, written the way llama.cpp writes them (``convert_hf_to_gguf.py``:
Mixtral as ``llama`` with ``ffn_*_exps`` stacked experts, ``qwen2moe`` with its shared expert,
``qwen3moe``, ``olmoe``; ``llama-quantize``: experts quantized, routers and norms kept F32),
against Hugging Face transformers on the same weights."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from foudre import LLM
from foudre.loading.errors import ModelLoadError
from foudre.loading.loader import load_model, load_tokenizer
from foudre.loading.tokenizer import HFTokenizer
from tests.conftest import make_hf_model
from tests.oracles.test_moe_equivalence import _check_against_hf
from tests.quant.test_gguf import _add_bpe_vocab, _add_spm_vocab, _permute, _train_bpe, quantize

CPU = torch.device("cpu")
_ARCH = {
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "qwen2moe",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "OlmoeForCausalLM": "olmoe",
}
_EXPERT = re.compile(
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\."
    r"(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_GGUF_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up"}
_GGUF_PART |= {"w2": "down", "down_proj": "down"}


def moe_source(path: Path) -> Path:
    """A random HF Qwen2-MoE (4 experts, top-2, a shared expert) wide enough (256) for K-quant
    blocks: the model these tests write as GGUF."""
    return make_hf_model(
        path,
        "qwen2_moe",
        vocab_size=400,
        hidden_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
    )


def write_moe_gguf(
    src: Path,
    out: Path,
    qtype: str = "F32",
    *,
    vocab: tuple[str, Any] | None = None,
    per_expert: bool = False,
    drop: str | None = None,
    metadata: dict[str, Any] | None = None,
    types: dict[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Convert the HF MoE model in ``src`` to ``out``; return the exact stored values of each
    stacked expert tensor (by GGUF name). ``per_expert`` writes the older one-tensor-per-expert
    names (``ffn_gate.{e}``); ``drop`` leaves out the named tensor; ``metadata`` adds keys;
    ``types`` writes the named tensors in another type than ``qtype``."""
    cfg = json.loads((src / "config.json").read_text())
    arch = _ARCH[cfg["architectures"][0]]
    state = load_file(str(src / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    w = gguf.GGUFWriter(str(out), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if arch == "qwen3moe" and not cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(False)
    if arch == "olmoe" and cfg.get("clip_qkv"):
        w.add_clamp_kqv(cfg["clip_qkv"])
    for key, value in (metadata or {}).items():
        w.add_uint32(key, value) if isinstance(value, int) else w.add_float32(key, value)
    if vocab is not None:
        if vocab[0] == "spm":
            _add_spm_vocab(w, vocab[1], cfg["vocab_size"])
        else:
            _add_bpe_vocab(w, vocab[1], "qwen2", cfg["vocab_size"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    tensors: dict[str, np.ndarray] = {}
    for hf_name, tensor in state.items():
        data = tensor.float().numpy()
        m = _EXPERT.match(hf_name)
        if m is not None:
            stacks.setdefault((int(m.group(1)), _GGUF_PART[m.group(3)]), {})[int(m.group(2))] = data
            continue
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            data = _permute(data, heads, heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            data = _permute(data, heads, kv_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        tensors[name] = data
    values: dict[str, np.ndarray] = {}
    for (layer, part), by_expert in sorted(stacks.items()):
        stacked = np.stack([by_expert[e] for e in range(experts)])
        if per_expert:
            for e in range(experts):
                tensors[f"blk.{layer}.ffn_{part}.{e}.weight"] = stacked[e]
        else:
            tensors[f"blk.{layer}.ffn_{part}_exps.weight"] = stacked
    for name, data in tensors.items():
        if name == drop:
            continue
        keep_float = data.ndim == 1 or "ffn_gate_inp" in name or qtype == "F32"
        if keep_float:
            w.add_tensor(name, data.astype(np.float32))
            continue
        kind = (types or {}).get(name, qtype)
        raw, exact = quantize(data.reshape(-1, data.shape[-1]), kind)
        w.add_tensor(name, raw.reshape(*data.shape[:-1], -1), raw_dtype=Q[kind])
        values[name] = exact.reshape(data.shape)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


@pytest.fixture(scope="module")
def qwen_bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train_bpe(tmp_path_factory.mktemp("qwen_bpe"), "qwen2")


@pytest.fixture(scope="module")
def spm_model() -> bytes:
    from tests.quant.test_gguf import spm_model as fixture

    return fixture.__wrapped__()  # type: ignore[attr-defined]


CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2moe": (
        "qwen2_moe",
        {
            "num_experts": 6,
            "num_experts_per_tok": 4,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 80,
        },
    ),
    "qwen3moe": (
        "qwen3_moe",
        {
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "head_dim": 24,
        },
    ),
    "qwen3moe-unnormalised": (
        "qwen3_moe",
        {"num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 32},
    ),
    "olmoe": ("olmoe", {"num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 2.0}),
}


def _hf(path: Path) -> Any:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return hf


@pytest.mark.parametrize("case", sorted(CASES))
def test_f32_moe_gguf_matches_transformers(
    case: str, qwen_bpe: Path, spm_model: bytes, tmp_path: Path
) -> None:
    arch, overrides = CASES[case]
    src = make_hf_model(tmp_path / case, arch, vocab_size=400, **overrides)
    out = tmp_path / f"{case}.gguf"
    vocab = ("spm", spm_model) if arch == "mixtral" else ("bpe", qwen_bpe)
    write_moe_gguf(src, out, "F32", vocab=vocab)
    llm = _check_against_hf(out, _hf(src), case)
    cfg = llm.engine.runner.model.config
    assert cfg.architecture == arch and cfg.is_moe
    assert cfg.num_experts == (overrides.get("num_local_experts") or overrides["num_experts"])
    assert cfg.shared_expert_gate == (arch == "qwen2_moe")
    if vocab[0] == "bpe":  # the tokenizer comes from the file's metadata
        tok = load_tokenizer(out)
        assert tok.encode("The fox") == HFTokenizer(qwen_bpe / "tokenizer.json").encode("The fox")


def test_per_expert_tensors_of_older_files(spm_model: bytes, tmp_path: Path) -> None:
    arch, overrides = CASES["mixtral"]
    src = make_hf_model(tmp_path / "src", arch, vocab_size=400, **overrides)
    write_moe_gguf(src, tmp_path / "old.gguf", vocab=("spm", spm_model), per_expert=True)
    _check_against_hf(tmp_path / "old.gguf", _hf(src), "per-expert")


@pytest.mark.parametrize("qtype,tolerance", [("Q8_0", 0.03), ("Q4_K", 0.5)])
def test_quantized_experts(
    qtype: str, tolerance: float, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q8_0 / Q4_K experts dequantized at load (``FOUDRE_GGUF_DEQUANTIZE=1``; kept quantized by
    default, checked against this in ``test_gguf_quantized``) are exactly their stored values;
    logits stay near float32."""
    monkeypatch.setenv("FOUDRE_GGUF_DEQUANTIZE", "1")
    src = moe_source(tmp_path / "src")
    out = tmp_path / f"{qtype}.gguf"
    values = write_moe_gguf(src, out, qtype)
    model = load_model(str(out), None, "float32", CPU, None).model
    ref = load_model(str(src), None, "float32", CPU, None).model
    experts = model.moe_blocks()[1].experts
    gate_up = experts.gate_up_proj.detach().numpy()
    np.testing.assert_array_equal(gate_up[:, :256], values["blk.1.ffn_gate_exps.weight"])
    np.testing.assert_array_equal(gate_up[:, 256:], values["blk.1.ffn_up_exps.weight"])
    np.testing.assert_array_equal(
        experts.down_proj.detach().numpy(), values["blk.1.ffn_down_exps.weight"]
    )
    from foudre.quant.calib import run_sequence

    ids = [1, 17, 250, 3, 99, 380, 42, 42, 7, 300, 12, 5]
    with torch.no_grad():
        got = model.compute_logits(run_sequence(model, ids))
        want = ref.compute_logits(run_sequence(ref, ids))
    assert 0 < float((got - want).norm() / want.norm()) < tolerance


def _one_line(exc: pytest.ExceptionInfo[ModelLoadError]) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


def test_missing_expert_tensor_is_named(tmp_path: Path) -> None:
    arch, overrides = CASES["qwen3moe"]
    src = make_hf_model(tmp_path / "src", arch, **overrides)
    out = tmp_path / "m.gguf"
    write_moe_gguf(src, out, drop="blk.1.ffn_up_exps.weight")
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(out), None, "float32", CPU, None)
    assert "'blk.1.ffn_up_exps.weight' is missing" in _one_line(exc)
    write_moe_gguf(src, out, per_expert=True, drop="blk.0.ffn_down.3.weight")
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_down\.3\.weight' is missing"):
        load_model(str(out), None, "float32", CPU, None)


@pytest.mark.parametrize(
    "key,value",
    [("qwen3moe.expert_gating_func", 2), ("qwen3moe.expert_weights_scale", 2.5)],
)
def test_unknown_routing_variant_is_named(key: str, value: Any, tmp_path: Path) -> None:
    arch, overrides = CASES["qwen3moe"]
    src = make_hf_model(tmp_path / "src", arch, **overrides)
    out = tmp_path / "m.gguf"
    write_moe_gguf(src, out, metadata={key: value})
    with pytest.raises(ModelLoadError) as exc:
        LLM(str(out), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=16)
    assert f"routing {key}={value!r}" in _one_line(exc)
