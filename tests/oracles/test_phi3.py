"""Oracle: Phi-3 / Phi-4 (``Phi3ForCausalLM``) against transformers on random small configs.

LongRoPE in transformers switches factors per sequence: a forward over a sequence of ``n``
tokens rotates every position by the long factors when ``n > original_max_position_embeddings``,
else by the short ones; and Phi-3's ``generate`` (its ``prepare_inputs_for_generation``) drops
the KV cache the step a sequence first grows past the original context, so the whole sequence
is recomputed with the long factors: no cached key keeps its short rotation once a sequence is
long. foudre does the same (the scheduler frees the crossing request's blocks and recomputes
it, ``Scheduler._recompute_rotated``), so greedy output matches ``generate`` token for token
across the boundary; ``test_crossing_recomputes_the_cached_keys`` shows that keeping the
short-rotated keys would not.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from tests.conftest import make_hf_model

ORIGINAL = 20  # the original context of the LongRoPE cases: prompts and outputs cross it


def _longrope(rotary_dim: int) -> dict[str, Any]:
    half = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(half)],
        "long_factor": [1.5 + 0.4 * i for i in range(half)],
    }


LONGROPE = {
    "max_position_embeddings": 128,
    "original_max_position_embeddings": ORIGINAL,
    "rope_scaling": _longrope(16),
}
CASES: dict[str, dict[str, Any]] = {
    "plain": {},
    "partial-rotary": {"partial_rotary_factor": 0.75},
    "longrope": LONGROPE,
    # Phi-4-mini's shape: LongRoPE over 3/4 of each head
    "longrope-partial": {**LONGROPE, "rope_scaling": _longrope(12), "partial_rotary_factor": 0.75},
    "window-tied": {"sliding_window": 8, "tie_word_embeddings": True},
}

# lengths 5 and 18 grow past ORIGINAL while generating; 26 and 39 start past it
PROMPTS = [
    [1, 5, 9, 33, 7],
    [1, *range(100, 117)],
    [1, *range(120, 145)],
    list(range(1, 40)),
]
MAX_TOKENS = 16


def _phi3(tmp_path: Path, case: str) -> Path:
    return make_hf_model(tmp_path / case, "phi3", pad_token_id=0, **CASES[case])


def _hf(path: Path) -> Any:
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # our runs ignore EOS too
    return hf


def _hf_greedy(hf: Any, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return [ids for ids, _ in _hf_scored(hf, prompts, max_tokens)]


def _hf_scored(
    hf: Any, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
) -> list[tuple[list[int], list[float]]]:
    """Per prompt, ``generate``'s greedy ids and the log-probability of each."""
    out = []
    for prompt in prompts:
        with torch.no_grad():
            gen = hf.generate(
                torch.tensor([prompt]),
                max_new_tokens=max_tokens,
                do_sample=False,
                pad_token_id=0,
                output_logits=True,
                return_dict_in_generate=True,
            )
        ids = gen.sequences[0, len(prompt) :].tolist()
        lps = [
            float(torch.log_softmax(step[0].float(), -1)[t])
            for step, t in zip(gen.logits, ids, strict=True)
        ]
        out.append((ids, lps))
    return out


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    return [ids for ids, _ in _scored(llm, prompts, max_tokens)]


def _scored(
    llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS
) -> list[tuple[list[int], list[float]]]:
    """Per prompt, our greedy ids and the log-probability of each."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    out = []
    for o in llm.generate(prompts, params):
        ids = o.outputs[0].token_ids
        lps = o.outputs[0].logprobs or []
        out.append((ids, [lp[t] for lp, t in zip(lps, ids, strict=True)]))
    return out


def _assert_scored(
    ours: list[tuple[list[int], list[float]]], ref: list[tuple[list[int], list[float]]]
) -> None:
    for (ids, lps), (ref_ids, ref_lps) in zip(ours, ref, strict=True):
        assert ids == ref_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=1e-4, rtol=0)


def _last_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """One prompt through the engine's model, KV cache and backend, as the scheduler lays it
    out (its RoPE position offset included); the last position's logits."""
    from foudre.engine.request import Request
    from foudre.engine.scheduler import new_request
    from foudre.runner.step import ScheduledRow, SchedulerOutput

    engine = llm.engine
    req = Request("probe", list(prompt), SamplingParams(max_tokens=1))
    assert engine.kv.allocate_slots(req, len(prompt))
    runner = engine.runner
    captured: list[torch.Tensor] = []
    original = runner.model.compute_logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        captured.append(original(hidden))
        return captured[-1]

    runner.model.compute_logits = spy  # type: ignore[method-assign]
    try:
        blocks = engine.kv.block_ids("probe")
        offset = engine.kv.position_offset(req)
        row = ScheduledRow("probe", 0, list(prompt), blocks, 1, position_offset=offset)
        runner.execute(SchedulerOutput([row], removed=["probe"], new_requests=[new_request(req)]))
        runner.input_batch.remove(["probe"])
    finally:
        runner.model.compute_logits = original  # type: ignore[method-assign]
        engine.kv.free(req)
    return captured[0][0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(tmp_path: Path, case: str) -> None:
    path = _phi3(tmp_path, case)
    hf = _hf(path)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    assert type(llm.engine.model).__name__ == "Phi3ForCausalLM"
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        torch.testing.assert_close(_last_logits(llm, prompt).cpu(), ref, rtol=1e-4, atol=1e-4)
    _assert_scored(_scored(llm, PROMPTS), _hf_scored(hf, PROMPTS))
    assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]


def test_longrope_with_prefix_cache_preemption_and_chunked_prefill(tmp_path: Path) -> None:
    """Small chunks, a KV pool too small for the batch (preemptions), and prompts that share
    a prefix across the boundary: the 18-token prompt's blocks (short-rotated) must not serve
    the 26-token prompt that starts with them (long-rotated throughout)."""
    path = _phi3(tmp_path, "longrope-partial")
    shared = [1, *range(100, 117)]
    prompts = [shared, [*shared, *range(60, 68)], [1, 5, 9, 33, 7], list(range(1, 40)), shared]
    expected = _hf_scored(_hf(path), prompts)
    llm = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        block_size=4,
        num_kv_blocks=16,
        max_model_len=64,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
    )
    _assert_scored(_scored(llm, prompts), expected)
    _assert_scored(_scored(llm, prompts), expected)  # again, from the prefix cache
    metrics = llm.metrics()
    assert metrics["num_free_blocks"] == metrics["num_total_blocks"]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv.prefix_cache_hits > 0


def test_longrope_speculative_and_quantized(tmp_path: Path) -> None:
    """n-gram drafts are verified only as far as the rotation holds (cut at the boundary);
    int8 and int4 weights run the same model."""
    path = _phi3(tmp_path, "longrope")
    scored = _hf_scored(_hf(path), PROMPTS, 24)
    expected = [ids for ids, _ in scored]
    spec = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        speculative_method="ngram",
    )
    _assert_scored(_scored(spec, PROMPTS, 24), scored)
    for scheme in ("int8", "int4"):
        quant = LLM(str(path), dtype="float32", skip_tokenizer_init=True, quantization=scheme)
        outs = _greedy(quant, PROMPTS, 24)
        assert [len(o) for o in outs] == [24] * len(PROMPTS)
        agree = sum(o[0] == ref[0] for o, ref in zip(outs, expected, strict=True))
        assert agree >= len(PROMPTS) - 1, scheme  # first tokens, as the rounding allows


def test_crossing_recomputes_the_cached_keys(tmp_path: Path) -> None:
    """What happens to a sequence's cached keys when it grows past the original context:
    transformers' generate recomputes them with the long factors, and so does foudre. A
    forward loop that kept the short-rotated keys in the cache (the plain cached decode)
    gives other tokens, which foudre does not follow."""
    path = _phi3(tmp_path, "longrope")
    hf = _hf(path)
    prompt = [1, *range(100, 117)]  # 18 tokens: the third generated token crosses
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    ours = _greedy(llm, [prompt])[0]
    assert ours == _hf_greedy(hf, [prompt])[0]
    kept: list[int] = []  # the same decode, never dropping the cache
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        for _ in range(MAX_TOKENS):
            kept.append(int(out.logits[0, -1].argmax()))
            out = hf(torch.tensor([[kept[-1]]]), cache=out.past_key_values, use_cache=True)
    assert kept[:3] == ours[:3]  # the same up to the boundary
    assert kept != ours, "this config should tell the two apart; change its factors"
    # the recompute is no preemption, and every block came back
    assert llm.engine.scheduler.num_preemptions == 0
    assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]


def test_phi3_config_errors(tmp_path: Path) -> None:
    """Bad LongRoPE keys name themselves."""
    import json

    from foudre.loading.errors import ModelLoadError
    from foudre.loading.hf import load_hf_config

    path = _phi3(tmp_path, "longrope")
    cfg = load_hf_config(path)
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 128 / ORIGINAL
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"]["long_factor"] = "wide"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="long_factor"):
        load_hf_config(path)


@pytest.mark.parametrize("case", ["longrope-partial", "window-tied"])
def test_gguf_from_the_converter_matches_the_safetensors(tmp_path: Path, case: str) -> None:
    """A phi3 GGUF as llama.cpp's converter writes it (fused attn_qkv and ffn_up, LongRoPE
    factors as rope_factors_long / rope_factors_short tensors, the rotated width, the window)
    gives the logits of its safetensors source; Q8_0 weights run kept quantized."""
    from foudre.loading.loader import load_model
    from foudre.quant.calib import run_sequence
    from tests.quant.test_gguf import write_gguf

    src = _phi3(tmp_path, case)
    out = tmp_path / f"{case}.gguf"
    write_gguf(src, out, "F32")
    cpu = torch.device("cpu")
    loaded = load_model(str(out), None, "float32", cpu, None)
    ref = load_model(str(src), None, "float32", cpu, None)
    assert loaded.config.architecture == "phi3"
    for field in ("partial_rotary_factor", "sliding_window", "tie_word_embeddings"):
        assert getattr(loaded.config, field) == getattr(ref.config, field), field
    ids = PROMPTS[3]  # longer than the original context: the long factors throughout
    with torch.no_grad():
        got = loaded.model.compute_logits(run_sequence(loaded.model, ids))
        want = ref.model.compute_logits(run_sequence(ref.model, ids))
        hf = _hf(src)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(want, hf, atol=1e-4, rtol=1e-4)  # the whole-sequence forward
    write_gguf(src, out, "Q8_0")
    quant = load_model(str(out), None, "float32", cpu, None).model
    kept = type(quant.model.layers[0].self_attn.qkv_proj).__name__
    assert kept != "Linear" and type(quant.model.layers[0].mlp.gate_up_proj).__name__ == kept
    with torch.no_grad():
        q = quant.compute_logits(run_sequence(quant, ids))
    assert float((q - want).norm() / want.norm()) < 0.03


def test_scheduler_cuts_drafts_and_recomputes_at_the_switch() -> None:
    """The scheduler's side of LongRoPE, on a rule of its own (offset 100 past 20 tokens):
    drafts are cut where accepting them would cross, and a request that crossed is freed and
    recomputed from position 0 under its new offset (a recompute, not a preemption)."""
    from foudre.engine.kv_cache import KVCacheManager
    from foudre.engine.request import Request
    from foudre.engine.scheduler import Scheduler
    from foudre.runner.step import StepOutput

    kv = KVCacheManager(16, 4, True, rope_offset=lambda n: 100 if n > ORIGINAL else 0)
    sched = Scheduler(kv, 64, 4, 64)
    req = Request("r", list(range(1, 19)), SamplingParams(max_tokens=8))
    sched.add_request(req)

    def step(token: int, drafts: list[int]) -> Any:
        out = sched.schedule()
        assert [r.request_id for r in out.rows] == ["r"]
        sched.update(out, StepOutput(["r"], [[token]], [None], [len(drafts)], [len(drafts)]))
        req.output_token_ids.append(token)
        return out.rows[0]

    row = step(50, [])
    assert (row.start, len(row.token_ids), row.position_offset) == (0, 18, 0)
    req.spec_token_ids = [6, 7, 8]  # 19 tokens + 3 accepted would make 22 > 20
    row = step(51, [6])
    assert row.spec_token_ids == [6] and row.token_ids == [50, 6]  # cut to 20 tokens
    req.output_token_ids.append(6)  # the accepted draft: 21 tokens now, past the original
    out = sched.schedule()
    assert out.preempted == ["r"] and not out.rows  # freed, queued at the head
    row = sched.schedule().rows[0]
    assert (row.start, len(row.token_ids), row.position_offset) == (0, 21, 100)
    assert sched.num_preemptions == 0


@pytest.mark.slow
@pytest.mark.parametrize(("source", "t", "p"), [("hf", 1, 2), ("hf", 2, 1), ("gguf", 2, 1)])
def test_longrope_parallel(tmp_path: Path, source: str, t: int, p: int) -> None:
    """Worker processes over gloo: two pipeline stages (the rows' RoPE offsets reach every
    stage, micro-batched too), or two tensor-parallel ranks (the fused qkv_proj and
    gate_up_proj of the safetensors or GGUF file cut into each rank's heads and rows)."""
    from foudre.distributed.executor import ParallelExecutor
    from tests.quant.test_gguf import write_gguf

    path = _phi3(tmp_path, "longrope-partial")
    expected = _hf_scored(_hf(path), PROMPTS)
    model = path
    if source == "gguf":
        model = tmp_path / "phi3.gguf"
        write_gguf(path, model, "F32")
    llm = LLM(
        str(model),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=64,
        tensor_parallel_size=t,
        pipeline_parallel_size=p,
    )
    try:
        runner = llm.engine.runner
        assert isinstance(runner, ParallelExecutor)
        runner.micro_batch_tokens = 1  # every step of several rows in micro-batches
        _assert_scored(_scored(llm, PROMPTS), expected)
        assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]
    finally:
        llm.shutdown()


def test_older_config_layout_reads_as_transformers_does(tmp_path: Path) -> None:
    """A transformers-4 style config (Phi-3-mini-128k's "su" type, Phi-4-mini's top-level
    partial_rotary_factor): the same factors, original context, rotated width and attention
    factor as transformers' own reading of it."""
    import json

    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from foudre.layers.rotary import longrope_inv_freq, rope_attention_factor, rope_inv_freq
    from foudre.loading.hf import load_hf_config

    raw = {
        "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3",
        "vocab_size": 320,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 131072,
        "original_max_position_embeddings": 4096,
        "partial_rotary_factor": 0.75,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "su",
            "short_factor": [1.0 + 0.05 * i for i in range(12)],
            "long_factor": [1.0 + 2.5 * i for i in range(12)],
        },
        "sliding_window": 262144,
        "tie_word_embeddings": True,
    }
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_hf_config(tmp_path)
    hf = transformers.Phi3Config(**{k: v for k, v in raw.items() if k != "architectures"})
    assert cfg.rotary_dim == 24 and cfg.sliding_window == 262144 and cfg.rms_norm_eps == 1e-5
    assert cfg.rope_scaling is not None and cfg.rope_scaling["rope_type"] == "longrope"
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](hf)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, seq_len=4097)
    ours_short = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
    ours_long = longrope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling, long=True)
    torch.testing.assert_close(ours_short, short, rtol=1e-6, atol=0)
    torch.testing.assert_close(ours_long, long, rtol=1e-6, atol=0)
    assert rope_attention_factor(cfg.rope_scaling) == pytest.approx(factor, rel=1e-12)


@pytest.mark.parametrize("case", ["longrope-partial", "window-tied"])
def test_written_checkpoint_reads_back_in_transformers(tmp_path: Path, case: str) -> None:
    """``save_hf`` (compression, quantize's outputs) writes a phi3 directory transformers
    loads to the same logits: fused tensors kept fused, Phi-3's keys in config.json."""
    from foudre.loading.loader import load_model
    from foudre.loading.writer import save_hf

    src = _phi3(tmp_path, case)
    model = load_model(str(src), None, "float32", torch.device("cpu"), None).model
    out = save_hf(model, tmp_path / "written")
    ids = torch.tensor([PROMPTS[3]])
    with torch.no_grad():
        torch.testing.assert_close(_hf(out)(ids).logits, _hf(src)(ids).logits, atol=1e-5, rtol=0)


def test_longrope_beam_search_matches_transformers(tmp_path: Path) -> None:
    """Beams (a cohort) cross the original context together and are recomputed together, as
    transformers' beam search drops the cache of all its beams at once."""
    from foudre import BeamSearchParams

    path = _phi3(tmp_path, "longrope")
    hf = _hf(path)
    prompts = [[1, *range(100, 114)], list(range(1, 27))]  # 15 tokens: crosses; 26: past it
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=128)
    params = BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True)
    outs = llm.beam_search(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                num_beams=2,
                num_return_sequences=2,
                do_sample=False,
                max_new_tokens=10,
                pad_token_id=0,
            )
        assert [s.token_ids for s in out.sequences] == [r[len(prompt) :] for r in ref.tolist()]
    assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]
