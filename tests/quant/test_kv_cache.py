"""KV-cache quantization (``kv_cache_dtype`` int8 / fp8): error bounds, memory, exactness of the
paged machinery over quantized blocks, and the quality cost on the embedded model."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.attention import cpu_paged
from foudre.attention.kv_quant import dequantize_kv, quantize_kv
from foudre.attention.quantized_cache import QuantizedKVCache
from foudre.compress.data import read_documents
from foudre.compress.eval import perplexity
from foudre.compress.model import load_for_eval
from foudre.layers import fused
from foudre.layers.linear import MAX_ROWS
from foudre.loading.loader import default_model
from foudre.native import build as native
from foudre.runner.cpu_decode import NativeDecode
from foudre.runner.model_runner import ModelRunner
from tests.conftest import SHARED, make_hf_model
from tests.engine.test_cpu_decode import counted, prefill_then_decode

PROMPTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play in the park.",
    "Tom had a red ball.",
    "The sun was",
]


@pytest.mark.parametrize(("kind", "rel"), [("int8", 0.5 / 127), ("fp8", 2.0**-4)])
def test_round_trip_error_bound(kind: str, rel: float) -> None:
    x = torch.randn(64, 4, 32) * torch.rand(64, 4, 1) * 10
    codes, scale = quantize_kv(x, kind)
    assert codes.element_size() == 1 and scale.shape == (64, 4)
    back = dequantize_kv(codes, scale, torch.float32)
    amax = x.abs().amax(dim=-1, keepdim=True)
    if kind == "int8":  # absolute: half a step of max|x| / 127
        assert bool(((back - x).abs() <= rel * amax + 1e-6).all())
    else:  # e4m3: 3 mantissa bits, relative half-ulp for normal values
        normal = x.abs() > amax / 448 * 2**-6
        assert bool(((back - x).abs() <= rel * x.abs() + 1e-6)[normal].all())


def test_cache_write_and_gather() -> None:
    cache = QuantizedKVCache(6, 4, 2, 8, "int8", torch.float32, torch.device("cpu"))
    k, v = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([0, 1, 9, 10, 11])  # block 0 slots 0-1, block 2 slots 1-3
    cache.write(slots, k, v)
    keys, values = cache.gather(torch.tensor([[0, 2]]))
    assert keys.shape == (1, 2, 4, 2, 8)
    flat_k, flat_v = keys.view(-1, 2, 8), values.view(-1, 2, 8)
    idx = torch.tensor([0, 1, 5, 6, 7])
    torch.testing.assert_close(flat_k[idx], k, atol=0.02, rtol=0)
    torch.testing.assert_close(flat_v[idx], v, atol=0.02, rtol=0)


@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_memory_halved_or_better(kind: str) -> None:
    budget = 64 << 20
    base = LLM(dtype="bfloat16", kv_cache_memory=budget).metrics()["num_total_blocks"]
    quant = LLM(dtype="bfloat16", kv_cache_memory=budget, kv_cache_dtype=kind)
    # head_dim + 4 bytes per token and head instead of 2 * head_dim: 1.78x at head_dim 32,
    # 1.94x at the usual 128
    d = quant.engine.model_config.head_dim
    ratio = quant.metrics()["num_total_blocks"] / base
    assert ratio == pytest.approx(2 * d / (d + 4), rel=0.01)


def _run(**kw: Any) -> list[Any]:
    llm = LLM(dtype="float32", kv_cache_dtype="int8", **kw)
    params = [SamplingParams(temperature=0.0, max_tokens=30 + 9 * i, logprobs=3) for i in range(6)]
    out = llm.generate(PROMPTS + PROMPTS, params)
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in out], m


def test_quantized_blocks_through_prefix_hits_preemption_and_speculation() -> None:
    """Quantization is per token, so batching, prefix hits, preemption and speculation over
    int8 blocks give exactly the tokens of a plain run over int8 blocks."""
    ref, _ = _run()
    tight, m = _run(num_kv_blocks=16, block_size=8, max_model_len=128, max_num_batched_tokens=32)
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
    assert [t for t, _ in tight] == [t for t, _ in ref]
    spec, m = _run(speculative_method="draft")
    assert m["spec_accepted_tokens"] > 0
    assert [t for t, _ in spec] == [t for t, _ in ref]


def test_logprobs_close_to_full_precision_cache() -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    full = LLM(dtype="float32").generate(PROMPTS, params)
    for kind in ("int8", "fp8"):
        quant = LLM(dtype="float32", kv_cache_dtype=kind).generate(PROMPTS, params)
        for a, b in zip(quant, full, strict=True):
            la, lb = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]  # type: ignore[index]
            for t in set(la) & set(lb):
                assert la[t] == pytest.approx(
                    lb[t], abs=0.12 if kind == "int8" else 0.25
                )  # 2x measured


@pytest.mark.slow
def test_bits_per_byte_cost_on_the_embedded_model() -> None:
    """int8 KV within 1% of the full-precision cache's bits per byte on held-out stories."""
    data = SHARED / "data" / "tinystories_v2_train_first2MiB.txt"
    if not data.exists():
        pytest.skip("../shared/data is not present")
    model, tok = load_for_eval(default_model()[0])
    docs = read_documents(data, "heldout")[:30]
    full = perplexity(model, tok, docs).bits_per_byte
    int8 = perplexity(model, tok, docs, kv_cache_dtype="int8").bits_per_byte
    fp8 = perplexity(model, tok, docs, kv_cache_dtype="fp8").bits_per_byte
    assert abs(int8 - full) / full < 0.01
    assert abs(fp8 - full) / full < 0.02
    assert int8 != full  # the rounding is really applied


needs_native = pytest.mark.skipif(
    fused.decode_layers_fn(torch.float32) is None or not cpu_paged.available(),
    reason="no AVX-512 or no C++ compiler",
)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_native_quantize_on_write_is_quantize_kv(dtype: torch.dtype, kind: str) -> None:
    """The native decode step's K/V write (``cpu_ops.cpp``'s quantize_kv) against
    ``layers/kv_quant.quantize_kv``, bit for bit: magnitudes over 18 decades, a zero head, one
    under the 1e-8 clamp, and heads of exact ties (halves of int8 steps, e4m3 midpoints)."""
    dll = native.load(fused.SOURCE)
    assert dll is not None
    fn = getattr(dll, f"foudre_quantize_kv_{'f32' if dtype == torch.float32 else 'bf16'}")
    fn.argtypes = [ctypes.c_void_p, *[ctypes.c_int64] * 3, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = None
    g = torch.Generator().manual_seed(0)
    n, dim = 3000, 64
    x = torch.randn(n, dim, generator=g) * torch.logspace(-12, 6, n).view(-1, 1)
    x[0] = 0
    x[1] = 0
    x[1, 0] = 3e-9
    x[2] = torch.randint(-254, 255, (dim,), generator=g) / 2  # halves of a step of 1
    x[2, 0] = 127
    x[3] = torch.randint(-512, 513, (dim,), generator=g) / 16  # e4m3 ties (scale 1)
    x[3, 0] = 448
    x = x.to(dtype)
    codes, scales = quantize_kv(x, kind)
    out, out_scales = torch.empty(n, dim, dtype=torch.uint8), torch.empty(n)
    fn(x.data_ptr(), n, dim, {"int8": 1, "fp8": 2}[kind], out.data_ptr(), out_scales.data_ptr())
    assert torch.equal(out, codes.view(torch.uint8))
    assert torch.equal(out_scales, scales)


def quantized_runner(
    tmp_path: Path, dtype: torch.dtype, kind: str, **overrides: Any
) -> ModelRunner:
    path = make_hf_model(tmp_path / "m", "llama", **overrides)
    llm = LLM(
        str(path),
        dtype=str(dtype).removeprefix("torch."),
        skip_tokenizer_init=True,
        num_kv_blocks=200,
        kv_cache_dtype=kind,
    )
    runner = llm.engine.runner
    assert runner.backend.name == "cpu" and isinstance(runner.decode_path, NativeDecode)
    return runner


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_native_decode_over_a_quantized_cache(
    tmp_path: Path, dtype: torch.dtype, kind: str
) -> None:
    """The native decode step runs over an int8 / fp8 cache (blocks out of order, contexts
    across block boundaries; GQA 4): decode steps of 1, 3 and ``MAX_ROWS`` rows give the logits
    of the Python path over the same cache, and the same codes and scales in the whole pool."""
    runner = quantized_runner(tmp_path, dtype, kind, num_attention_heads=8, num_key_value_heads=2)
    prefill_then_decode(runner, MAX_ROWS[dtype])


@needs_native
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_generate_with_native_decode_over_a_quantized_cache(tmp_path: Path, kind: str) -> None:
    """Greedy generation over an int8 / fp8 cache: the native decode step runs its steps and
    gives the tokens of the Python path (``enforce_eager``) over the same cache, and those of
    the SDPA backend reading the dequantized blocks (float32)."""
    path = make_hf_model(tmp_path / "m", "llama")
    prompts = [[1, 5, 9, 23], [1, 77] * 9, [1, 3]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = []
    for options in ({}, {"enforce_eager": True}, {"attention_backend": "torch"}):
        llm = LLM(
            str(path), dtype="float32", skip_tokenizer_init=True, kv_cache_dtype=kind, **options
        )
        if not options:
            calls = counted(llm.engine.runner)
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]
    assert outs[0] == outs[1] == outs[2] and len(calls) >= 10
