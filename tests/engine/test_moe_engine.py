"""Everything else keeps working with a mixture-of-experts model: the equivalence tests (batch vs
single, prefix caching, preemption, chunked prefill), seeded sampling whatever the batch,
speculative decoding with a dense draft, quantization, router statistics (``LLM.metrics()`` and
Prometheus), the server and ``bench``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.bench.roofline import weight_bytes
from foudre.cli import main
from foudre.metrics.prometheus import PrometheusMetrics
from foudre.runner.cpu_decode import NativeDecode
from foudre.runner.step import ForwardStep
from tests.conftest import STORIES, make_hf_model

MOE = dict(  # 3 layers: sparse, dense, sparse; 6 experts top-2 and a gated shared expert
    vocab_size=512,
    num_hidden_layers=3,
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    shared_expert_intermediate_size=64,
    mlp_only_layers=[1],
)
PROMPTS = [[1, *range(10, 10 + k)] + [7] * (i + 1) for i, k in enumerate([30, 30, 12, 45, 3, 20])]
PROMPTS[1] = [*PROMPTS[0][:25], 99, 98]  # shares a prefix with the first


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = make_hf_model(tmp_path_factory.mktemp("moe"), "qwen2_moe", **MOE)
    if (STORIES / "tok512.bin").exists():  # a tokenizer of its vocabulary, for the server
        shutil.copy(STORIES / "tok512.bin", path / "tokenizer.bin")
    return str(path)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0.0, max_tokens=20 + 7 * i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]


def _llm(model: str, **kwargs: Any) -> LLM:
    kwargs = {"dtype": "float32", "skip_tokenizer_init": True, "max_model_len": 256, **kwargs}
    return LLM(model, **kwargs)


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[list[int]]:
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"] and m["kv_cache_usage"] == 0.0
    llm.engine.scheduler.check_invariants()
    return outs


@pytest.fixture(scope="module")
def baseline(moe_model: str) -> list[list[int]]:
    """No prefix caching, whole prompts, one request at a time."""
    llm = _llm(moe_model, enable_prefix_caching=False)
    return [_generate(llm, [p], [s])[0] for p, s in zip(PROMPTS, _params(), strict=True)]


def test_batch_equals_single_requests(moe_model: str, baseline: list[list[int]]) -> None:
    llm = _llm(moe_model, enable_prefix_caching=False)
    assert _generate(llm, PROMPTS, _params()) == baseline


def test_prefix_caching_hits_and_matches_cold_runs(
    moe_model: str, baseline: list[list[int]]
) -> None:
    llm = _llm(moe_model, enable_prefix_caching=True, block_size=4)
    assert _generate(llm, PROMPTS, _params()) == baseline
    first = llm.metrics()["prefix_cache_hits"]
    assert first > 0
    assert _generate(llm, PROMPTS, _params()) == baseline  # warm: whole prompts hit
    assert llm.metrics()["prefix_cache_hits"] > first


def test_preemption_matches_uninterrupted(moe_model: str, baseline: list[list[int]]) -> None:
    for caching in (False, True):
        llm = _llm(moe_model, num_kv_blocks=8, max_model_len=128, enable_prefix_caching=caching)
        assert _generate(llm, PROMPTS, _params()) == baseline
        assert llm.metrics()["num_preemptions"] > 0


def test_chunked_prefill_matches_whole_prompts(moe_model: str, baseline: list[list[int]]) -> None:
    for budget in (3, 7, 16):
        llm = _llm(moe_model, max_num_batched_tokens=budget, enable_prefix_caching=False)
        assert _generate(llm, PROMPTS, _params()) == baseline


def test_seeded_sampling_whatever_the_batch(moe_model: str) -> None:
    llm = _llm(moe_model)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=25, seed=1234, ignore_eos=True)
    alone = llm.generate([PROMPTS[2]], seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=10 + i, ignore_eos=True) for i in range(4)]
    batch = llm.generate(
        [PROMPTS[0], PROMPTS[2], PROMPTS[3], PROMPTS[4], PROMPTS[5]],
        [others[0], seeded, others[1], others[2], others[3]],
    )
    assert batch[1].outputs[0].token_ids == alone


def test_native_decode_step_refuses_a_narrower_shared_expert(moe_model: str) -> None:
    """The native decode step runs sparse layers (tests/engine/test_cpu_decode.py; a gated
    shared expert too: test_cpu_decode_qwen3_next.py) at one intermediate size: this model's
    shared expert is narrower than its dense layer's MLP, so its steps stay in Python."""
    llm = _llm(moe_model)
    runner = llm.engine.runner
    assert runner.decode_path is None
    assert NativeDecode.build(runner.model, runner.backend, runner.kv_caches) is None


def _dense_draft_for_mixtral(tmp_path: Path) -> tuple[Path, Path]:
    """A Mixtral whose experts are near-copies of one MLP, and the dense Llama with that MLP and
    the same attention: the draft agrees with the target most of the time, not always."""
    import transformers

    shape = dict(num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2)
    target = make_hf_model(tmp_path / "target", "mixtral", **shape)
    moe = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    cfg = moe.config
    draft_dir = make_hf_model(tmp_path / "draft", "llama", num_hidden_layers=2)
    dense = transformers.AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32)
    inter = cfg.intermediate_size
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for moe_layer, layer in zip(moe.model.layers, dense.model.layers, strict=True):
            experts = moe_layer.mlp.experts
            gate_up, down = experts.gate_up_proj[0].clone(), experts.down_proj[0].clone()
            for e in range(cfg.num_local_experts):
                experts.gate_up_proj[e] = gate_up + 0.04 * torch.randn(gate_up.shape, generator=g)
                experts.down_proj[e] = down + 0.04 * torch.randn(down.shape, generator=g)
            layer.mlp.gate_proj.weight.copy_(gate_up[:inter])
            layer.mlp.up_proj.weight.copy_(gate_up[inter:])
            layer.mlp.down_proj.weight.copy_(down)
            layer.self_attn.load_state_dict(moe_layer.self_attn.state_dict())
            layer.input_layernorm.load_state_dict(moe_layer.input_layernorm.state_dict())
            layer.post_attention_layernorm.load_state_dict(
                moe_layer.post_attention_layernorm.state_dict()
            )
        for name in ("embed_tokens", "norm"):
            getattr(dense.model, name).load_state_dict(getattr(moe.model, name).state_dict())
        dense.lm_head.load_state_dict(moe.lm_head.state_dict())
    moe.save_pretrained(target)
    dense.save_pretrained(draft_dir)
    return target, draft_dir


def test_dense_draft_speculates_for_an_moe_target(tmp_path: Path) -> None:
    target, draft = _dense_draft_for_mixtral(tmp_path)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 3
    prompts = PROMPTS[:3]
    plain = _generate(_llm(str(target)), prompts, params)
    llm = _llm(str(target), speculative_model=str(draft), num_speculative_tokens=3)
    assert _generate(llm, prompts, params) == plain
    m = llm.metrics()
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_moe_model_runs_batched_like_single(moe_model: str, method: str) -> None:
    llm = _llm(moe_model, quantization=method, enable_prefix_caching=False)
    params = _params()[:3]
    batch = _generate(llm, PROMPTS[:3], params)
    assert batch == [_generate(llm, [p], [s])[0] for p, s in zip(PROMPTS[:3], params, strict=True)]


def test_router_statistics_in_metrics_and_prometheus(moe_model: str) -> None:
    llm = _llm(moe_model, enable_prefix_caching=False)  # every prompt token computed
    assert llm.metrics()["moe_expert_tokens"] == {0: [0] * 6, 2: [0] * 6}
    outs = llm.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=5))
    computed = sum(len(p) for p in PROMPTS[:2]) + sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    counts = llm.metrics()["moe_expert_tokens"]
    assert sorted(counts) == [0, 2]  # layer 1 is dense
    assert all(sum(c) == 2 * computed for c in counts.values())  # top-2 of every token
    text = PrometheusMetrics(llm.metrics).render().decode()
    assert "# TYPE foudre:moe_expert_tokens_total counter" in text
    line = f'foudre:moe_expert_tokens_total{{expert="3",layer="2"}} {float(counts[2][3])}'
    assert line in text


def test_server_and_bench_on_an_moe_model(
    moe_model: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if not (Path(moe_model) / "tokenizer.bin").exists():
        pytest.skip("../shared/models/stories260K is not present")
    from tests.server.conftest import start_in_process, stop_in_process

    srv = start_in_process(engine={"model": moe_model, "tokenizer": None, "dtype": "float32"})
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            body = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}
            resp = http.post("/v1/completions", json=body)
            assert resp.status_code == 200, resp.text
            assert resp.json()["usage"]["completion_tokens"] == 8
            scrape = http.get("/metrics").text
            assert 'foudre:moe_expert_tokens_total{expert="0",layer="0"}' in scrape
    finally:
        stop_in_process(srv)

    out = tmp_path / "lat.json"
    rc = main(["bench", "latency", "--model", moe_model, "--batch-size", "2",
               "--input-len", "16", "--output-len", "6", "--num-iters", "1",
               "--bandwidth", "20", "--save-result", str(out)])  # fmt: skip
    assert rc == 0 and "roofline" in capsys.readouterr().out
    res = json.loads(out.read_text())
    # the roofline counts the bytes a token reads: top-2 of 6 experts in each sparse layer
    model = _llm(moe_model).engine.runner.model
    everything = (
        sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    )
    experts = sum(
        b.experts.gate_up_proj.numel() + b.experts.down_proj.numel()
        for b in model.moe_blocks().values()
    )
    assert res["weight_bytes"] == weight_bytes(model)
    assert weight_bytes(model) == pytest.approx(4 * (everything - experts * 4 / 6), abs=8)


def test_padding_rows_of_rectangular_batches_are_not_counted(moe_model: str) -> None:
    """A static batch computes a throw-away token for each finished member each step; the
    routers count only the real tokens. A CUDA graph's warm-up run (``graph_forward`` outside a
    capture) counts nothing."""
    llm = _llm(moe_model, enable_prefix_caching=False, scheduling_policy="static", max_num_seqs=3)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (2, 9, 4)]
    outs = llm.generate(PROMPTS[:3], params)
    computed = sum(len(p) for p in PROMPTS[:3]) + sum(len(o.outputs[0].token_ids) - 1 for o in outs)
    m = llm.metrics()
    assert m["num_padding_tokens"] > 0
    assert all(sum(c) == 2 * computed for c in m["moe_expert_tokens"].values())
    runner = llm.engine.runner
    blocks = runner.model.moe_blocks().values()
    assert all(b.routed_rows is runner.model.routed_rows for b in blocks)  # one count, set once
    step = ForwardStep([[0]], [0], [[5, 6, 7]], [1])
    runner.flatten(step)
    assert step.input_ids is not None and step.positions is not None
    runner.model.count_moe_rows(3)
    with torch.inference_mode():
        runner.graph_forward(step.input_ids, step.positions, step.metadata)  # a warm-up run
        assert llm.metrics()["moe_expert_tokens"] == m["moe_expert_tokens"]
        runner.forward_hidden(step.input_ids, step.positions, step.metadata)
    assert all(sum(c) == 2 * (computed + 3) for c in llm.metrics()["moe_expert_tokens"].values())
