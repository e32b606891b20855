"""The native decoder layers of CPU decode steps (``runner/cpu_decode.py``) against the model's
Python path: the same logits and KV cache bit for bit, and the steps and models they leave to
Python."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from foudre import LLM, SamplingParams
from foudre.attention import cpu_paged
from foudre.attention.quantized_cache import QuantizedKVCache
from foudre.layers import fused
from foudre.layers.linear import MAX_ROWS, Linear
from foudre.layers.mlp import GatedMLP
from foudre.layers.moe import RoutedRows, SparseMoeBlock
from foudre.quant import cpu_qmatmul, set_compute_dtype
from foudre.quant.api import Int4WeightOnly, Int8WeightOnly, matches, quantize_
from foudre.quant.qlinear import (
    AMX_GEMM_ROWS,
    AMX_GROUPS32_GEMM_ROWS,
    DEQUANTIZED_GEMM_ROWS,
    GROUPED8_GEMM_ROWS,
    QuantLinear,
    dequantized_gemm_rows,
)
from foudre.runner.cpu_decode import NativeDecode
from foudre.runner.model_runner import ModelRunner
from foudre.runner.step import ForwardStep
from tests.conftest import make_hf_model
from tests.oracles.test_phi3 import CASES as PHI3_CASES
from tests.quant.test_cpu_qmatmul import quant_module

pytestmark = pytest.mark.skipif(
    fused.decode_layers_fn(torch.float32) is None or not cpu_paged.available(),
    reason="neither AVX-512 nor AVX2, or no C++ compiler",
)

QWEN3_MOE: dict[str, Any] = {  # sparse, dense, sparse layers: 6 experts, top-2
    "num_hidden_layers": 3,
    "num_experts": 6,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 48,
    "mlp_only_layers": [1],
}
GEMMA3: dict[str, Any] = {  # a window wider than the contexts decoded (the native step's)
    "num_hidden_layers": 3,
    "sliding_window": 128,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
    "head_dim": 16,
    "query_pre_attn_scalar": 24,
    "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 50_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
    },
}
ARCHS: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),  # GQA, 2 query heads per KV head
    ("llama", {"num_attention_heads": 8, "num_key_value_heads": 2}),  # 4 per KV head
    ("llama", {"num_key_value_heads": 1, "tie_word_embeddings": True}),  # MQA, tied
    ("qwen2", {}),  # q/k/v bias
    ("qwen3", {"head_dim": 24}),  # q/k norm, head_dim from the config
    ("mixtral", {"num_hidden_layers": 3, "num_local_experts": 4}),  # top-2, renormalised
    ("qwen3_moe", QWEN3_MOE),  # q/k norm; top-2 not renormalised, a dense layer between
    ("phi3", {"partial_rotary_factor": 0.75, "pad_token_id": 0}),  # RoPE over 3/4 of each head
    ("gemma3_text", GEMMA3),  # (1 + weight) norms around both sublayers, GeGLU, two RoPE tables
]
# Phi-4-mini's shape: LongRoPE over 3/4 of each head
LONGROPE_PHI3: dict[str, Any] = {"pad_token_id": 0, **PHI3_CASES["longrope-partial"]}


def make_runner(tmp_path: Path, dtype: str, arch: str = "llama", **overrides: Any) -> ModelRunner:
    path = make_hf_model(tmp_path / arch, arch, **overrides)
    llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, num_kv_blocks=200)
    return llm.engine.runner


def counted(runner: ModelRunner) -> list[int]:
    """The row counts of the steps the native layers run (or try to) from now on."""
    native = runner.decode_path
    assert isinstance(native, NativeDecode)
    calls: list[int] = []
    call = native._call  # what run and run_logits call
    native._call = lambda step, logits: calls.append(len(step.token_ids)) or call(step, logits)  # type: ignore[method-assign]
    return calls


def python_step(runner: ModelRunner, *args: Any) -> torch.Tensor | None:
    native, runner.decode_path = runner.decode_path, None
    try:
        return runner.forward(*args)
    finally:
        runner.decode_path = native


def added(runner: ModelRunner, before: dict[int, list[int]]) -> dict[int, list[int]]:
    """What the routers counted (tokens per expert, by layer) since ``before``."""
    now = runner.model.moe_expert_tokens()
    return {i: [b - a for a, b in zip(before[i], c, strict=True)] for i, c in now.items()}


def pool(runner: ModelRunner) -> list[torch.Tensor]:
    """The tensors that hold the runner's K/V: each cache, or a quantized one's codes and scales."""
    held: list[torch.Tensor] = []
    for c in runner.kv_caches:
        held += [c.codes, c.scales] if isinstance(c, QuantizedKVCache) else [c]
    return held


def both_paths(runner: ModelRunner, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """One step's logits by each path from the same cache, and each path's whole cache after it
    (a stray write anywhere in the pool shows) and its counts of tokens per expert."""
    before = [t.clone() for t in pool(runner)]
    counts = runner.model.moe_expert_tokens()
    native = runner.forward(*args)
    after_native = [t.clone() for t in pool(runner)]
    native_counts, counts = added(runner, counts), runner.model.moe_expert_tokens()
    for t, b in zip(pool(runner), before, strict=True):
        t.copy_(b)
    ref = python_step(runner, *args)
    assert native is not None and ref is not None
    for a, b in zip(after_native, pool(runner), strict=True):
        assert torch.equal(a, b)
    assert native_counts == added(runner, counts)
    return native, ref


def prefill_then_decode(runner: ModelRunner, limit: int) -> None:
    """Prefill ``limit`` prompts (blocks out of order, contexts across block boundaries) in
    Python, then decode steps of 1, 3 and ``limit`` rows natively: each step's logits and the
    whole pool equal the Python path's, bit for bit (``both_paths``)."""
    calls = counted(runner)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(200, generator=g).tolist()
    lens = [5, 16, 31, *torch.randint(1, 40, (limit - 3,), generator=g).tolist()]
    tables = [order[3 * i : 3 * i + 3] for i in range(limit)]
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in lens]
    with torch.inference_mode():
        logits = runner.forward(tables, [0] * limit, prompts, [1] * limit)
        assert logits is not None and calls == []  # a prefill step: Python
        for rows in (1, 3, limit):
            new = [[int(t)] for t in logits.argmax(-1)[:rows]]
            native, ref = both_paths(runner, tables[:rows], lens[:rows], new, [1] * rows)
            assert torch.equal(native, ref), (rows, (native - ref).abs().max())
            lens[:rows] = [n + 1 for n in lens[:rows]]
            logits = torch.cat([native, logits[rows:]])
    assert calls == [1, 3, limit]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("arch", "overrides"), ARCHS)
def test_native_decode_equals_the_python_path(
    tmp_path: Path, dtype: str, arch: str, overrides: dict[str, Any]
) -> None:
    """Prefill prompts (blocks out of order, contexts across block boundaries), then decode
    steps of 1, 3 and ``MAX_ROWS`` rows: logits and the whole KV pool equal the Python path's,
    bit for bit, and so do the mixture-of-experts routers' counts."""
    runner = make_runner(tmp_path, dtype, arch, **overrides)
    prefill_then_decode(runner, MAX_ROWS[getattr(torch, dtype)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_native_decode_counts_the_real_rows(tmp_path: Path, dtype: str) -> None:
    """The sparse layers count each real row's top-2 experts, as the Python path does: not the
    rows that pad a batch, nothing while counting is off. Blocks that would count different
    rows, or counts replaced since the build, send the step to Python."""
    runner = make_runner(tmp_path, dtype, "qwen3_moe", **QWEN3_MOE)
    calls = counted(runner)
    tables, lens, new = [[4], [9], [2]], [5, 3, 7], [[11], [12], [13]]

    def totals(before: dict[int, list[int]]) -> list[int]:
        return [sum(c) for c in added(runner, before).values()]  # layers 0 and 2

    with torch.inference_mode():
        runner.forward(tables, [0, 0, 0], [[7] * n for n in lens], [1, 1, 1])
        for padding in (0, 1, 2):
            before = runner.model.moe_expert_tokens()
            native, ref = both_paths(runner, tables, lens, new, [1, 1, 1], padding)
            assert torch.equal(native, ref)
            assert totals(before) == [2 * 2 * (3 - padding)] * 2  # top-2, by both paths
        before = runner.model.moe_expert_tokens()
        with runner.model.moe_counting(False):
            both_paths(runner, tables, lens, new, [1, 1, 1])
        assert totals(before) == [0, 0] and calls == [3, 3, 3, 3]
        blocks = runner.model.moe_blocks()
        shared = blocks[2].routed_rows
        blocks[2].routed_rows = RoutedRows()  # a block counting by rows of its own
        blocks[2].routed_rows.on = False
        before = runner.model.moe_expert_tokens()
        runner.forward(tables, lens, new, [1, 1, 1])
        assert totals(before) == [6, 0] and calls == [3, 3, 3, 3]  # in Python
        blocks[2].routed_rows = shared
        counts = blocks[0].expert_tokens
        blocks[0].expert_tokens = counts.clone()  # counts the call does not hold
        runner.forward(tables, lens, new, [1, 1, 1])
        assert calls == [3, 3, 3, 3]
        blocks[0].expert_tokens = counts
        runner.forward(tables, lens, new, [1, 1, 1])
    assert calls == [3, 3, 3, 3, 3]


def test_native_decode_takes_only_what_it_can_run(tmp_path: Path) -> None:
    """Decode rows only and at most ``MAX_ROWS``; weights replaced or moved after the build,
    a hook, autocast or a replaced KV cache send steps back to Python; out-of-range positions,
    slots and token ids raise before anything is written."""
    runner = make_runner(tmp_path, "bfloat16")
    native = runner.decode_path
    assert native is not None
    calls = counted(runner)
    limit = MAX_ROWS[torch.bfloat16]
    tables = [[i] for i in range(limit + 1)]

    def decode(n: int = 1, start: int = 4) -> None:
        runner.forward(tables[:n], [start] * n, [[9]] * n, [1] * n)

    with torch.inference_mode():
        runner.forward(tables, [0] * (limit + 1), [[5, 6, 7, 8]] * (limit + 1), [1] * (limit + 1))
        decode(limit + 1)
        decode(limit)
        runner.forward(tables[:2], [4, 4], [[9], [10, 11]], [1, 1])  # a decode row and a chunk
        assert calls == [limit]
        layer = runner.model.model.layers[1]
        down = layer.mlp.down_proj
        old = down.weight.data
        down.weight.data = old * 2  # same Parameter, new storage
        decode()
        down.weight.data = old
        decode()
        assert calls == [limit, 1]
        down.weight = torch.nn.Parameter(old.clone(), requires_grad=False)
        decode()
        assert calls == [limit, 1]
        runner.decode_path = native = NativeDecode.build(
            runner.model, runner.backend, runner.kv_caches
        )
        assert native is not None
        calls = counted(runner)
        handle = layer.self_attn.register_forward_pre_hook(lambda *a: None)
        decode()
        handle.remove()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            decode()
        inner = runner.model.model
        # the ends the call runs too, and the model and its decoder, whose hooks Python calls
        for module in (inner.embed_tokens, inner.norm, runner.model, inner):
            if not hasattr(module, "weight"):
                handle = module.register_forward_pre_hook(lambda *a: None)
                decode()
                handle.remove()
                continue
            handle = module.register_forward_hook(lambda *a: None)
            decode()
            handle.remove()
            weight = module.weight.data
            module.weight.data = weight.clone()  # same Parameter, new storage
            decode()
            module.weight.data = weight
        norm = inner.norm
        inner.norm = copy.deepcopy(norm)  # a replaced module, its weight a copy
        decode()
        inner.norm = norm
        o_proj = layer.self_attn.o_proj
        o_proj.bias = torch.nn.Parameter(torch.zeros(o_proj.out_features, dtype=torch.bfloat16))
        decode()
        o_proj.bias = None
        cache = runner.kv_caches[0]
        runner.kv_caches[0] = cache.clone()
        decode()
        runner.kv_caches[0] = cache
        assert calls == []
        decode()
        assert calls == [1]
        rope_table = runner.model.model.rotary.cos.shape[0]
        with pytest.raises(IndexError, match="RoPE position"):
            runner.forward([list(range(rope_table // 16 + 1))], [rope_table], [[5]], [1])
        with pytest.raises(IndexError, match="KV slot outside"):
            runner.forward([[cache.shape[1]]], [4], [[5]], [1])
        vocab = runner.model.model.embed_tokens.num_embeddings
        with pytest.raises(IndexError, match="outside the vocabulary"):
            runner.forward([[0]], [4], [[vocab]], [1])
        assert calls == [1, 1, 1, 1]  # the native path raised all three
        # rows that do not line up
        with pytest.raises(ValueError, match="2 starts and block tables of"):
            native.run(ForwardStep([[0], [1]], [4, 4], [[5]], [1]))


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_native_decode_holds_its_caches_where_they_are(tmp_path: Path, kv: str) -> None:
    """A cache's storage moved after the build (``.data =``), or a quantized cache's codes or
    scales replaced: steps go back to Python until it is back (the call holds their addresses)."""
    path = make_hf_model(tmp_path / "llama", "llama")
    llm = LLM(
        str(path), dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=64, kv_cache_dtype=kv
    )
    runner = llm.engine.runner
    assert runner.decode_path is not None
    calls = counted(runner)

    def decode() -> None:
        runner.forward([[1]], [4], [[9]], [1])

    runner.forward([[1]], [0], [[5, 6, 7, 8]], [1])
    cache = runner.kv_caches[-1]
    tensors = [cache.codes, cache.scales] if isinstance(cache, QuantizedKVCache) else [cache]
    for tensor in tensors:
        before = tensor.data
        tensor.data = before.clone()
        decode()
        tensor.data = before
    if isinstance(cache, QuantizedKVCache):
        for name in ("codes", "scales"):
            before = getattr(cache, name)
            setattr(cache, name, before.clone())
            decode()
            setattr(cache, name, before)
    assert calls == []
    decode()
    assert calls == [1]


def test_native_decode_is_off_where_it_cannot_run(tmp_path: Path) -> None:
    path = make_hf_model(tmp_path / "m", "llama")

    def native(**options: Any) -> NativeDecode | None:
        llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=40, **options)
        return llm.engine.runner.decode_path

    assert native(dtype="bfloat16") is not None
    assert native(dtype="bfloat16", enforce_eager=True) is None  # eager: op by op
    assert native(dtype="float16") is None  # no fused float16 kernels
    assert native(dtype="float32", attention_backend="torch") is None
    assert native(dtype="bfloat16", quantization="int4") is not None  # quantized projections
    runner = make_runner(tmp_path, "float32")
    model, backend, caches = runner.model, runner.backend, runner.kv_caches
    handle = model.model.layers[0].mlp.register_forward_hook(lambda *a: None)
    assert NativeDecode.build(model, backend, caches) is None
    handle.remove()
    rotary = model.model.rotary
    rotary.cos = rotary.cos.bfloat16()  # what a bare model.to(bfloat16) does to the tables
    assert NativeDecode.build(model, backend, caches) is None
    rotary.init_tables(torch.device("cpu"))
    assert NativeDecode.build(model, backend, caches) is not None
    embed, norm = model.model.embed_tokens, model.model.norm
    embed.max_norm = 1.0  # a lookup that renormalises rows: the Python path's
    assert NativeDecode.build(model, backend, caches) is None
    embed.max_norm = None
    norm.eps = norm.eps * 2  # the C++ applies the layers' eps
    assert NativeDecode.build(model, backend, caches) is None
    norm.eps = model.config.rms_norm_eps

    class Backend(cpu_paged.CPUPagedBackend):  # its metadata may differ: not this step's
        pass

    assert NativeDecode.build(model, Backend(), caches) is None
    assert NativeDecode.build(model, backend, caches) is not None


@pytest.mark.parametrize(
    ("dtype", "arch", "method"),
    [
        ("bfloat16", "llama", "int8"),
        ("bfloat16", "qwen2", "int6"),
        ("bfloat16", "llama", "int4"),
        ("float32", "llama", "bias"),
    ],
)
def test_native_decode_with_a_quantized_lm_head(
    tmp_path: Path, dtype: str, arch: str, method: str
) -> None:
    """A quantized ``lm_head`` (int8 per channel, the 6 bits of ``int4``'s head, int4 in groups
    (its scales paired), one with a bias) runs in the native call too: the steps' logits equal
    the Python path's bit for bit, at batch 1 (strips) and 2. Steps it cannot take there (more
    rows than the head's ``native_rows``, rows asking no logit) run the layers natively and
    the head in Python; a hook on the head, its layout dropped or the head replaced after the
    build send the head alone back to Python."""
    if cpu_qmatmul.path() not in cpu_qmatmul.NATIVE_PATHS:
        pytest.skip("quantized projections run natively with AVX-512 or AVX2 only")
    runner = make_runner(tmp_path, dtype, arch, vocab_size=300)
    model = runner.model
    float_head = model.lm_head
    w = float_head.weight.detach().float()
    bits, group = {"int6": (6, 16), "int4": (4, 32)}.get(method, (8, None))
    head = QuantLinear.from_float(w, None, bits, group)
    if method == "bias":
        head.bias = torch.randn(head.out_features)
    model.lm_head = head.to(getattr(torch, dtype))
    native = NativeDecode.build(model, runner.backend, runner.kv_caches)
    assert native is not None and native.head is not None
    runner.decode_path = native
    calls = counted(runner)
    heads: list[bool] = []
    run_logits = native.run_logits

    def spy(step: ForwardStep) -> torch.Tensor | None:
        out = run_logits(step)
        heads.append(out is not None)
        return out

    native.run_logits = spy  # type: ignore[method-assign]
    lens = [3, 2]

    def step(rows: int, num_logits: list[int] | None = None) -> None:
        new = [[11 + lens[i]] for i in range(rows)]
        got, ref = both_paths(runner, [[3], [8]][:rows], lens[:rows], new, num_logits or [1] * rows)
        assert torch.equal(got, ref), (got - ref).abs().max()
        lens[:rows] = [n + 1 for n in lens[:rows]]

    with torch.inference_mode():
        runner.forward([[3], [8]], [0, 0], [[5, 6, 7], [9, 4]], [1, 1])
        step(2)
        step(1)
        assert calls == [2, 1] and heads == [True, True]
        native.head_rows = 1  # (as a head whose native_rows is 1)
        step(2)
        assert calls[-1] == 2 and heads[-1] is False
        native.head_rows = head.native_rows()
        step(2, [0, 1])  # row 0 asks none
        assert calls[-1] == 2 and heads[-1] is False
        handle = head.register_forward_hook(lambda *_: None)
        step(1)  # the layers native, the head (and its hook) in Python
        assert calls[-1] == 1 and heads[-1] is False
        handle.remove()
        step(1)
        assert heads[-1] is True
        head.invalidate_layouts()
        step(1)
        assert calls[-1] == 1 and heads[-1] is False
        native = NativeDecode.build(model, runner.backend, runner.kv_caches)
        one = ForwardStep([[3]], [9], [[1]], [1])
        assert native is not None and native.run_logits(one) is not None
        model.lm_head = float_head
        assert native._unchanged() and native.run_logits(one) is None
    again = NativeDecode.build(model, runner.backend, runner.kv_caches)
    assert again is not None and again.head is None  # a float head: Python's compute_logits


def test_generate_is_the_same_with_and_without_native_decode(tmp_path: Path) -> None:
    path = make_hf_model(tmp_path / "m", "llama")
    generate_both_ways(path, "bfloat16", [[1, 5, 9, 23], [1, 77] * 9, [1, 3]])


def generate_both_ways(path: Path, dtype: str, prompts: list[list[int]]) -> None:
    """Greedy generation through ``LLM`` gives the same tokens with the native step (which
    ran) as eagerly (none), and every block back in the pool."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    calls: list[int] = []
    for eager in (False, True):
        llm = LLM(str(path), dtype=dtype, skip_tokenizer_init=True, enforce_eager=eager)
        if not eager:
            calls = counted(llm.engine.runner)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]
    assert outs[0] == outs[1] and len(calls) >= 10


def test_native_decode_rotates_at_the_longrope_offsets(tmp_path: Path) -> None:
    """Phi-3 with LongRoPE over part of each head: rows whose prompts exceed the original
    context are rotated by the long factors (a position offset into the table, per row; at
    decode positions both halves of the table agree): a decode step of rows with and without
    offsets equals the Python path's bit for bit, and so does greedy generation through
    ``LLM`` across the boundary (the recompute there included)."""
    path = make_hf_model(tmp_path / "m", "phi3", **LONGROPE_PHI3)
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    runner = llm.engine.runner
    calls = counted(runner)
    rotary = runner.model.model.rotary
    lens = [25, 9, 30]
    offsets = [rotary.position_offset(n) for n in lens]
    assert offsets[0] > 0 and offsets[1] == 0
    tables = [[4, 9, 2, 7], [1, 3], [11, 5, 6, 8]]
    prompts = [list(range(3, 3 + n)) for n in lens]
    with torch.inference_mode():
        logits = runner.forward(tables, [0] * 3, prompts, [1] * 3, 0, offsets)
        assert logits is not None
        new = [[int(t)] for t in logits.argmax(-1)]
        native, ref = both_paths(runner, tables, lens, new, [1] * 3, 0, offsets)
        assert torch.equal(native, ref) and calls == [3]
    generate_both_ways(path, "float32", [[1, 5, 9, 23], list(range(1, 30)), [1, *range(100, 117)]])


def test_native_decode_reads_each_cache_groups_tables(tmp_path: Path) -> None:
    """Gemma 3's sliding and global layers in cache groups of their own, each with its own
    block tables: a decode step equals the Python path's bit for bit (logits and every page),
    and so does greedy generation through ``LLM`` (bfloat16)."""
    path = make_hf_model(tmp_path / "m", "gemma3_text", **GEMMA3)
    llm = LLM(str(path), dtype="bfloat16", skip_tokenizer_init=True, num_kv_blocks=200)
    runner = llm.engine.runner
    assert len(runner.kv_groups) > 1 and isinstance(runner.decode_path, NativeDecode)
    lens = [21, 7]
    tables = [[4, 9], [1]]
    group_tables = [[[30 + 2 * g, 50 + g], [70 + g]] for g in range(len(runner.kv_groups) - 1)]
    prompts = [list(range(3, 3 + n)) for n in lens]
    with torch.inference_mode():
        logits = runner.forward(tables, [0, 0], prompts, [1, 1], 0, None, group_tables)
        assert logits is not None
        new = [[int(t)] for t in logits.argmax(-1)]
        native, ref = both_paths(runner, tables, lens, new, [1, 1], 0, None, group_tables)
        assert torch.equal(native, ref)
    generate_both_ways(path, "bfloat16", [[1, 5, 9, 23], list(range(1, 30)), [1, *range(100, 117)]])


def test_native_decode_within_the_sliding_window(tmp_path: Path) -> None:
    """A windowed model (Mistral, a window of 6): its decode steps run natively while every
    row's context fits the window (where the window changes nothing), the same bits as the
    Python path; once a context passes it, in Python, which applies the window."""
    runner = make_runner(tmp_path, "float32", "mistral", sliding_window=6)
    calls = counted(runner)
    with torch.inference_mode():
        runner.forward([[3], [8]], [0, 0], [[5, 6, 7], [9, 4]], [1, 1])
        for start in range(3, 8):  # row 0's context start + 1, row 1's one less
            native, ref = both_paths(runner, [[3], [8]], [start, start - 1], [[11], [12]], [1, 1])
            assert torch.equal(native, ref), start
    assert calls == [2, 2, 2]  # contexts up to 4, 5, 6; then 7 and 8, past the window


def _five_bit_with_zeros(mod: nn.Module, group: int) -> QuantLinear:
    """``mod``'s weight as GGUF's Q5_1 / Q5_K are held: 8-bit group-wise codes 0..31 with a scale
    and a zero point per group."""
    w = mod.weight.detach().float()
    return quant_module(8, group, True, w)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("arch", "scheme"),
    [
        ("llama", "int8"),
        ("llama", "int4"),
        ("qwen2", "int4"),
        ("llama", "int4g128"),
        ("qwen2", "q5"),
        ("llama", "q8"),
        ("llama", "g16"),
        ("qwen2", "int6"),
    ],
)
def test_native_decode_runs_quantized_projections(
    tmp_path: Path, dtype: str, arch: str, scheme: str
) -> None:
    """Quantized projections (int8 per channel, int4 groups (in blocks of 16 rows on the VNNI
    path), GGUF's 8-bit group-wise forms with and without zero points (Q8_0's: in blocks)
    and groups of 16,
    Q6_K's 6 bits) run inside the native step, and
    its logits and KV pool equal the Python path's bit for bit; a Qwen2 bias is added after the
    kernel."""
    if cpu_qmatmul.path() not in cpu_qmatmul.NATIVE_PATHS:
        pytest.skip("quantized projections run natively with AVX-512 or AVX2 only")
    runner = make_runner(tmp_path, dtype, arch)
    model = runner.model
    layers = "model.layers.*"
    if scheme == "int8":
        quantize_(model, Int8WeightOnly(), skip=("lm_head",))
    elif scheme in ("int4", "int4g128"):  # (g128: in blocks of 16 rows on the VNNI path)
        group = 128 if scheme == "int4g128" else 32
        quantize_(model, Int4WeightOnly(group_size=group), skip=("lm_head",))
    else:
        bits, group = {"q5": (8, 32), "q8": (8, 32), "g16": (8, 16), "int6": (6, 16)}[scheme]
        for name, mod in list(model.named_modules()):
            if matches(name, layers) and isinstance(mod, Linear):
                q = _five_bit_with_zeros(mod, group) if scheme == "q5" else None
                if q is None:
                    q = QuantLinear.from_float(mod.weight.detach().float(), None, bits, group)
                q = q.to(getattr(torch, dtype))
                if mod.bias is not None:
                    q.bias = mod.bias.detach().clone()
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent), leaf, q)
    set_compute_dtype(model, None)
    native = NativeDecode.build(model, runner.backend, runner.kv_caches)
    assert native is not None
    assert len(native.checks.quantized) == 4 * len(model.model.layers)
    if scheme in ("q8", "int4", "int4g128"):  # (the step built them: cpu_qmatmul.interleave)
        interleaved = model.model.layers[0].self_attn.o_proj.interleaved  # type: ignore[union-attr]
        assert interleaved == (cpu_qmatmul.path() == "vnni")
    runner.decode_path = native
    calls = counted(runner)
    with torch.inference_mode():
        tables = [[3], [8], [5, 6]]
        logits = runner.forward(tables, [0, 0, 0], [[5, 6, 7], [9, 4], [1] * 20], [1] * 3)
        assert logits is not None
        lens = [3, 2, 20]
        for rows in (1, 3):
            new = [[int(t)] for t in logits.argmax(-1)[:rows]]
            got, ref = both_paths(runner, tables[:rows], lens[:rows], new, [1] * rows)
            assert torch.equal(got, ref), (rows, (got - ref).abs().max())
            lens[:rows] = [n + 1 for n in lens[:rows]]
        # every projection quantized: native up to QuantLinear's GEMM rows (past the float
        # kernel's limit, 16 bfloat16 rows, but for group-wise 8 bits)
        first = model.model.layers[0].self_attn.o_proj
        assert isinstance(first, QuantLinear)
        gemm = dequantized_gemm_rows(first.bits, first.group_size)
        grouped8 = first.bits == 8 and first.group_size is not None
        amx = cpu_qmatmul.amx_rows(first.bits, first.group_size)
        if amx:  # on AMX's tiles
            small = first.group_size is not None and first.group_size < 128
            assert gemm == (AMX_GROUPS32_GEMM_ROWS[first.bits] if small else AMX_GEMM_ROWS)
        elif cpu_qmatmul.path() != "avx2":
            assert gemm == (GROUPED8_GEMM_ROWS if grouped8 else DEQUANTIZED_GEMM_ROWS)
        assert native.max_rows == gemm - 1
        many = min(20, gemm - 1)
        tables = [[30 + i] for i in range(many)]
        new = [[i + 1] for i in range(many)]
        got, ref = both_paths(runner, tables, [3] * many, new, [1] * many)
        assert torch.equal(got, ref), (got - ref).abs().max()
        wide = gemm  # QuantLinear's GEMM from here: Python's step
        assert not native.can_run(ForwardStep([[1]] * wide, [3] * wide, [[1]] * wide, [1] * wide))
    assert calls == [1, 3, many]
    # writing a projection's buffers drops its view: the next step goes back to Python
    first.invalidate_layouts()
    assert not native._unchanged()


@pytest.mark.parametrize("size", [24, 256])
def test_native_decode_refuses_dense_mlps_of_other_sizes(tmp_path: Path, size: int) -> None:
    """The C++ runs every dense MLP (and shared expert) at one intermediate size: sparse layers
    given an ungated shared expert of another size than the dense layer's are refused, float
    or with int8 projections (which have no weight shape to compare); of the same size they
    run, bit for bit the Python path's."""
    runner = make_runner(tmp_path, "float32", "qwen3_moe", **QWEN3_MOE)
    model, backend, caches = runner.model, runner.backend, runner.kv_caches
    hidden, dense = model.config.hidden_size, model.config.intermediate_size
    for width, quantized in ((size, False), (size, True), (dense, False)):
        torch.manual_seed(0)
        for layer in model.model.layers:
            if isinstance(layer.mlp, SparseMoeBlock):
                layer.mlp.shared_expert = GatedMLP(hidden, width)
        if quantized:
            quantize_(model, Int8WeightOnly(), skip=("lm_head", "experts", "gate"))
        native = NativeDecode.build(model, backend, caches, runner.block_size)
        assert (native is not None) == (width == dense), (width, quantized)
    runner.decode_path = native
    prefill_then_decode(runner, 3)


def test_native_decode_refuses_quantized_projections_it_cannot_run(tmp_path: Path) -> None:
    """A projection whose forward scales, permutes or casts its input first, or that is
    replaced after the build, keeps (or sends back) the step in Python; with quantized
    projections the step stops below the rows where ``QuantLinear`` turns to its GEMM."""
    if cpu_qmatmul.path() not in cpu_qmatmul.NATIVE_PATHS:
        pytest.skip("quantized projections run natively with AVX-512 or AVX2 only")
    runner = make_runner(tmp_path, "float32")
    model, backend, caches = runner.model, runner.backend, runner.kv_caches
    quantize_(model, Int8WeightOnly(), skip=("lm_head",))

    def build() -> NativeDecode | None:
        return NativeDecode.build(model, backend, caches)

    native = build()
    assert native is not None and native.max_rows == dequantized_gemm_rows(8, None) - 1
    o_proj = model.model.layers[0].self_attn.o_proj
    assert isinstance(o_proj, QuantLinear)
    o_proj.compute_dtype = torch.bfloat16  # the forward casts: the C++ would not
    assert build() is None and not native._unchanged()
    o_proj.compute_dtype = None
    assert native._unchanged()
    o_proj.input_scale = torch.ones(o_proj.in_features)  # AWQ scaling the C++ does not apply
    assert build() is None and not native._unchanged()
    o_proj.input_scale = None
    assert native._unchanged()
    o_proj.bias = torch.zeros(o_proj.out_features)  # a bias set after the build: not in C++
    assert not native._unchanged()
    o_proj.bias = None
    assert native._unchanged()
    o_proj.bias = torch.nn.Parameter(torch.zeros(o_proj.out_features))  # no longer a buffer
    assert build() is None and not native._unchanged()
    del o_proj.bias
    o_proj.register_buffer("bias", None)
    assert native._unchanged()
    # codes or scales moved under the same tensor (``.data =``): the call holds their address
    for name in ("qweight", "scales"):
        buffer = getattr(o_proj, name)
        before = buffer.data
        buffer.data = before.clone()
        assert not native._unchanged(), name
        buffer.data = before
        assert native._unchanged()
    with pytest.MonkeyPatch.context() as mp:  # the kernels switched off after the build
        mp.setenv("FOUDRE_NATIVE_QMATMUL", "0")
        assert build() is None and not native._unchanged()
    assert native._unchanged()
    mlp = model.model.layers[1].mlp
    mlp.down_proj = QuantLinear.from_float(mlp.down_proj.dequantize(), None, 4, 32)
    assert not native._unchanged()  # a module replaced after the build
    again = build()  # (int4 g32 beside int8: the fewer of their GEMM rows)
    rows = min(dequantized_gemm_rows(8, None), dequantized_gemm_rows(4, 32))
    assert again is not None and again.max_rows == rows - 1
    # one group-wise 8-bit projection among per-channel ones: its GEMM rows bound the step
    mlp.down_proj = QuantLinear.from_float(mlp.down_proj.dequantize(), None, 8, 32)
    again = build()
    assert again is not None and again.max_rows == dequantized_gemm_rows(8, 32) - 1
