"""The native decoder layers of CPU decode steps (``runner/cpu_decode.py``) on Falcon-H1
(``FalconH1ForCausalLM``: attention and a Mamba-2 mixer side by side on one normed input in
every layer, muP multipliers on the embedding, each mixer's input and output, in_proj's sections,
the keys, the MLP's gate and output, and the logits) against the model's Python path: the same
logits, KV pages and recurrent states (conv windows and SSM states, in every slot of the pools),
bit for bit, padding rows and prefix-cache snapshots of decode rows included, for each of the
mixer's gated-norm modes; greedy generation through ``LLM`` the same with and without the native
step (bfloat16, int8, and int4 with the head in the call); what the call cannot run (a hook on a
mixer, a mixer's parameter written in place) goes back to Python."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from foudre.attention import cpu_paged
from foudre.layers import fused, ssm_ops
from foudre.layers.mlp import GatedMLP
from foudre.models.falcon_h1 import FalconH1ForCausalLM
from foudre.runner.cpu_decode import NativeDecode
from foudre.runner.step import ForwardStep
from tests.engine.test_cpu_decode_hybrid import (
    _llm,
    check_decode_steps,
    check_generate_with_snapshots,
)
from tests.oracles.test_falcon_h1 import CASES, make_falcon_h1

pytestmark = pytest.mark.skipif(
    fused.decode_layers_fn(torch.float32) is None
    or not cpu_paged.available()
    or ssm_ops.library() is None,
    reason="neither AVX-512 nor AVX2, or no C++ compiler",
)


@pytest.fixture(scope="module", params=list(CASES))
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The oracle's configs: every multiplier set (none 1), the gated norm before the gate,
    after it, or none (with the multipliers' defaults, a tied head, one group)."""
    config = {**CASES[request.param], "max_position_embeddings": 512}
    return make_falcon_h1(tmp_path_factory.mktemp(request.param), **config)


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", None), ("bfloat16", None), ("bfloat16", "int8")]
)
def test_native_decode_equals_the_python_path(
    model_path: Path, dtype: str, quantization: str | None
) -> None:
    """Prefill three prompts (state slots out of order, blocks out of order) in Python, then
    decode steps of 1, 3 and 3 + 2 padding rows natively, two of them leaving a snapshot of a
    row's state: logits, KV pages and every state slot equal the Python path's, bit for bit
    (int8: the quantized head's logits computed in the call, times ``lm_head_multiplier``)."""
    llm = _llm(model_path, dtype, quantization=quantization)
    runner = llm.engine.runner
    assert isinstance(runner.model, FalconH1ForCausalLM)
    native = runner.decode_path
    assert isinstance(native, NativeDecode)
    assert (native.head is not None) == bool(quantization)
    check_decode_steps(runner)


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_generate_is_the_same_with_and_without_native_decode(
    model_path: Path, quantization: str | None
) -> None:
    """Greedy generation through ``LLM`` (batched prompts, prefix caching on, so that decode
    rows leave snapshots; bfloat16, int8 projections, or int4 ones with the quantized head's
    logits, times ``lm_head_multiplier``, computed in the call) gives the same tokens with the
    native step as without, and the native step ran."""

    def head(path: NativeDecode) -> None:
        assert (path.head is not None) == bool(quantization)  # (the head in the call)

    check_generate_with_snapshots(model_path, quantization, head)


def test_native_decode_steps_aside_when_a_layer_changes(tmp_path: Path) -> None:
    """What the call cannot run goes to Python: a hook on a Falcon-H1 layer's mixer, attention
    or MLP, or a mixer's parameter written in place (the call reads float32 copies), sends the
    step there; undone (or rebuilt), the step runs natively again. An MLP replaced by a plain
    ``GatedMLP`` (no multipliers) leaves no native step at all."""
    path = make_falcon_h1(tmp_path / "m", max_position_embeddings=512)
    runner = _llm(path, "float32").engine.runner
    native = runner.decode_path
    assert isinstance(native, NativeDecode)
    step = ForwardStep([[3]], [4], [[5]], [1], state_slots=[0])
    assert native.can_run(step)
    layer = runner.model.model.layers[1]
    for module in (layer.mamba, layer.feed_forward, layer.self_attn):
        handle = module.register_forward_hook(lambda *_: None)
        assert not native.can_run(step)
        handle.remove()
        assert native.can_run(step)
    with torch.inference_mode():
        layer.mamba.D.add_(0.0)  # (the same values: the version alone says it was written)
    assert not native.can_run(step)
    runner.model_changed()
    native = runner.decode_path
    assert isinstance(native, NativeDecode) and native.can_run(step)
    mlp = layer.feed_forward
    plain = GatedMLP(mlp.gate_up_proj.in_features, mlp.intermediate_size)
    plain.load_state_dict(mlp.state_dict())
    layer.feed_forward = plain
    assert not native.can_run(step)
    runner.model_changed()
    assert runner.decode_path is None
