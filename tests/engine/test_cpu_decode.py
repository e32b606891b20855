"""The native decoder layers of CPU decode steps (``runner/cpu_decode.py``) against the model's
Python path: the same logits and KV cache bit for bit, and the steps and models they leave to
Python."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.layers import fused
from foudre.layers.linear import MAX_ROWS
from foudre.runner.attention import cpu_paged
from foudre.runner.model_runner import ModelRunner
from tests.conftest import make_hf_model

pytestmark = pytest.mark.skipif(
    fused.decode_layers_fn(torch.float32) is None or not cpu_paged.available(),
    reason="no AVX-512 or no C++ compiler",
)

ARCHS: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),  # GQA
    ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),  # MQA, tied
    ("qwen2", {}),  # q/k/v bias
    ("qwen3", {"head_dim": 24}),  # q/k norm, head_dim from the config
]


def make_runner(tmp_path: Path, dtype: str, arch: str = "llama", **overrides: Any) -> ModelRunner:
    path = make_hf_model(tmp_path / arch, arch, **overrides)
    llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, num_kv_blocks=64)
    return llm.engine.runner


def counted(runner: ModelRunner) -> list[int]:
    """The row counts of the steps the native layers run from now on."""
    assert runner.native is not None
    calls: list[int] = []
    run = runner.native.run
    runner.native.run = lambda ids, *a: calls.append(len(ids)) or run(ids, *a)  # type: ignore[method-assign]
    return calls


def python_step(runner: ModelRunner, *args: Any) -> torch.Tensor | None:
    native, runner.native = runner.native, None
    try:
        return runner.forward(*args)
    finally:
        runner.native = native


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "overrides"), ARCHS)
def test_native_decode_equals_the_python_path(
    tmp_path: Path, dtype: str, arch: str, overrides: dict[str, Any]
) -> None:
    """Prefill three prompts (blocks out of order, contexts crossing block boundaries), then
    decode steps: each step's logits and the K/V it writes equal the Python path's, bit for
    bit."""
    runner = make_runner(tmp_path, dtype, arch, **overrides)
    assert runner.native is not None
    calls = counted(runner)
    g = torch.Generator().manual_seed(0)
    lens = [5, 16, 31]
    tables = [[9, 2, 40], [7, 0, 3], [30, 12, 5]]
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]
    with torch.inference_mode():
        logits = runner.forward(tables, [0, 0, 0], prompts, [1, 1, 1])
        assert logits is not None and calls == []  # a prefill step: Python
        for step in range(3):
            new = [[int(t)] for t in logits.argmax(-1)]
            starts = [n + step for n in lens]
            logits = runner.forward(tables, starts, new, [1, 1, 1])
            caches = [c.clone() for c in runner.kv_caches]
            ref = python_step(runner, tables, starts, new, [1, 1, 1])  # rewrites the same slots
            assert logits is not None and ref is not None
            assert torch.equal(logits, ref), (step, (logits - ref).abs().max())
            assert all(torch.equal(a, b) for a, b in zip(caches, runner.kv_caches, strict=True))
    assert calls == [3, 3, 3]


def test_native_decode_takes_only_what_it_can_run(tmp_path: Path) -> None:
    """Decode rows only and at most ``MAX_ROWS``; a weight replaced after the build sends steps
    back to Python (which then computes with the new weight); a position past the RoPE tables
    raises as the Python path does."""
    runner = make_runner(tmp_path, "bfloat16")
    calls = counted(runner)
    limit = MAX_ROWS[torch.bfloat16]
    tables = [[i] for i in range(limit + 1)]
    with torch.inference_mode():
        runner.forward(tables, [0] * (limit + 1), [[5, 6]] * (limit + 1), [1] * (limit + 1))
        runner.forward(tables, [2] * (limit + 1), [[7]] * (limit + 1), [1] * (limit + 1))
        runner.forward(tables[:limit], [3] * limit, [[8]] * limit, [1] * limit)
        runner.forward(tables[:2], [4, 4], [[9], [10, 11]], [1, 1])  # a decode row and a chunk
        assert calls == [limit]
        down = runner.model.model.layers[1].mlp.down_proj
        down.weight = torch.nn.Parameter(down.weight * 2, requires_grad=False)
        assert runner.forward(tables[:1], [6], [[12]], [1]) is not None
        assert calls == [limit]
        rope_table = runner.model.model.rotary.cos.shape[0]
        far = [list(range(rope_table // 16 + 1))]
    fresh = make_runner(tmp_path / "fresh", "float32")
    with torch.inference_mode(), pytest.raises(IndexError, match="RoPE position"):
        fresh.forward(far, [rope_table], [[5]], [1])
    assert fresh.native is not None


def test_native_decode_is_off_where_it_cannot_run(tmp_path: Path) -> None:
    path = make_hf_model(tmp_path / "m", "llama")

    def native(**options: Any) -> object:
        llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=40, **options)
        return llm.engine.runner.native

    assert native(dtype="bfloat16") is not None
    assert native(dtype="bfloat16", enforce_eager=True) is None  # eager: op by op
    assert native(dtype="float16") is None  # no fused float16 kernels
    assert native(dtype="float32", attention_backend="torch") is None
    assert native(dtype="float32", quantization="int8") is None  # quantized layers
    runner = make_runner(tmp_path, "float32")
    runner.model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    from foudre.runner.cpu_decode import NativeDecode

    assert NativeDecode.build(runner.model, runner.backend, runner.kv_caches) is None


def test_generate_is_the_same_with_and_without_native_decode(tmp_path: Path) -> None:
    path = make_hf_model(tmp_path / "m", "llama")
    prompts = [[1, 5, 9, 23], [1, 77] * 9, [1, 3]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for eager in (False, True):
        llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, enforce_eager=eager)
        if not eager:
            calls = counted(llm.engine.runner)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]
    assert outs[0] == outs[1] and len(calls) >= 10
