"""Oracle: Gemma 3 (``foudre/models/gemma3.py``) against transformers' ``Gemma3ForCausalLM`` on
the same random weights, float32: last-position logits and greedy tokens, for a batch of prompts
most of them longer than the sliding window (6 layers: five sliding, one global, each kind its
own RoPE base), through prefix caching, preemption and chunked prefill; the config layouts of
transformers 4 and 5 and the multimodal checkpoint's language model; int8 and int4 weights close
to the float model; what the engine does not compute refused by name."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from foudre import LLM, SamplingParams
from foudre.loading.errors import ModelLoadError
from foudre.loading.hf import load_hf_config
from foudre.loading.quantized import save_quantized
from foudre.loading.writer import save_hf
from foudre.quant.qlinear import QuantLinear
from tests.conftest import make_hf_model
from tests.oracles.test_hf_equivalence import _last_logits

WINDOW = 8
SHAPE: dict[str, Any] = dict(
    num_hidden_layers=6,
    sliding_window=WINDOW,
    head_dim=16,
    query_pre_attn_scalar=24,
    tie_word_embeddings=True,
)
CASES: dict[str, dict[str, Any]] = {
    "tied": {},
    # the global layers' RoPE scaled (linear), the logits soft-capped, lm_head its own
    "softcap-scaled-untied": dict(
        tie_word_embeddings=False,
        final_logit_softcapping=2.5,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        },
    ),
    # one global layer in three (layers 2 and 5), MQA
    "pattern-3-mqa": dict(
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        num_key_value_heads=1,
    ),
}
PROMPTS = [
    [1, 5, 9, 33, 7],
    [1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 3],
    [1, 42],
    list(range(1, 40)),
]
MAX_TOKENS = 20


def _model(path: Path, **overrides: Any) -> Path:
    return make_hf_model(path, "gemma3_text", **{**SHAPE, **overrides})


def _hf(path: Path) -> Any:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # our runs ignore EOS too
    return hf


def _hf_greedy(hf: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    with torch.no_grad():
        return [
            hf.generate(
                torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in prompts
        ]


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    llm.engine.scheduler.check_invariants()
    return outs


def _check_logits(llm: LLM, hf: Any, prompts: list[list[int]]) -> None:
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        torch.testing.assert_close(_last_logits(llm, prompt).cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(tmp_path: Path, case: str) -> None:
    path = _model(tmp_path / case, **CASES[case])
    hf = _hf(path)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    model = llm.engine.model
    assert type(model).__name__ == "Gemma3ForCausalLM"
    assert model.config.layer_types == tuple(hf.config.layer_types)
    _check_logits(llm, hf, PROMPTS)
    assert _greedy(llm, PROMPTS, MAX_TOKENS) == _hf_greedy(hf, PROMPTS, MAX_TOKENS)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A model, and prompts (two sharing a 24-token prefix) with transformers' greedy tokens."""
    path = _model(tmp_path_factory.mktemp("gemma3"))
    prompts = [[1, *range(10, 10 + k)] + [7] * (i + 1) for i, k in enumerate([30, 30, 12, 45, 3])]
    prompts[1] = [*prompts[0][:25], 99, 98]
    return path, prompts


@pytest.fixture(scope="module")
def expected(gemma: tuple[Path, list[list[int]]]) -> list[list[int]]:
    path, prompts = gemma
    return _hf_greedy(_hf(path), prompts, MAX_TOKENS)


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_prefix_caching_preemption_chunked_prefill(
    gemma: tuple[Path, list[list[int]]], expected: list[list[int]], backend: str
) -> None:
    """A small pool (preemptions), 4-token blocks (prefix hits across and within batches), a
    5-token step budget (every prompt chunked, across the window's edge), five seats; through
    the CPU kernels and through the SDPA backend."""
    path, prompts = gemma
    llm = LLM(
        str(path),
        attention_backend=backend,
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=72,
        block_size=4,
        # the memory of 18 blocks of every layer: the window layers return theirs (a request
        # holds at most 3 in each), yet five requests at once still preempt
        num_kv_blocks=18,
        max_num_batched_tokens=5,
        max_num_seqs=5,
    )
    assert _greedy(llm, prompts, MAX_TOKENS) == expected
    assert _greedy(llm, prompts, MAX_TOKENS) == expected  # warm: whole prompts hit
    m = llm.metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_matches_transformers_on_its_weights(
    gemma: tuple[Path, list[list[int]]], method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 / int4 weights on every dense linear (lm_head included, at int8 or 6 bits): with
    each quantized linear computed by its definition (dequantize, then matmul) the logits and
    greedy tokens are transformers' on the dequantized weights; our CPU kernels (which also
    round activations to int8 by block, which this small random model with its post-norms
    feels more than a Llama: about 9% of the logits' norm) stay close to that definition."""
    path, prompts = gemma
    # no prefix caching: the kernels' KV would serve the reference's prompts
    llm = LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
        quantization=method, enable_prefix_caching=False,
    )  # fmt: skip
    model = llm.engine.model
    hf = _hf(path)
    _load_dequantized(hf, model)
    kernels = [_last_logits(llm, p) for p in prompts]
    monkeypatch.setattr(QuantLinear, "forward", QuantLinear.forward_reference)
    _check_logits(llm, hf, prompts)
    assert _greedy(llm, prompts, 8) == _hf_greedy(hf, prompts, 8)
    for prompt, got in zip(prompts, kernels, strict=True):
        ref = _last_logits(llm, prompt)
        # 0.04-0.22 across the prompts (the scales are a chaotic function of the statistics:
        # a float32 ulp in a norm moves them), against 0.59 with the wrong fold
        assert ((got - ref).norm() / ref.norm()).item() < 0.3


def _load_dequantized(hf: Any, model: torch.nn.Module) -> None:
    """Copy each ``QuantLinear``'s dequantized weight into ``hf``'s unfused projections (the
    head untied from the embedding, which stays float)."""
    cfg = model.config
    hf.lm_head.weight = torch.nn.Parameter(hf.lm_head.weight.detach().clone())
    fused = {
        "qkv_proj": (["q_proj", "k_proj", "v_proj"], [cfg.q_size, cfg.kv_size, cfg.kv_size]),
        "gate_up_proj": (["gate_proj", "up_proj"], [cfg.intermediate_size] * 2),
    }
    modules = dict(hf.named_modules())
    count = 0
    for name, module in model.named_modules():
        if not isinstance(module, QuantLinear):
            continue
        count += 1
        weight = module.dequantize().float()
        prefix, _, leaf = name.rpartition(".")
        parts, sizes = fused.get(leaf, ([leaf], [weight.shape[0]]))
        for part, piece in zip(parts, weight.split(sizes), strict=True):
            target = modules[f"{prefix}.{part}" if prefix else part].weight
            with torch.no_grad():
                target.copy_(piece)
    assert count == 4 * cfg.num_hidden_layers + 1


def _as_transformers4(path: Path) -> None:
    """Rewrite config.json as transformers 4 wrote Gemma 3's: ``sliding_window_pattern``,
    ``rope_theta`` with ``rope_scaling`` for the global layers, ``rope_local_base_freq``."""
    config = json.loads((path / "config.json").read_text())
    for key in ("layer_types", "rope_parameters", "_sliding_window_pattern"):
        config.pop(key, None)
    config |= dict(
        sliding_window_pattern=3,
        rope_theta=20_000.0,
        rope_local_base_freq=300.0,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    )
    (path / "config.json").write_text(json.dumps(config))


def test_transformers4_config_layout(tmp_path: Path) -> None:
    path = _model(tmp_path / "v4")
    _as_transformers4(path)
    cfg = load_hf_config(path)
    assert cfg.layer_types == ("sliding_attention", "sliding_attention", "full_attention") * 2
    assert (cfg.rope_theta, cfg.rope_scaling) == (20_000.0, {"rope_type": "linear", "factor": 2.0})
    assert (cfg.rope_local_theta, cfg.rope_local_scaling) == (300.0, None)
    hf = _hf(path)
    assert hf.config.layer_types == list(cfg.layer_types)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    _check_logits(llm, hf, PROMPTS[1:2])
    assert _greedy(llm, PROMPTS, 12) == _hf_greedy(hf, PROMPTS, 12)


def _as_multimodal(text: Path, out: Path, layout: str = "transformers5") -> Path:
    """The text model ``text`` as the language model of a ``gemma3`` (image-text) checkpoint:
    a config.json with its ``text_config``, the weights under ``model.language_model.``
    (transformers 5) or ``language_model.model.`` and ``language_model.lm_head.``
    (transformers 4), beside a vision tower's and a projector's."""
    out.mkdir()
    text_config = json.loads((text / "config.json").read_text())
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text_config,
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 32},
        "eos_token_id": [2, 106],
        "tie_word_embeddings": text_config["tie_word_embeddings"],
    }
    (out / "config.json").write_text(json.dumps(config))
    new = "model.language_model." if layout == "transformers5" else "language_model.model."
    weights: dict[str, torch.Tensor] = {}
    for name, t in load_file(text / "model.safetensors").items():
        if name.startswith("model."):
            name = new + name.removeprefix("model.")
        elif layout == "transformers4":  # lm_head
            name = "language_model." + name
        weights[name] = t
    vision = "model." if layout == "transformers5" else ""
    weights[f"{vision}vision_tower.vision_model.post_layernorm.weight"] = torch.ones(32)
    weights[f"{vision}multi_modal_projector.mm_input_projection_weight"] = torch.zeros(32, 64)
    save_file(weights, out / "model.safetensors")
    return out


@pytest.mark.parametrize("layout", ["transformers5", "transformers4"])
def test_multimodal_checkpoint_runs_its_language_model(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, layout: str
) -> None:
    """A multimodal checkpoint (``_as_multimodal``) runs its text model: the same logits, the
    top-level EOS ids, the skipped vision tower said in the log."""
    text = _model(tmp_path / "text", tie_word_embeddings=False)
    hf = _hf(text)
    mm = _as_multimodal(text, tmp_path / "multimodal", layout)
    with caplog.at_level(logging.INFO):
        llm = LLM(str(mm), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    assert "vision" in caplog.text
    assert llm.engine.model.config.eos_token_ids == [2, 106]
    _check_logits(llm, hf, PROMPTS[:2])


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("attn_logit_softcapping", 50.0),
        ("use_bidirectional_attention", True),
        ("hidden_activation", "gelu"),
        ("attention_bias", True),
    ],
)
def test_refuses_what_it_does_not_compute(tmp_path: Path, key: str, value: Any) -> None:
    path = _model(tmp_path / "m", num_hidden_layers=2)
    config = json.loads((path / "config.json").read_text())
    config[key] = value
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=key):
        load_hf_config(path)


def test_written_checkpoints_load_back(tmp_path: Path) -> None:
    """``save_hf`` writes a ``gemma3_text`` directory that transformers and foudre load as the
    source model (its RoPE per layer type, window, score scale and soft-capping kept), and an
    int8 checkpoint (``save_quantized``) loads back into the same quantized model."""
    source = _model(tmp_path / "source", **CASES["softcap-scaled-untied"])
    hf = _hf(source)
    common: dict[str, Any] = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    llm = LLM(str(source), **common)
    written = save_hf(llm.engine.model, tmp_path / "written")
    assert load_hf_config(written) == load_hf_config(source)
    _check_logits(LLM(str(written), **common), hf, PROMPTS[1:2])
    _check_logits(llm, _hf(written), PROMPTS[1:2])
    quant = LLM(str(source), quantization="int8", **common)
    saved = save_quantized(quant.engine.model, tmp_path / "int8", "int8")
    again = LLM(str(saved), **common)
    prompt = PROMPTS[3]
    torch.testing.assert_close(_last_logits(again, prompt), _last_logits(quant, prompt))


@pytest.mark.parametrize(("t", "p"), [(2, 1), (1, 2)])
def test_tensor_and_pipeline_parallel(tmp_path: Path, t: int, p: int) -> None:
    """Sharded as Llama is (heads, MLP slices, a tied vocabulary of 251 rows that two ranks do
    not divide; the post-norms see the summed outputs), from a multimodal checkpoint's language
    model, or split in two stages (three layers each, each stage its layers' kinds and both RoPE
    tables): transformers' greedy tokens, with preemptions (20 blocks of 4) and prefix hits (the
    first two prompts share 25 tokens)."""
    path = _model(tmp_path / "m", vocab_size=251)
    prompts = [[1, *range(10, 10 + k)] + [7] * (i + 1) for i, k in enumerate([30, 30, 12, 45])]
    prompts[1] = [*prompts[0][:25], 99, 98]
    want = _hf_greedy(_hf(path), prompts, 12)
    if t > 1:
        path = _as_multimodal(path, tmp_path / "multimodal")
    llm = LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, block_size=4, num_kv_blocks=20,
        max_model_len=80, tensor_parallel_size=t, pipeline_parallel_size=p,
    )  # fmt: skip
    try:
        assert _greedy(llm, prompts, 12) == want
        m = llm.metrics()
        assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
    finally:
        llm.shutdown()


def test_speculative_decoding(
    gemma: tuple[Path, list[list[int]]], expected: list[list[int]]
) -> None:
    """n-gram drafts verified in the same forward (several logits a row, rejected tokens rolled
    back across the window's edge): transformers' greedy tokens."""
    path, prompts = gemma
    llm = LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
        speculative_method="ngram",
    )  # fmt: skip
    assert _greedy(llm, prompts, MAX_TOKENS) == expected
    m = llm.metrics()
    assert m["spec_draft_tokens"] > m["spec_accepted_tokens"] > 0


def test_awq_scales_keep_the_float_function(
    gemma: tuple[Path, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """AWQ's input scales (forced here to arbitrary ones from 0.8 to 1.25, at 8 bits) are folded
    where that is exact (v rows for o_proj, up rows for down_proj) and otherwise applied to the
    input: Gemma's ``1 + weight`` norms take no fold (folding into them as into Llama's put the
    logits 59% off; rounding alone, with scales of 1, puts them 10% off in this small model)."""
    import foudre.quant.awq as awq_mod
    from foudre.quant.api import AWQ, quantize_

    path, prompts = gemma
    common: dict[str, Any] = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    exact = LLM(str(path), **common)
    scaled = LLM(str(path), **common)

    def search_scale(
        w: torch.Tensor,
        x: torch.Tensor,
        bits: int,
        group_size: int | None,
        x_mean: torch.Tensor | None = None,
        grid: int = 20,
    ) -> torch.Tensor:
        """Equal scales where ``x_mean`` ties channels (the query heads that share a KV head,
        whose v rows take o_proj's fold)."""
        stat = x.float().abs().mean(0) if x_mean is None else x_mean.float()
        return 2.0 ** (0.33 * torch.sin(1000.0 * stat))

    monkeypatch.setattr(awq_mod, "search_scale", search_scale)
    quantize_(scaled.engine.model, AWQ(bits=8, calibration=[prompts[0]]))
    for prompt in prompts:
        ref, got = _last_logits(exact, prompt), _last_logits(scaled, prompt)
        # 0.04-0.22 across the prompts (the scales are a chaotic function of the statistics:
        # a float32 ulp in a norm moves them), against 0.59 with the wrong fold
        assert ((got - ref).norm() / ref.norm()).item() < 0.3


def _write_gguf(
    src: Path, out: Path, qtype: str = "F32", spm: bytes | None = None
) -> dict[str, torch.Tensor]:
    """``src`` as llama.cpp's converter writes a ``gemma3`` file: its hyper-parameters (not the
    local RoPE base, the layer pattern nor the score scale, which llama.cpp assumes), the norms
    stored as ``1 + weight``, the 2-D weights in ``qtype`` (F32 or Q8_0), the sentencepiece
    vocabulary ``spm`` without a space prefix, and a chat template. Returns the weights as
    stored, by HF name (the norms as HF holds them)."""
    import gguf
    import numpy as np

    from tests.quant.test_gguf import _add_spm_vocab, quantize

    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(str(out), "gemma3")
    w.add_block_count(n)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["rope_parameters"]["full_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_sliding_window(cfg["sliding_window"])
    if cfg.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if spm is not None:
        _add_spm_vocab(w, spm, cfg["vocab_size"])
        w.add_add_space_prefix(False)
        w.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, n)
    stored: dict[str, torch.Tensor] = {}
    for hf_name, tensor in load_file(src / "model.safetensors").items():
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        assert name is not None, hf_name
        data = tensor.float().numpy()
        if hf_name.endswith("norm.weight"):
            w.add_tensor(name, (data + 1.0).astype(np.float32))
            stored[hf_name] = torch.from_numpy((data + 1.0).astype(np.float32)) - 1.0
        elif qtype == "F32":
            w.add_tensor(name, data.astype(np.float32))
            stored[hf_name] = torch.from_numpy(data)
        else:
            raw, values = quantize(data, qtype)
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[qtype])
            stored[hf_name] = torch.from_numpy(np.asarray(values, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return stored


CHAT_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ m['role'] }}\n{{ m['content'] }}<end_of_turn>\n"
    "{% endfor %}<start_of_turn>model\n"
)


def test_gguf_tokenizer_and_chat_template(tmp_path: Path) -> None:
    """A ``gemma3`` file is its own tokenizer (sentencepiece, no space prefix, as the converter
    writes Gemma's) and chat template: text in, transformers' greedy tokens out."""
    import sentencepiece

    from tests.quant.test_gguf import CORPUS

    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.split(". ") * 4), model_writer=buf, model_type="bpe",
        vocab_size=384, byte_fallback=True, normalization_rule_name="identity",
        add_dummy_prefix=False, minloglevel=2,
    )  # fmt: skip
    spm = buf.getvalue()
    source = _model(tmp_path / "hf", vocab_size=384, query_pre_attn_scalar=16)
    path = tmp_path / "model.gguf"
    _write_gguf(source, path, spm=spm)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    text = "The quick brown fox"
    ids = sentencepiece.SentencePieceProcessor(model_proto=spm).encode(text)
    prompt = [llm.engine.tokenizer.bos_token_id, *ids]
    assert llm.engine.tokenizer.encode(text) == prompt
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    out = llm.generate([text], params)[0].outputs[0]
    assert out.token_ids == _hf_greedy(_hf(source), [prompt], 10)[0]
    rendered = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    assert rendered == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model"


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
def test_gguf_matches_its_source(
    tmp_path: Path, qtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GGUF file written from the HF model gives transformers' logits and greedy tokens on
    the weights it stores (Q8_0: as decoded, with ``FOUDRE_GGUF_DEQUANTIZE=1``; kept quantized
    it runs too); ``ffn_norm`` is the MLP's input norm, the stored norms lose their 1."""
    source = _model(tmp_path / "hf", query_pre_attn_scalar=16, final_logit_softcapping=4.0)
    path = tmp_path / "model.gguf"
    stored = _write_gguf(source, path, qtype)
    hf = _hf(source)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.copy_(stored[name])  # the tied head is the embedding
    common: dict[str, Any] = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    if qtype != "F32":
        kept = LLM(str(path), **common)
        assert "QuantLinear" in {type(m).__name__ for m in kept.engine.model.modules()}
        assert len(_greedy(kept, PROMPTS, 8)[3]) == 8
        monkeypatch.setenv("FOUDRE_GGUF_DEQUANTIZE", "1")
    llm = LLM(str(path), **common)
    cfg, want = llm.engine.model.config, load_hf_config(source)
    keys = ["layer_types", "sliding_window", "rope_theta", "rope_local_theta"]
    keys += ["query_pre_attn_scalar", "final_logit_softcapping", "tie_word_embeddings"]
    for key in keys:
        assert getattr(cfg, key) == getattr(want, key), key
    _check_logits(llm, hf, PROMPTS)
    assert _greedy(llm, PROMPTS, 12) == _hf_greedy(hf, PROMPTS, 12)


def test_pruned_model_loads_in_transformers(tmp_path: Path) -> None:
    """``prune_model`` (two layers, half the KV groups, a quarter of the MLP removed) builds a
    Gemma 3 whose kept layers keep their kinds; written out, transformers computes its logits."""
    from foudre.compress.prune import prune_model

    source = _model(tmp_path / "source")
    common: dict[str, Any] = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    model = LLM(str(source), **common).engine.model
    pruned = prune_model(model, heads=0.5, ffn=0.25, layers=2)
    assert type(pruned) is type(model)
    kinds = pruned.config.layer_types
    assert kinds is not None and len(kinds) == 4 and "full_attention" in kinds
    written = save_hf(pruned, tmp_path / "pruned")
    hf = _hf(written)
    assert hf.config.layer_types == list(kinds)
    _check_logits(LLM(str(written), **common), hf, PROMPTS[1:2])


# the shapes of published configs: Gemma 3 1B (text only, transformers 4's layout) and 4B (image
# and text, its text_config leaving most keys at their defaults)
REAL_CONFIGS: dict[str, dict[str, Any]] = {
    "1b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "attention_bias": False, "attn_logit_softcapping": None, "bos_token_id": 2,
        "eos_token_id": [1, 106], "final_logit_softcapping": None, "head_dim": 256,
        "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 1152,
        "intermediate_size": 6912, "max_position_embeddings": 32768,
        "num_attention_heads": 4, "num_hidden_layers": 26, "num_key_value_heads": 1,
        "pad_token_id": 0, "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06,
        "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
        "sliding_window": 512, "sliding_window_pattern": 6, "torch_dtype": "bfloat16",
        "vocab_size": 262144,
    },
    "4b": {
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
        "image_token_index": 262144, "mm_tokens_per_image": 256, "torch_dtype": "bfloat16",
        "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {
            "hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
            "model_type": "siglip_vision_model", "num_attention_heads": 16,
            "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False,
        },
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_published_configs_read_as_transformers_reads_them(tmp_path: Path, name: str) -> None:
    import transformers

    (tmp_path / "config.json").write_text(json.dumps(REAL_CONFIGS[name]))
    ours = load_hf_config(tmp_path)
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    text = getattr(theirs, "text_config", theirs)
    rope = text.rope_parameters
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "max_position_embeddings", "sliding_window", "query_pre_attn_scalar",
                "final_logit_softcapping"):  # fmt: skip
        assert getattr(ours, key) == getattr(text, key), key
    assert ours.layer_types == tuple(text.layer_types)
    assert ours.tie_word_embeddings == theirs.tie_word_embeddings
    assert ours.eos_token_ids == [1, 106]
    full, local = rope["full_attention"], rope["sliding_attention"]
    assert (ours.rope_theta, ours.rope_local_theta) == (full["rope_theta"], local["rope_theta"])
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    assert (ours.rope_scaling or {"rope_type": "default"}) == scaling
    assert ours.rope_local_scaling is None and local["rope_type"] == "default"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_graphs_match_eager(gemma: tuple[Path, list[list[int]]]) -> None:
    """The default GPU engine (Triton attention with each layer's window, CUDA graphs for
    decode) against the eager SDPA engine on the GPU: the same greedy tokens (fp32)."""
    path, prompts = gemma
    outs = []
    for kwargs in (dict(attention_backend="torch", enforce_eager=True), {}):
        llm = LLM(
            str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=256, **kwargs
        )  # fmt: skip
        outs.append(_greedy(llm, prompts, MAX_TOKENS))
        graphs = llm.engine.runner.decode_path
        assert (graphs is not None) == (not kwargs)
    assert outs[0] == outs[1]
