"""Oracle: tensor- and pipeline-parallel engines against the one-device engine on the same random
weights: greedy tokens identical, token for token, for a batch with prefix-cache hits and
preemptions (a small KV pool), for T=2, T=4 (KV heads replicated), P=2 and T=2 x P=2, on Llama
with GQA, Qwen2 with q/k/v biases and a tied vocabulary that T does not divide, and mixtures of
experts (expert parallelism); seeded sampling draws the same tokens, and so do speculative
verification, forked samples, GGUF and llama2.c files; quantized shards lose no more than one
device does. Worker processes on the CPU over gloo, in float32."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from foudre import LLM, SamplingParams
from foudre.distributed.executor import ParallelExecutor
from tests.conftest import SHARED, make_hf_model

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", {"num_hidden_layers": 3}),
    # vocabulary 251: two ranks hold 126 rows each, the last one padding
    "qwen2-bias-tied": ("qwen2", {"tie_word_embeddings": True, "vocab_size": 251}),
    # layer 0 full attention, layer 1 a window of 6: each stage keeps its own layers' kinds
    "qwen2-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "mixtral": ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen2-moe-shared": (
        "qwen2_moe",
        {
            "num_hidden_layers": 3,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 64,
            "mlp_only_layers": [1],
        },
    ),
}

# prompts sharing a 12-token prefix (prefix-cache hits, in the same step and later) and others
PREFIX = [1, 17, 29, 41, 53, 67, 79, 83, 97, 101, 113, 127]
PROMPTS = [
    [*PREFIX, 5, 9],
    [*PREFIX, 5, 9],
    [1, 200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 210, 3],
    [*PREFIX, 44],
    [1, 42],
    list(range(1, 30)),
]
# 4-token blocks, 20 of them: the batch needs more, so requests are preempted and recomputed
ENGINE: dict[str, Any] = dict(
    dtype="float32",
    skip_tokenizer_init=True,
    block_size=4,
    num_kv_blocks=20,
    max_model_len=64,
    enable_prefix_caching=True,
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
SEEDED = [
    SamplingParams(temperature=0.9, top_p=0.95, seed=7 + i, max_tokens=10, ignore_eos=True)
    for i in range(len(PROMPTS))
]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("parallel")
    return {case: make_hf_model(root / case, arch, **kw) for case, (arch, kw) in MODELS.items()}


Tokens = list[list[int]]


def _run(llm: LLM) -> tuple[Tokens, dict[str, Any], Tokens]:
    """Greedy tokens, the metrics after them, then seeded samples (each prompt its seed)."""
    greedy = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    metrics = llm.metrics()
    seeded = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SEEDED)]
    return greedy, metrics, seeded


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> dict[str, tuple[Tokens, dict[str, Any], Tokens]]:
    """What the one-device engine gives per model (``_run``)."""
    return {case: _run(LLM(str(path), **ENGINE)) for case, path in models.items()}


def _parallel(path: Path, t: int, p: int, cut: bool = False) -> Iterator[LLM]:
    """A ``T x P`` engine; ``cut``: every step of more than one row in micro-batches (else only
    steps of hundreds of tokens are, which this test's batch never has)."""
    llm = LLM(str(path), tensor_parallel_size=t, pipeline_parallel_size=p, **ENGINE)
    if cut:
        runner = llm.engine.runner
        assert isinstance(runner, ParallelExecutor)
        runner.micro_batch_tokens = 1
    try:
        yield llm
    finally:
        llm.shutdown()


def _check_accounting(llm: LLM) -> None:
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    assert llm.engine.healthy


@pytest.mark.parametrize(
    ("case", "t", "p", "cut"),
    [
        ("llama-gqa", 2, 1, False),
        ("llama-gqa", 1, 2, False),
        ("llama-gqa", 1, 2, True),
        # 2 KV heads, 4 ranks: each KV head on two ranks
        pytest.param("llama-gqa", 4, 1, False, marks=pytest.mark.slow),
        ("qwen2-bias-tied", 2, 1, False),
        ("qwen2-window", 1, 2, False),
        pytest.param("qwen2-bias-tied", 2, 2, True, marks=pytest.mark.slow),
        ("mixtral", 2, 1, False),
        pytest.param("qwen2-moe-shared", 2, 2, True, marks=pytest.mark.slow),
    ],
)
def test_greedy_and_seeded_match_one_device(
    models: dict[str, Path],
    reference: dict[str, tuple[Tokens, dict[str, Any], Tokens]],
    case: str,
    t: int,
    p: int,
    cut: bool,
) -> None:
    want, ref_metrics, want_seeded = reference[case]
    assert ref_metrics["num_preemptions"] > 0 and ref_metrics["prefix_cache_hits"] > 0
    for llm in _parallel(models[case], t, p, cut):
        got, m, seeded = _run(llm)
        assert got == want
        assert seeded == want_seeded  # rank 0 samples, with the engine's generators
        assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
        # the routers' counts of the engine's stage (the last), by the whole model's layer index
        ref_moe, moe = ref_metrics["moe_expert_tokens"], m["moe_expert_tokens"]
        assert bool(moe) == bool(ref_moe)
        assert all(moe[i] == ref_moe[i] for i in moe)
        _check_accounting(llm)


QUANT_MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    # int4 groups of 128 input features: o_proj's and down_proj's shards hold whole groups
    "llama": ("llama", {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8}),
    "mixtral": (
        "mixtral",
        {"hidden_size": 256, "intermediate_size": 256, "num_attention_heads": 8},
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize(("case", "method"), [("llama", "int4"), ("mixtral", "int8")])
def test_quantized_shards_lose_no_more_than_one_device(
    tmp_path: Path, case: str, method: str
) -> None:
    """Each rank quantizes its own slices (experts included): the sharded model's first-token
    log-probabilities stay as close to the float model's as the one-device quantized model's
    (the quantized kernels round each rank's activations and partial sums on their own, and
    row-parallel int8 rows get their own scales, so tokens may part after a while; the error
    must not grow)."""
    arch, overrides = QUANT_MODELS[case]
    path = make_hf_model(tmp_path / case, arch, **overrides)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=20)

    def logprobs(llm: LLM) -> list[dict[int, float]]:
        out = []
        for o in llm.generate(PROMPTS, params):
            assert o.outputs[0].logprobs is not None
            out.append(o.outputs[0].logprobs[0])
        return out

    def error(a: list[dict[int, float]], b: list[dict[int, float]]) -> float:
        return max(
            max(abs(x[t] - y[t]) for t in set(x) & set(y)) for x, y in zip(a, b, strict=True)
        )

    exact = logprobs(LLM(str(path), **ENGINE))
    one = logprobs(LLM(str(path), quantization=method, **ENGINE))
    llm = LLM(str(path), tensor_parallel_size=2, quantization=method, **ENGINE)
    try:
        sharded = logprobs(llm)
        assert any(type(m).__name__ == "QuantLinear" for m in llm.engine.model.modules())
    finally:
        llm.shutdown()
    assert error(exact, sharded) <= 1.5 * error(exact, one) + 0.02


def test_speculative_verification_and_forks_match_one_device(models: dict[str, Path]) -> None:
    """Rows that verify n-gram drafts (several logits each) and samples forked from one prompt
    (``n`` > 1) run sharded as on one device."""
    engine = {**ENGINE, "num_kv_blocks": 64, "speculative_method": "ngram"}
    greedy = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    forked = SamplingParams(temperature=0.8, n=3, seed=3, max_tokens=8, ignore_eos=True)

    def run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy)]
        samples = [c.token_ids for o in llm.generate(PROMPTS[:2], forked) for c in o.outputs]
        return plain, samples

    want = run(LLM(str(models["llama-gqa"]), **engine))
    llm = LLM(str(models["llama-gqa"]), tensor_parallel_size=2, **engine)
    try:
        assert run(llm) == want
        assert llm.metrics()["spec_num_drafts"] > 0
        _check_accounting(llm)
    finally:
        llm.shutdown()


def test_gguf_and_llama2c_files_shard(tmp_path: Path) -> None:
    """Whole tensors from GGUF (q/k rows un-permuted first) and llama2.c files are cut as they
    come: T=2 (GGUF) and P=2 (llama2.c) give the one-device greedy tokens."""
    from tests.quant.test_gguf import write_gguf

    gguf_path = tmp_path / "model.gguf"
    write_gguf(make_hf_model(tmp_path / "hf", "llama"), gguf_path, "F32")
    files = [(str(gguf_path), 2, 1)]
    stories = SHARED / "models" / "stories260K" / "stories260K.bin"
    if stories.exists():
        files.append((str(stories), 1, 2))
    engine = {**ENGINE, "max_model_len": 48}
    for path, t, p in files:
        want = [o.outputs[0].token_ids for o in LLM(path, **engine).generate(PROMPTS, GREEDY)]
        for llm in _parallel(Path(path), t, p):
            assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
