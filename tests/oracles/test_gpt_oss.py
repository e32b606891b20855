"""Oracle: gpt-oss (``GptOssForCausalLM``) against transformers on the same random weights
(float32): attention sinks (random, non-zero), alternating sliding-window (8) and full layers,
q/k/v/o biases, YaRN RoPE that matters within the prompts, the biased router and the clamped
SwiGLU experts (a limit low enough to clamp). Logits and greedy ids of a batch of prompts, one
longer than the window, through each CPU attention backend; prefix caching, preemption and
chunked prefill; int8 on the dense linears; what is refused."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.attention import cpu_paged
from foudre.distributed.errors import ParallelConfigError
from foudre.distributed.plan import check_parallel
from foudre.loading.hf import load_hf_config
from foudre.models.gpt_oss import GptOssForCausalLM
from tests.conftest import make_hf_model
from tests.oracles.test_hf_equivalence import PROMPTS, _hf_model, _last_logits

CONFIG: dict[str, Any] = dict(
    num_hidden_layers=4,
    num_local_experts=4,
    num_experts_per_tok=2,
    intermediate_size=32,
    head_dim=24,  # q_size 96 over hidden 64: as gpt-oss, whose heads span more than hidden
    sliding_window=8,
    # YaRN over an original context of 32 positions: the ramp covers most frequencies
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 8.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 32,
    },
    swiglu_limit=0.6,  # the clamps bite on these random weights
)

# the same model's greedy continuations, as transformers computes them (cached per path)
MAX_TOKENS = 16


def _backends() -> list[str]:
    return ["torch", "cpu"] if cpu_paged.available() else ["torch"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("gpt_oss") / "m", "gpt_oss", **CONFIG)


@cache
def _reference(path: Path) -> tuple[Any, list[list[int]]]:
    hf = _hf_model(path)
    hf.generation_config.eos_token_id = None
    ids = []
    for prompt in PROMPTS:
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )
        ids.append(out[0, len(prompt) :].tolist())
    return hf, ids


def _check_greedy(llm: LLM, path: Path) -> None:
    _, ref_ids = _reference(path)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out, ref in zip(PROMPTS, outs, ref_ids, strict=True):
        assert out.outputs[0].token_ids == ref, prompt
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_config_and_model(model_dir: Path) -> None:
    cfg = load_hf_config(model_dir)
    assert cfg.architecture == "gpt_oss" and cfg.attention_bias
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert cfg.sliding_window == 8 and cfg.swiglu_limit == 0.6 and cfg.norm_topk_prob
    assert cfg.rope_scaling is not None and cfg.rope_scaling["truncate"] is False
    hf, _ = _reference(model_dir)
    assert all(layer.self_attn.sinks.abs().min() > 1e-3 for layer in hf.model.layers)


@pytest.mark.parametrize("backend", _backends())
def test_logits_and_greedy_match_transformers(model_dir: Path, backend: str) -> None:
    hf, _ = _reference(model_dir)
    llm = LLM(
        str(model_dir),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        attention_backend=backend,
    )
    assert type(llm.engine.runner.model) is GptOssForCausalLM
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        torch.testing.assert_close(_last_logits(llm, prompt).cpu(), ref, rtol=1e-4, atol=1e-4)
    _check_greedy(llm, model_dir)
    counts = llm.metrics()["moe_expert_tokens"]
    assert sorted(counts) == [0, 1, 2, 3]


@pytest.mark.parametrize("backend", _backends())
def test_prefix_caching_preemption_and_chunked_prefill(model_dir: Path, backend: str) -> None:
    """A pool too small for the batch (preemptions), prompt chunks of 8 tokens, and the
    prompts sharing a prefix with the previous call's (prefix hits): the same greedy ids."""
    llm = LLM(
        str(model_dir),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=16,
        block_size=4,
        max_model_len=64,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
        attention_backend=backend,
    )
    _check_greedy(llm, model_dir)  # cold
    _check_greedy(llm, model_dir)  # prefix hits on the same prompts
    m = llm.metrics()
    assert m["num_preemptions"] > 0
    assert m["prefix_cache_hits"] > 0


@pytest.mark.skipif(not cpu_paged.available(), reason="no C++ compiler")
@pytest.mark.parametrize(
    "dtype,kv_cache_dtype", [("float32", "int8"), ("bfloat16", "auto"), ("bfloat16", "fp8")]
)
def test_cpu_kernels_match_the_sdpa_backend(
    model_dir: Path, dtype: str, kv_cache_dtype: str
) -> None:
    """The C++ kernels against the SDPA backend on the model in bfloat16 and over quantized KV
    caches (both read the same stored codes): the same greedy ids in float32, most of them in
    bfloat16 (their roundings differ)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(
            str(model_dir),
            dtype=dtype,
            skip_tokenizer_init=True,
            num_kv_blocks=64,
            block_size=8,
            max_num_batched_tokens=16,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend=backend,
        )
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    if dtype == "float32":
        assert outs["torch"] == outs["cpu"]
    else:
        same = sum(a == b for x, y in zip(outs["torch"], outs["cpu"]) for a, b in zip(x, y))
        assert same >= 0.8 * MAX_TOKENS * len(PROMPTS), outs


_TRITON_ENGINE = """
import sys
from foudre import LLM, SamplingParams
from tests.oracles.test_hf_equivalence import PROMPTS

params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
outs = {}
for backend in ("torch", "triton"):
    llm = LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              block_size=8, max_num_batched_tokens=16, device="cpu", attention_backend=backend)
    outs[backend] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
assert outs["torch"] == outs["triton"], outs
print("ok")
"""


@pytest.mark.slow  # about a minute in the interpreter
@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the Triton kernels for real")
def test_triton_backend_interpreted(model_dir: Path) -> None:
    """The Triton kernels with the model's sinks and windows, in Triton's interpreter: chunks
    beside decode rows through the varlen kernel, decode steps through the decode kernel; the
    SDPA backend's greedy ids."""
    from tests.triton_check import run_triton_check

    run_triton_check(_TRITON_ENGINE, str(model_dir))


def test_ngram_speculation(model_dir: Path) -> None:
    """Draft tokens from n-grams, verified in the same forward (multi-token rows through the
    prefill kernel with sinks, rejected ones rolled back): the same greedy ids."""
    llm = LLM(
        str(model_dir),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        speculative_method="ngram",
        ngram_min=1,
        ngram_max=3,
    )
    _check_greedy(llm, model_dir)
    assert llm.metrics()["spec_draft_tokens"] > 0


def test_int8_dense_linears(model_dir: Path) -> None:
    from foudre.quant.qlinear import QuantLinear

    llm = LLM(
        str(model_dir),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        quantization="int8",
    )
    model = llm.engine.runner.model
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, QuantLinear) and isinstance(attn.o_proj, QuantLinear)
    _, ref_ids = _reference(model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    # int8 rounding may change a late token; most of the first ones agree
    agree = sum(o.outputs[0].token_ids[:4] == r[:4] for o, r in zip(outs, ref_ids, strict=True))
    assert agree >= len(PROMPTS) - 1


def test_written_checkpoint_loads_in_transformers(model_dir: Path, tmp_path: Path) -> None:
    """``save_hf`` writes the loaded model back in transformers' names and layouts (q/k/v
    split, the router, interleaved experts): transformers and foudre read it as the original."""
    from foudre.loading.writer import save_hf

    llm = LLM(str(model_dir), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    out = save_hf(llm.engine.runner.model, tmp_path / "written")
    hf, _ = _reference(model_dir)
    written = _hf_model(out)
    ids = torch.tensor([PROMPTS[3]])
    with torch.no_grad():
        torch.testing.assert_close(written(ids).logits, hf(ids).logits, rtol=0, atol=1e-6)
    _check_greedy(LLM(str(out), dtype="float32", skip_tokenizer_init=True), model_dir)


def test_parallel_is_refused(model_dir: Path) -> None:
    cfg = load_hf_config(model_dir)
    with pytest.raises(ParallelConfigError, match="gpt-oss does not run parallel"):
        check_parallel(cfg, 2, 1)
    with pytest.raises(ParallelConfigError, match="gpt-oss does not run parallel"):
        check_parallel(cfg, 1, 2)


def _mxfp4_checkpoint(src: Path, dst: Path) -> Path:
    """``src``'s model with its experts quantized to MXFP4 and stored as the gpt-oss checkpoint
    stores them: ``*_blocks`` ``[E, N, K / 32, 16]`` and ``*_scales`` ``[E, N, K / 32]`` of the
    experts' ``[out, in]`` weights (gate|up rows interleaved as transformers' columns)."""
    from safetensors.torch import load_file, save_file

    from foudre.quant.mxfp4 import quantize_mxfp4

    state = {}
    for name, tensor in load_file(str(src / "model.safetensors")).items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2).contiguous())
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        else:
            state[name] = tensor
    dst.mkdir()
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_mxfp4_experts_stay_packed(model_dir: Path, tmp_path: Path) -> None:
    """An MXFP4 checkpoint (the experts' blocks and scales) loads packed, uint8 as stored,
    and runs as transformers runs it dequantized (``Mxfp4Config(dequantize=True)``): logits
    and greedy ids of the batch."""
    import transformers

    from foudre.quant.mxfp4 import MXFP4Experts

    path = _mxfp4_checkpoint(model_dir, tmp_path / "mxfp4")
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=transformers.Mxfp4Config(dequantize=True)
    ).eval()
    hf.generation_config.eos_token_id = None
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    model = llm.engine.runner.model
    for layer in model.model.layers:
        experts = layer.mlp.experts
        assert isinstance(experts, MXFP4Experts)
        assert experts.gate_up_proj_blocks.dtype == experts.down_proj_scales.dtype == torch.uint8
    cfg = model.config
    float_expert_shapes = {(cfg.num_experts, 2 * cfg.moe_intermediate_size, cfg.hidden_size)}
    assert not any(tuple(p.shape) in float_expert_shapes for p in model.parameters())
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        torch.testing.assert_close(_last_logits(llm, prompt).cpu(), ref, rtol=1e-4, atol=1e-4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        with torch.no_grad():
            ids = hf.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )
        assert out.outputs[0].token_ids == ids[0, len(prompt) :].tolist()


def test_defaults_of_a_sparse_config(tmp_path: Path) -> None:
    """Keys a config.json leaves out take transformers' gpt-oss defaults (YaRN, theta 150000,
    window 128, alternating layers, biases)."""
    raw = {
        "model_type": "gpt_oss",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 16,
        "num_hidden_layers": 3,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_hf_config(tmp_path)
    assert cfg.rope_theta == 150000.0 and cfg.rope_scaling is not None
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.rope_scaling["factor"] == 32.0
    assert cfg.sliding_window == 128 and cfg.head_dim == 64 and cfg.attention_bias
    assert cfg.layer_types == ("sliding_attention", "full_attention", "sliding_attention")
    assert cfg.num_experts_per_tok == 4 and cfg.rms_norm_eps == 1e-5
    # transformers 4's layout, as openai/gpt-oss-20b's config.json has it
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0}
    yarn |= {"truncate": False, "original_max_position_embeddings": 4096}
    raw |= {"rope_scaling": yarn, "rope_theta": 150000, "sliding_window": 16, "head_dim": 8}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_hf_config(tmp_path)
    assert cfg.rope_scaling == yarn and cfg.rope_theta == 150000.0 and cfg.sliding_window == 16
