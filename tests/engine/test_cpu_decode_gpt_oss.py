"""The native decoder layers of CPU decode steps (``runner/cpu_decode.py``, gpt-oss's parts in
``runner/cpu_decode_gpt_oss.py`` and ``native/decode_gpt_oss.h``) on gpt-oss: attention sinks,
alternating sliding-window (8, shorter than the contexts decoded) and full layers in cache
groups of their own, q/k/v/o biases, YaRN RoPE, the biased router and the clamped-SwiGLU experts
(float, int8 and MXFP4), against the model's Python path: the same logits, KV pages and routers'
counts, bit for bit (the same expert kernels), padding rows included; greedy generation through
``LLM`` the same with and without the native step; and what it leaves to Python."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.attention import cpu_paged
from foudre.layers import fused, fused_moe
from foudre.layers.linear import MAX_ROWS
from foudre.quant import mxfp4
from foudre.quant.experts import QuantExperts
from foudre.quant.mxfp4 import MXFP4Experts
from foudre.runner.cpu_decode import NativeDecode
from foudre.runner.model_runner import ModelRunner
from tests.conftest import make_hf_model
from tests.engine.test_cpu_decode import both_paths, counted, prefill_then_decode
from tests.oracles.test_gpt_oss import CONFIG, _mxfp4_checkpoint

pytestmark = pytest.mark.skipif(
    fused.decode_layers_fn(torch.float32) is None
    or not cpu_paged.available()
    or fused_moe._library() is None
    or mxfp4._library() is None,
    reason="neither AVX-512 nor AVX2, or no C++ compiler",
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("gpt_oss") / "m", "gpt_oss", **CONFIG)


@pytest.fixture(scope="module")
def mxfp4_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _mxfp4_checkpoint(model_dir, tmp_path_factory.mktemp("gpt_oss_mxfp4") / "m")


def _runner(path: Path, dtype: str, **options: Any) -> ModelRunner:
    llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, num_kv_blocks=200, **options)
    runner = llm.engine.runner
    assert isinstance(runner.decode_path, NativeDecode)
    assert len(runner.kv_groups) > 1  # the sliding layers' group and the full ones'
    return runner


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_equals_the_python_path(model_dir: Path, dtype: str) -> None:
    """Prefill prompts (blocks out of order, contexts past the window), then decode steps of 1,
    3 and ``MAX_ROWS`` rows: logits, every KV page and the routers' counts equal the Python
    path's, bit for bit."""
    runner = _runner(model_dir, dtype)
    prefill_then_decode(runner, MAX_ROWS[getattr(torch, dtype)])


@pytest.mark.parametrize(
    ("dtype", "kind", "options"),
    [
        ("bfloat16", QuantExperts, {"quantization": "int8"}),
        ("float32", QuantExperts, {"quantization": "int8", "kv_cache_dtype": "int8"}),
        ("bfloat16", MXFP4Experts, {}),
        ("float32", MXFP4Experts, {"kv_cache_dtype": "fp8"}),
    ],
)
def test_native_decode_runs_quantized_experts(
    model_dir: Path, mxfp4_dir: Path, dtype: str, kind: type, options: dict[str, Any]
) -> None:
    """int8 experts (``QuantExperts``, with int8 projections) and MXFP4 ones (a packed
    checkpoint), over float or quantized KV caches: the same bits as the Python path, which
    calls the same expert kernels; MXFP4 steps of at most ``GEMM_ROWS - 1`` rows (where its
    forward runs them natively)."""
    path = mxfp4_dir if kind is MXFP4Experts else model_dir
    runner = _runner(path, dtype, **options)
    assert all(isinstance(layer.mlp.experts, kind) for layer in runner.model.model.layers)
    native = runner.decode_path
    assert isinstance(native, NativeDecode)
    if kind is MXFP4Experts:
        assert native.max_rows == mxfp4.GEMM_ROWS - 1
    prefill_then_decode(runner, min(native.max_rows, 8))


def _prefilled(runner: ModelRunner) -> tuple[list[list[int]], list[int], list[list[int]]]:
    tables, lens = [[4, 9, 2], [1, 3], [11, 5, 6]], [21, 9, 17]
    with torch.inference_mode():
        logits = runner.forward(tables, [0] * 3, [list(range(3, 3 + n)) for n in lens], [1] * 3)
    assert logits is not None
    return tables, lens, [[int(t)] for t in logits.argmax(-1)]


@pytest.mark.parametrize("padding", [0, 2])
def test_native_decode_reads_each_cache_groups_tables(model_dir: Path, padding: int) -> None:
    """The sliding and full layers' groups, each with its own block tables, and rows that pad
    the step: logits, every page and the counts of the real rows equal the Python path's."""
    runner = _runner(model_dir, "bfloat16")
    calls = counted(runner)
    tables, lens, new = [[4, 9], [1], [7, 8]], [21, 7, 12], [[5], [6], [7]]
    groups = [[[30 + 2 * g, 50 + g], [70 + g], [80 + g, 90 + g]] for g in range(1, 2)]
    prompts = [list(range(3, 3 + n)) for n in lens]
    with torch.inference_mode():
        runner.forward(tables, [0] * 3, prompts, [1] * 3, 0, None, groups)
        native, ref = both_paths(runner, tables, lens, new, [1] * 3, padding, None, groups)
    assert torch.equal(native, ref) and calls == [3]


def test_native_decode_leaves_to_python_what_it_cannot_run(model_dir: Path) -> None:
    """Sinks written in place, or replaced, experts given another activation, or MXFP4-sized
    steps past their rows: those steps in Python (the same logits as the Python path), then
    native again once restored."""
    runner = _runner(model_dir, "float32")
    calls = counted(runner)
    tables, lens, new = _prefilled(runner)
    attn = runner.model.model.layers[1].self_attn
    experts = runner.model.model.layers[2].mlp.experts
    with torch.inference_mode():
        both_paths(runner, tables, lens, new, [1] * 3)
        assert calls == [3]
        sinks = attn.sinks
        with torch.no_grad():
            sinks.add_(1.0)  # (the native step holds a float32 copy: now stale)
        native, ref = both_paths(runner, tables, lens, new, [1] * 3)
        assert torch.equal(native, ref) and calls == [3]
        attn.sinks = torch.nn.Parameter(sinks.detach().clone(), requires_grad=False)
        runner.forward(tables, lens, new, [1] * 3)
        attn.sinks = sinks
        limit = experts.limit
        experts.limit = limit + 1.0  # (a float the call holds as built)
        runner.forward(tables, lens, new, [1] * 3)
        experts.limit = limit
        assert calls == [3]
    # rebuilt: native again, sinks as they are now
    runner.decode_path = NativeDecode.build(
        runner.model, runner.backend, runner.kv_caches, runner.block_size, -1,
        runner.group_of_layer,
    )  # fmt: skip
    calls = counted(runner)
    with torch.inference_mode():
        native, ref = both_paths(runner, tables, lens, new, [1] * 3)
    assert torch.equal(native, ref) and calls == [3]


def _generate_both_ways(path: Path, dtype: str, **options: Any) -> None:
    """Greedy generation through ``LLM`` gives the same tokens with the native step (which ran)
    as eagerly (none), past the window, and every block back in the pool."""
    prompts = [[1, 5, 9, 23], list(range(1, 30)), [1, *range(100, 117)]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    calls: list[int] = []
    for eager in (False, True):
        llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, enforce_eager=eager, **options)
        if not eager:
            calls = counted(llm.engine.runner)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]
    assert outs[0] == outs[1] and len(calls) >= 10


@pytest.mark.parametrize(
    ("dtype", "options"),
    [("float32", {}), ("bfloat16", {}), ("bfloat16", {"quantization": "int8"})],
)
def test_generate_is_the_same_with_and_without_native_decode(
    model_dir: Path, dtype: str, options: dict[str, Any]
) -> None:
    _generate_both_ways(model_dir, dtype, **options)


def test_generate_mxfp4_is_the_same_with_and_without_native_decode(mxfp4_dir: Path) -> None:
    _generate_both_ways(mxfp4_dir, "bfloat16")
