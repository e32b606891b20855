"""Oracle: DeepSeek-V3 (multi-head latent attention over the paged latent cache, sigmoid
group-limited routing) against Hugging Face transformers' DeepseekV3ForCausalLM on the same
random weights: logits and greedy ids, batched, through each CPU attention backend, with prefix
hits, preemptions and chunked prefill; the latent cache's size; the absorbed form against the
expanded one; int8 weights; the refusals (quantized KV cache, tensor parallelism)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from foudre import LLM, SamplingParams
from foudre.attention import TorchSDPABackend
from foudre.attention.cache_spec import LatentAttentionSpec, pages_of
from foudre.attention.causal import CausalBackend
from foudre.distributed.errors import ParallelConfigError
from foudre.layers.moe import route_grouped
from foudre.loading.errors import ModelLoadError
from foudre.loading.hf import load_hf_config
from foudre.loading.writer import hf_config_dict
from foudre.models.causal import causal_hidden
from foudre.models.deepseek_v3 import DeepseekV3ForCausalLM, LatentAttention
from foudre.quant.qlinear import QuantLinear
from foudre.runner.model_runner import ModelRunner
from tests.conftest import make_hf_model
from tests.oracles.test_hf_equivalence import PROMPTS, _hf_model, _last_logits

BASE: dict[str, Any] = dict(
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_routed_experts=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=4,
    n_shared_experts=1,
    moe_intermediate_size=32,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)
CASES: dict[str, dict[str, Any]] = {
    "q-lora-yarn-mscale": {
        "attention_bias": True,  # q_a, kv_a (its RoPE part de-interleaved too) and o biases
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "mscale": 1.0,
            "mscale_all_dim": 0.707,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    },
    "no-q-lora-not-interleaved": {"q_lora_rank": None, "rope_interleave": False},
    # the released models' latent width (512 + 64): the kernels' loops over a wide head
    "latent-576": {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 32},
    "groups-4-no-norm-v-wider": {
        "n_group": 4,
        "topk_group": 2,
        "num_experts_per_tok": 2,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "v_head_dim": 32,
        "first_k_dense_replace": 0,
    },
}


def _model(tmp_path: Path, case: str) -> tuple[Path, Any]:
    path = make_hf_model(tmp_path / case, "deepseek_v3", **{**BASE, **CASES[case]})
    hf = _hf_model(path)
    hf.generation_config.eos_token_id = None  # our runs ignore EOS too
    return path, hf


def _greedy_ref(hf: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def _check(llm: LLM, hf: Any, prompts: list[list[int]], n: int = 16) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == _greedy_ref(hf, prompt, n)
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(tmp_path: Path, case: str) -> None:
    path, hf = _model(tmp_path, case)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    model = llm.engine.runner.model
    assert isinstance(model, DeepseekV3ForCausalLM)
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0].float()
        torch.testing.assert_close(_last_logits(llm, prompt).cpu(), ref[-1], rtol=1e-4, atol=1e-4)
        # the expanded form, without a cache, over the whole prompt
        full = model.compute_logits(causal_hidden(model, torch.tensor([prompt]))[0])
        torch.testing.assert_close(full, ref, rtol=1e-4, atol=1e-4)
    _check(llm, hf, PROMPTS)
    counts = llm.metrics()["moe_expert_tokens"]
    cfg = model.config
    assert sorted(counts) == [i for i in range(cfg.num_hidden_layers) if cfg.is_sparse_layer(i)]


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_each_cpu_backend_reads_the_latent_cache(tmp_path: Path, backend: str) -> None:
    """Both CPU backends take the latent cache (one KV head, V aliasing K) as it is."""
    path, hf = _model(tmp_path, "q-lora-yarn-mscale")
    try:
        llm = LLM(
            str(path),
            dtype="float32",
            skip_tokenizer_init=True,
            num_kv_blocks=64,
            attention_backend=backend,
        )
    except ValueError as e:  # no C++ compiler here
        pytest.skip(str(e))
    assert llm.engine.runner.backend.name == backend
    _check(llm, hf, PROMPTS, n=12)


def test_prefix_hits_preemption_and_chunked_prefill(tmp_path: Path, monkeypatch: Any) -> None:
    """Shared prefixes (prefix hits), few blocks (preemptions) and a small token budget
    (chunked prompts) give transformers' greedy ids; prompts computed whole ran expanded,
    the rest (decode, later chunks, rows after a prefix hit) absorbed, in the same steps."""
    calls = {"expanded": 0, "absorbed": 0}
    for form in calls:
        original = getattr(LatentAttention, form)

        def counted(*args: Any, _f: Any = original, _name: str = form) -> Any:
            calls[_name] += 1
            return _f(*args)

        monkeypatch.setattr(LatentAttention, form, counted)
    path, hf = _model(tmp_path, "no-q-lora-not-interleaved")
    shared = list(range(3, 40))
    prompts = [[*shared, 50 + i, 60 + i] for i in range(4)] + [[7, 8, 9], shared[:20]]
    llm = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=40,
        max_model_len=80,
        max_num_batched_tokens=24,
        enable_prefix_caching=True,
    )
    _check(llm, hf, prompts, n=20)
    m = llm.metrics()
    assert m["num_preemptions"] > 0
    assert m["prefix_cache_hits"] > 0
    assert calls["expanded"] > 0 and calls["absorbed"] > 0


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_ngram_speculation_matches_plain_greedy(tmp_path: Path, backend: str) -> None:
    """Draft tokens verified in the same forward (multi-token rows over the latent cache),
    rejected ones rolled back: transformers' greedy ids, and some drafts accepted."""
    path, hf = _model(tmp_path, "q-lora-yarn-mscale")
    try:
        llm = LLM(
            str(path),
            dtype="float32",
            skip_tokenizer_init=True,
            num_kv_blocks=64,
            attention_backend=backend,
            speculative_method="ngram",
            num_speculative_tokens=3,
        )
    except ValueError as e:  # no C++ compiler here
        pytest.skip(str(e))
    _check(llm, hf, [[*range(3, 13)] * 3, PROMPTS[0]], n=24)
    m = llm.metrics()
    assert m["spec_draft_tokens"] > 0 and m["spec_accepted_tokens"] > 0


def test_forked_samples_copy_latent_blocks(tmp_path: Path) -> None:
    """n samples fork from one computation of the prompt: its last, partly filled block is
    copied (copy-on-write of the one latent page tensor) and each sample matches a request
    of its own with the same seed."""
    path, _ = _model(tmp_path, "no-q-lora-not-interleaved")
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    prompt = list(range(3, 26))  # 23 tokens: the second block is partly filled
    forked = llm.generate([prompt], SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=12))
    assert llm.metrics()["num_cow_copies"] > 0
    for i, sample in enumerate(forked[0].outputs):
        params = SamplingParams(temperature=0.9, seed=5 + i, max_tokens=12)
        alone = llm.generate([prompt], params)[0].outputs[0]
        assert sample.token_ids == alone.token_ids


def test_latent_cache_holds_one_vector_per_token(tmp_path: Path, caplog: Any) -> None:
    path, _ = _model(tmp_path, "q-lora-yarn-mscale")
    with caplog.at_level(logging.INFO, logger="foudre"):
        llm = LLM(
            str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8, max_model_len=128
        )
    runner = llm.engine.runner
    assert isinstance(runner, ModelRunner)
    cfg = runner.model.config
    d = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    assert runner.cache_specs == [LatentAttentionSpec(32, 8)] * cfg.num_hidden_layers
    for cache in runner.kv_caches:
        assert isinstance(cache, torch.Tensor)
        assert cache.shape == (2, 9, 16, 1, d)  # the backends' view, one block of scratch
        assert cache[0].data_ptr() == cache[1].data_ptr() and cache.stride(0) == 0
        (pages,) = pages_of(cache)
        assert pages.untyped_storage().nbytes() == 9 * 16 * d * 4  # d values per token
    per_token = cfg.num_hidden_layers * d * 4
    assert llm.metrics()["kv_bytes_per_token"] == per_token
    plain = cfg.num_hidden_layers * cfg.num_attention_heads * (16 + 8 + 16) * 4
    assert f"latent attention: {per_token} bytes per token" in caplog.text
    assert f"would take {plain}" in caplog.text


def test_absorbed_equals_expanded(tmp_path: Path) -> None:
    """One latent attention layer: the absorbed form over a paged cache (two steps: a prompt
    chunk, then one token) against the expanded form over the whole sequence."""
    from foudre.attention.base import BatchLayout

    path, _ = _model(tmp_path, "groups-4-no-norm-v-wider")
    llm = LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8, max_model_len=128
    )
    layer = llm.engine.runner.model.model.layers[1]
    attn = layer.self_attn
    assert isinstance(attn, LatentAttention)
    torch.manual_seed(1)
    t = 11
    x = torch.randn(t, 64)
    positions = torch.arange(t)
    with torch.no_grad():
        expanded = attn(positions, x, torch.empty(0), CausalBackend(), (1, t))
        cache = LatentAttentionSpec(32, 8).allocate(4, 4, torch.float32, torch.device("cpu"))
        backend = TorchSDPABackend()
        table = [2, 0, 3]
        outs = []
        for lo, hi in ((0, t - 1), (t - 1, t)):
            slots = torch.tensor([table[p // 4] * 4 + p % 4 for p in range(lo, hi)])
            layout = BatchLayout([hi - lo], [hi], [table], slots, 4)
            meta = backend.build_metadata(layout, torch.device("cpu"))
            outs.append(attn(positions[lo:hi], x[lo:hi], cache, backend, meta))
    torch.testing.assert_close(torch.cat(outs), expanded, rtol=1e-5, atol=1e-5)


def test_bfloat16_keeps_the_selection_bias_in_float32(tmp_path: Path) -> None:
    """In a bfloat16 model the routers' e_score_correction_bias stays float32, as stored."""
    path, _ = _model(tmp_path, "q-lora-yarn-mscale")
    stored = load_file(str(path / "model.safetensors"))
    llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=64)
    model = llm.engine.runner.model
    assert next(model.parameters()).dtype == torch.bfloat16
    for i, block in model.moe_blocks().items():
        bias = block.e_score_correction_bias
        assert bias is not None and bias.dtype == torch.float32
        assert torch.equal(bias, stored[f"model.layers.{i}.mlp.gate.e_score_correction_bias"])
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([PROMPTS[1]], params)[0].outputs[0].token_ids) == 4


def test_route_grouped_matches_transformers_router() -> None:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    for n_group, topk_group, k, norm in ((4, 2, 3, True), (2, 1, 4, False), (1, 1, 2, True)):
        cfg = DeepseekV3Config(
            hidden_size=16, n_routed_experts=16, n_group=n_group, topk_group=topk_group,
            num_experts_per_tok=k, norm_topk_prob=norm, routed_scaling_factor=1.5,
        )  # fmt: skip
        router = DeepseekV3TopkRouter(cfg)
        torch.manual_seed(n_group)
        router.weight.data.normal_()
        router.e_score_correction_bias.normal_(0, 0.3)
        x = torch.randn(40, 16)
        logits, ref_w, ref_ids = router(x)
        w, ids = route_grouped(logits, router.e_score_correction_bias, k, n_group, topk_group,
                               norm, 1.5)  # fmt: skip
        order = ref_ids.sort(dim=-1).indices
        mine = ids.sort(dim=-1).indices
        assert torch.equal(ids.gather(1, mine), ref_ids.gather(1, order))
        torch.testing.assert_close(w.gather(1, mine), ref_w.gather(1, order))


@pytest.mark.parametrize("method,similarity", [("int8", 0.99), ("int4", 0.99)])
def test_quantized_weights_run(tmp_path: Path, method: str, similarity: float) -> None:
    """int8 / int4 weight-only quantization of the dense linears, the MLA projections included
    (the latent projection kv_b_proj, multiplied per head, stays in float), and of the
    experts: it runs, and its logits stay close to transformers' float ones."""
    path, hf = _model(tmp_path, "q-lora-yarn-mscale")
    llm = LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, quantization=method
    )
    attn = llm.engine.runner.model.model.layers[0].self_attn
    for name in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"):
        assert isinstance(getattr(attn, name), QuantLinear), name
    prompt = PROMPTS[3]
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1].float()
    got = _last_logits(llm, prompt).cpu()
    cos = torch.nn.functional.cosine_similarity(got, ref, dim=0)
    assert cos > similarity
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_refusals(tmp_path: Path) -> None:
    path, _ = _model(tmp_path, "no-q-lora-not-interleaved")
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'int8'.*LatentAttentionSpec"):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True, kv_cache_dtype="int8")
    cfg = load_hf_config(path)
    for tp, pp in ((2, 1), (1, 2)):  # refused before any worker starts
        with pytest.raises(ParallelConfigError, match=r"deepseek_v3.*tensor and pipeline"):
            LLM(
                str(path),
                dtype="float32",
                skip_tokenizer_init=True,
                tensor_parallel_size=tp,
                pipeline_parallel_size=pp,
            )
    raw = json.loads((path / "config.json").read_text())
    raw["scoring_func"] = "softmax"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="writing deepseek_v3 checkpoints is not supported"):
        hf_config_dict(cfg)
    with pytest.raises(ModelLoadError, match="routing scoring_func='softmax'"):
        load_hf_config(path)


def test_kimi_k2_config_loads_as_deepseek_v3(tmp_path: Path) -> None:
    """Kimi-K2's config.json names model_type kimi_k2 and the DeepseekV3ForCausalLM class;
    keys it leaves out take DeepSeek-V3's defaults."""
    path, _ = _model(tmp_path, "q-lora-yarn-mscale")
    raw = json.loads((path / "config.json").read_text())
    raw["model_type"] = "kimi_k2"
    del raw["v_head_dim"]
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    (path / "config.json").write_text(json.dumps(raw))
    cfg = load_hf_config(path)
    assert cfg.architecture == "deepseek_v3"
    assert (cfg.kv_lora_rank, cfg.v_head_dim, cfg.n_group, cfg.topk_group) == (32, 128, 2, 1)
    assert cfg.mlp_only_layers == (0,) and cfg.shared_expert_intermediate_size == 32


def _fp8_checkpoint(src: Path, out: Path, block: tuple[int, int]) -> Path:
    """``src`` rewritten as DeepSeek-V3 is released: each linear weight (not the embedding,
    head, routers) float8 e4m3 with a float32 ``weight_scale_inv`` per ``block``; returns a
    float checkpoint of the weights that stands for (for transformers)."""
    stored: dict[str, torch.Tensor] = {}
    floats: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        skip = ("embed_tokens", "lm_head", "mlp.gate.weight")
        if w.dim() != 2 or any(k in name for k in skip):
            stored[name] = floats[name] = w
            continue
        (rows, cols), (bo, bi) = w.shape, block
        nb = (-(-rows // bo), -(-cols // bi))
        padded = torch.zeros(nb[0] * bo, nb[1] * bi)
        padded[:rows, :cols] = w
        tiles = padded.view(nb[0], bo, nb[1], bi)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / 448.0
        codes = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn)
        stored[name] = codes.view(nb[0] * bo, nb[1] * bi)[:rows, :cols].contiguous()
        stored[name + "_scale_inv"] = scale
        floats[name] = (codes.float() * scale[:, None, :, None]).view(padded.shape)[:rows, :cols]
    raw = json.loads((src / "config.json").read_text())
    qc = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block)}
    for target, state, config in ((out / "fp8", stored, qc), (out / "float", floats, None)):
        target.mkdir(parents=True)
        save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"))
        quantized = {} if config is None else {"quantization_config": config}
        (target / "config.json").write_text(json.dumps({**raw, **quantized}))
    return out / "float"


def test_fp8_block_checkpoint_loads_dequantized(tmp_path: Path) -> None:
    """A checkpoint in DeepSeek-V3's released form (float8 weights, a scale per block of
    16 x 16 here: partial blocks at the edges) loads as the float weights it stands for:
    transformers' logits and greedy ids on those weights. A missing scale is named."""
    src, _ = _model(tmp_path, "q-lora-yarn-mscale")
    hf = _hf_model(_fp8_checkpoint(src, tmp_path / "ckpt", (16, 16)))
    hf.generation_config.eos_token_id = None
    llm = LLM(str(tmp_path / "ckpt" / "fp8"), dtype="float32", skip_tokenizer_init=True,
              num_kv_blocks=64)  # fmt: skip
    for prompt in PROMPTS[:2]:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        torch.testing.assert_close(_last_logits(llm, prompt).cpu(), ref, rtol=1e-4, atol=1e-4)
    _check(llm, hf, PROMPTS[:2], n=8)
    fp8 = tmp_path / "ckpt" / "fp8"
    state = load_file(str(fp8 / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"
    del state[name + "_scale_inv"]
    save_file(state, str(fp8 / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=f"float8 weight '{name}' has no"):
        LLM(str(fp8), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)


def test_multi_token_prediction_layers_are_skipped(tmp_path: Path, caplog: Any) -> None:
    """A checkpoint with a multi-token-prediction layer past num_hidden_layers (as the released
    models have) loads; that layer is skipped with a log line."""
    path, hf = _model(tmp_path, "no-q-lora-not-interleaved")
    state = load_file(str(path / "model.safetensors"))
    extra = {
        k.replace("model.layers.2.", "model.layers.3."): v.clone()
        for k, v in state.items()
        if k.startswith("model.layers.2.")
    }
    save_file({**state, **extra}, str(path / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(raw))
    with caplog.at_level(logging.INFO, logger="foudre"):
        llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=32)
    assert "skipped 1 multi-token-prediction layer(s)" in caplog.text
    _check(llm, hf, PROMPTS[:2], n=6)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="runs for real on the GPU instead")
def test_triton_backend_and_graph_buffers_interpreted(tmp_path: Path) -> None:
    """The Triton kernels (in Triton's interpreter) over the latent cache, and the CUDA-graph
    decode path's static buffers (the capture replaced by re-running the forward), give the
    SDPA backend's greedy ids."""
    from tests.engine.test_triton_attention import _ENGINE_CHECK
    from tests.triton_check import run_triton_check

    path, _ = _model(tmp_path, "q-lora-yarn-mscale")
    run_triton_check(_ENGINE_CHECK, str(path), timeout=600)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_match_eager(tmp_path: Path) -> None:
    """On a GPU: Triton + CUDA graphs over the latent cache against eager SDPA, and both
    against transformers' greedy ids (float32)."""
    path, hf = _model(tmp_path, "q-lora-yarn-mscale")
    prompts = [[1, *range(3 + i, 6 + 5 * (i % 7) + i)] for i in range(9)]
    outs = []
    for kwargs in (dict(attention_backend="torch", enforce_eager=True), {}):
        llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64, **kwargs)
        params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        if not kwargs:
            graphs = llm.engine.runner.decode_path
            assert graphs is not None and graphs.graphs  # type: ignore[attr-defined]
    assert outs[0] == outs[1]
    hf = hf.cuda()
    for prompt, ids in zip(prompts, outs[1], strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]).cuda(), max_new_tokens=10, do_sample=False)
        assert ids == ref[0, len(prompt) :].tolist()
