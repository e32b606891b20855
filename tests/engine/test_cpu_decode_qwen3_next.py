"""The native decoder layers of CPU decode steps (``runner/cpu_decode.py``) on Qwen3-Next: gated
DeltaNet layers (``foudre_deltanet_step``: conv window, gates, delta rule, gated norm on each
row's state slot), gated attention (the output gate's sigmoid on the attention's output before
o_proj, partial RoPE, (1 + w) q/k norms) and experts with a sigmoid-gated shared expert, against
the model's Python path: the same logits, KV pages, recurrent states (conv windows and delta-rule
states, in every slot of the pools) and routers' counts, bit for bit, padding rows and
prefix-cache snapshots of decode rows included; greedy generation through ``LLM`` the same with
and without the native step (bfloat16, and int8 on a dense model); what it cannot run left to
Python. And the two C++ pieces the Python path now shares with the native step, against the
torch ops they replace: the fused DeltaNet decode token, and the sigmoid gate."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import SamplingParams
from foudre.attention.cache_spec import RecurrentCache
from foudre.layers import fused, gated_deltanet, ssm_ops
from foudre.layers.gated_deltanet import GatedDeltaNet, GatedDeltaNetShape
from foudre.layers.mamba import RecurrentBatch
from foudre.runner.cpu_decode import NativeDecode
from foudre.runner.step import ForwardStep
from tests.conftest import make_hf_model
from tests.engine.test_cpu_decode_hybrid import (
    _both_paths,
    _llm,
    check_decode_steps,
    check_generate_with_snapshots,
    check_refuses_slots_outside_the_pools,
)
from tests.oracles.ssm_models import prompt, save_random
from tests.oracles.test_qwen3_next import BASE, CASES

pytestmark = pytest.mark.skipif(
    fused.decode_layers_fn(torch.float32) is None or ssm_ops.library() is None,
    reason="neither AVX-512 nor AVX2, or no C++ compiler",
)

MODELS: dict[str, dict[str, Any]] = {
    # DeltaNet, attention, DeltaNet, DeltaNet; experts (top-2 of 4, renormalised) with a gated
    # shared expert in every layer; RoPE over half of each head
    "moe": BASE,
    # attention first, one key head per value head, dense MLPs only (int8 runs natively), tied
    "dense": {
        **BASE,
        "layer_types": ["full_attention", "linear_attention", "linear_attention"],
        "num_hidden_layers": 3,
        "linear_num_value_heads": 2,
        "mlp_only_layers": [0, 1, 2],
        "tie_word_embeddings": True,
    },
}


@pytest.fixture(scope="module", params=list(MODELS))
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {**MODELS[request.param], "max_position_embeddings": 512}
    return save_random("Qwen3Next", config, tmp_path_factory.mktemp(request.param))


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", None), ("bfloat16", None), ("bfloat16", "int8")]
)
def test_native_decode_equals_the_python_path(
    model_path: Path, dtype: str, quantization: str | None
) -> None:
    """Prefill three prompts (state slots out of order, blocks out of order) in Python, then
    decode steps of 1, 3 and 3 + 2 padding rows natively, two of them leaving a snapshot of a
    row's state: logits, KV pages and every state slot equal the Python path's, bit for bit
    (int8: every projection quantized, the DeltaNets' in_proj_ba and the attention's gate too;
    the dense model only, quantized experts run in Python)."""
    llm = _llm(model_path, dtype, quantization=quantization)
    runner = llm.engine.runner
    if quantization and runner.model.moe_blocks():
        assert runner.decode_path is None
        return
    assert isinstance(runner.decode_path, NativeDecode)
    assert bool(runner.decode_path.checks.quantized) == bool(quantization)
    check_decode_steps(runner)


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_generate_is_the_same_with_and_without_native_decode(
    model_path: Path, quantization: str | None
) -> None:
    """Greedy generation through ``LLM`` (batched prompts, prefix caching on, so that decode
    rows leave snapshots; bfloat16, or int8 projections) gives the same tokens with the native
    step as without, and the native step ran (not where the experts are quantized: those
    layers run in Python)."""
    check_generate_with_snapshots(model_path, quantization)


def test_what_the_native_step_cannot_run_goes_to_python(tmp_path: Path) -> None:
    """Dense MLPs of another size than the shared experts' (the C++ runs one): no native step,
    the Python path's tokens all the same. An in-place write to a DeltaNet parameter the call
    reads a float32 copy of, a hook on a mixer, or a replaced gated norm sends a step to Python;
    undone (or rebuilt), it runs natively again."""
    mixed = save_random("Qwen3Next", {**BASE, **CASES["dense-layer-tied"]}, tmp_path / "mixed")
    llm = _llm(mixed, "float32")
    assert llm.engine.runner.decode_path is None
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate([prompt(6, 1)], params)[0].outputs[0].token_ids) == 4
    runner = _llm(save_random("Qwen3Next", BASE, tmp_path / "m"), "float32").engine.runner
    native = runner.decode_path
    assert isinstance(native, NativeDecode)
    step = ForwardStep([[3]], [4], [[5]], [1], state_slots=[0])
    assert native.can_run(step)
    mixer = runner.model.model.layers[0].linear_attn
    with torch.inference_mode():
        mixer.A_log.add_(0.0)  # (the same values: the version alone says it was written)
    assert not native.can_run(step)
    runner.model_changed()
    native = runner.decode_path
    assert isinstance(native, NativeDecode) and native.can_run(step)
    handle = mixer.register_forward_hook(lambda *_: None)
    assert not native.can_run(step)
    handle.remove()
    assert native.can_run(step)
    norm = mixer.norm
    mixer.norm = type(norm)(norm.weight.numel(), norm.eps)
    assert not native.can_run(step)
    mixer.norm = norm
    assert native.can_run(step)


def test_native_decode_refuses_slots_outside_the_pools(tmp_path: Path) -> None:
    runner = _llm(save_random("Qwen3Next", BASE, tmp_path / "m"), "float32").engine.runner
    check_refuses_slots_outside_the_pools(runner)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_deltanet_decode_equals_the_torch_ops(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fused decode token (``ssm_ops.deltanet_decode``, which both paths now run) against
    the mixer's op-by-op path (torch ops around the delta-rule kernel) on random weights and
    states: the output, every conv window and delta-rule state slot, and a decode row's
    snapshot, equal within a float32 ulp or two before the last rounding."""
    calls: list[int] = []
    fused_call = gated_deltanet.deltanet_decode
    monkeypatch.setattr(
        gated_deltanet, "deltanet_decode", lambda *a: calls.append(1) or fused_call(*a)
    )
    torch.manual_seed(0)
    shape = GatedDeltaNetShape(64, 2, 4, 8, 12, 4)
    mixer = GatedDeltaNet(shape)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    mixer = mixer.to(dtype)
    spec = shape.state_spec()
    conv = torch.randn(8, spec.conv_window, spec.conv_dim).to(dtype)
    ssm = torch.randn(8, spec.num_heads, spec.head_dim, spec.state_size) * 0.1
    x = torch.randn(3, 64).to(dtype)
    batch = RecurrentBatch([0, 1, 2, 3], torch.tensor([5, 1, 3]), [(1, 0, 7)])
    fused_cache = RecurrentCache(conv.clone(), ssm.clone())
    torch_cache = RecurrentCache(conv.clone(), ssm.clone())
    with torch.inference_mode():
        got = mixer(x, fused_cache, batch)
        assert calls == [1]  # (the fused call ran)
        mixer._decode_step = lambda *_: None  # type: ignore[method-assign]
        want = mixer(x, torch_cache, batch)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(fused_cache.conv, torch_cache.conv, atol=0, rtol=0)
    torch.testing.assert_close(fused_cache.ssm, torch_cache.ssm, atol=1e-5, rtol=1e-5)
    assert torch.equal(fused_cache.ssm[7], fused_cache.ssm[1])  # the snapshot of row 1
    assert torch.equal(fused_cache.conv[7], fused_cache.conv[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sigmoid_gate_equals_torch(dtype: torch.dtype) -> None:
    """``fused.sigmoid_gate`` (the gated attention's and the shared expert's gate, a gate a
    channel or a row) against ``x * torch.sigmoid(gate)``: a float32 ulp or two apart before the
    rounding to the dtype; a gate of another shape is refused, naming it."""
    torch.manual_seed(1)
    x = (torch.randn(5, 40) * 3).to(dtype)
    for gate in ((torch.randn(5, 40) * 4).to(dtype), (torch.randn(5, 1) * 4).to(dtype)):
        want = x * torch.sigmoid(gate)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(fused.sigmoid_gate(x, gate), want, atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="gate"):
        fused.sigmoid_gate(x, x[:, :3])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwen2_moe_gated_shared_expert_runs_natively(tmp_path: Path, dtype: str) -> None:
    """Qwen2-MoE's sparse layers (the same sigmoid-gated shared expert, beside qkv biases), every
    layer sparse (one intermediate size): its decode steps now run natively too, their logits,
    KV pages and routers' counts the Python path's, bit for bit."""
    path = make_hf_model(
        tmp_path / "m",
        "qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        max_position_embeddings=512,
    )
    runner = _llm(path, dtype).engine.runner
    assert isinstance(runner.decode_path, NativeDecode)
    tables, lens = [[3, 1], [2, 5]], [6, 11]
    with torch.inference_mode():
        logits = runner.forward(tables, [0, 0], [prompt(n, n) for n in lens], [1, 1])
        assert logits is not None
        new = [[int(t)] for t in logits.argmax(-1)]
        got, want = _both_paths(runner, tables, lens, new, [1, 1], 0)
    assert torch.equal(got, want)
