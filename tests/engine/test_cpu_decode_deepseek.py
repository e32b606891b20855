"""The native decoder layers of CPU decode steps (``runner/cpu_decode.py``) on DeepSeek-V3:
multi-head latent attention in the absorbed form over the latent pages (with and without
``q_lora_rank``, biases and YaRN's scale), DeepSeek's sigmoid group-limited routing with the
shared experts beside it, and the dense first layers, against the model's Python path: the same
logits, latent pages and routers' counts, bit for bit, padding rows included; greedy generation
through ``LLM`` the same with and without the native step; the native kernels against torch's
ops (the products of the absorbed form, the routing) within float32 rounding; int8 and int4
projections and experts; and the steps that go back to Python (a hook, a replaced weight)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.attention import cpu_paged
from foudre.layers import fused
from foudre.layers.moe import SparseMoeBlock, route_grouped
from foudre.models.deepseek_v3 import LatentAttention
from foudre.runner.cpu_decode import NativeDecode
from foudre.runner.step import ForwardStep
from tests.conftest import make_hf_model
from tests.engine.test_cpu_decode_hybrid import _both_paths, _counted
from tests.oracles.ssm_models import prompt
from tests.oracles.test_deepseek_v3 import BASE, CASES

pytestmark = pytest.mark.skipif(
    fused.decode_layers_fn(torch.float32) is None or not cpu_paged.available(),
    reason="neither AVX-512 nor AVX2, or no C++ compiler",
)

MODELS = ("q-lora-yarn-mscale", "no-q-lora-not-interleaved", "groups-4-no-norm-v-wider")


@pytest.fixture(scope="module", params=MODELS)
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    case = request.param
    return make_hf_model(tmp_path_factory.mktemp(case), "deepseek_v3", **{**BASE, **CASES[case]})


def _llm(path: Path, dtype: str, **kwargs: Any) -> LLM:
    return LLM(
        str(path), dtype=dtype, skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=256,
        **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("dtype", "quantization"), [("float32", None), ("bfloat16", None), ("bfloat16", "int8")]
)
def test_native_decode_equals_the_python_path(
    model_path: Path, dtype: str, quantization: str | None
) -> None:
    """Prefill three prompts (blocks out of order) in Python, then decode steps of 1, 3 and
    3 + 2 padding rows natively: logits, latent pages and expert counts equal the Python
    path's, bit for bit (int8: every projection and routed expert quantized)."""
    llm = _llm(model_path, dtype, quantization=quantization)
    runner = llm.engine.runner
    assert isinstance(runner.decode_path, NativeDecode)
    assert bool(runner.decode_path.checks.quantized) == bool(quantization)
    lens = [5, 17, 33]
    tables = [[7, 3, 9], [1, 12, 4], [20, 2, 30]]
    prompts = [prompt(n, 7 + n) for n in lens]
    with torch.inference_mode():
        logits = runner.forward(tables, [0] * 3, prompts, [1] * 3)
        assert logits is not None
        for rows, pad in ((1, 0), (3, 0), (3, 2)):
            new = [[int(t)] for t in logits.argmax(-1)[:rows]] + [[0]] * pad
            step_tables = tables[:rows] + [[runner.padding_block]] * pad
            args = (step_tables, lens[:rows] + [0] * pad, new, [1] * (rows + pad), pad)
            got, want = _both_paths(runner, *args)
            assert torch.equal(got[:rows], want[:rows]), (rows, (got - want).abs().max())
            lens[:rows] = [n + 1 for n in lens[:rows]]
            logits = torch.cat([got[:rows], logits[rows:]])
            runner.forward(*args)


@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [("float32", None), ("bfloat16", None), ("bfloat16", "int8"), ("bfloat16", "int4")],
)
def test_generate_is_the_same_with_and_without_native_decode(
    model_path: Path, dtype: str, quantization: str | None
) -> None:
    """Greedy generation through ``LLM`` (batched prompts, prefix caching on) gives the same
    tokens with the native step as without, and the native step ran (int8 and int4: the
    projections and the routed experts quantized)."""
    prompts = [prompt(n, 3 + n) for n in (5, 40, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = []
    for native in (True, False):
        llm = _llm(model_path, dtype, enable_prefix_caching=True, quantization=quantization)
        runner = llm.engine.runner
        path = runner.decode_path
        assert isinstance(path, NativeDecode)
        assert bool(path.checks.quantized) == bool(quantization)
        calls = _counted(path)
        if not native:
            runner.decode_path = None
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        assert bool(calls) == native
    assert outs[0] == outs[1] and all(len(t) == 24 for t in outs[0])


def test_native_decode_steps_aside_when_a_layer_changes(tmp_path: Path) -> None:
    """A hook on a latent attention, a replaced kv_b_proj weight, or an in-place move of the
    correction bias sends the step to Python; undone, it runs natively again."""
    path = make_hf_model(tmp_path / "m", "deepseek_v3", **BASE)
    runner = _llm(path, "float32").engine.runner
    native = runner.decode_path
    assert isinstance(native, NativeDecode)
    step = ForwardStep([[3]], [4], [[5]], [1])
    assert native.can_run(step)
    attn = runner.model.model.layers[1].self_attn
    assert isinstance(attn, LatentAttention)
    handle = attn.register_forward_hook(lambda *_: None)
    assert not native.can_run(step)
    handle.remove()
    assert native.can_run(step)
    weight = attn.kv_b_proj.weight
    attn.kv_b_proj.weight = torch.nn.Parameter(weight.detach().clone())
    assert not native.can_run(step)
    attn.kv_b_proj.weight = weight
    assert native.can_run(step)
    block = runner.model.model.layers[2].mlp
    assert isinstance(block, SparseMoeBlock) and block.e_score_correction_bias is not None
    bias = block.e_score_correction_bias
    block.e_score_correction_bias = torch.nn.Parameter(bias.detach().clone())
    assert not native.can_run(step)
    block.e_score_correction_bias = bias
    assert native.can_run(step)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_latent_products_match_torch(dtype: torch.dtype) -> None:
    """The absorbed form's native products (``fused.latent_absorb`` / ``latent_unabsorb``)
    against torch.bmm over the halves of kv_b_proj, on strided views as the layer passes them."""
    g = torch.Generator().manual_seed(0)
    t, heads, nope, rope, v, rank = 5, 4, 16, 8, 24, 40
    kv_b = torch.randn(heads * (nope + v), rank, generator=g).to(dtype)
    q = torch.randn(t, heads, nope + rope, generator=g).to(dtype)
    w = kv_b.view(heads, nope + v, rank)
    w_uk, w_uv = w[:, :nope], w[:, nope:]
    q_nope = q[..., :nope]
    want = torch.bmm(q_nope.float().transpose(0, 1), w_uk.float()).transpose(0, 1)
    got = fused.latent_absorb(q_nope, kv_b, v)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=tol, atol=tol)
    o = torch.randn(t, heads, rank + rope, generator=g).to(dtype)
    want = torch.bmm(o[..., :rank].float().transpose(0, 1), w_uv.float().transpose(1, 2))
    got = fused.latent_unabsorb(o, kv_b, nope)
    torch.testing.assert_close(
        got.float(), want.transpose(0, 1).to(dtype).float(), rtol=tol, atol=tol
    )


@pytest.mark.parametrize(
    ("n_group", "topk_group", "renormalize"), [(1, 1, True), (4, 2, True), (4, 1, False)]
)
def test_grouped_block_matches_route_grouped(
    n_group: int, topk_group: int, renormalize: bool
) -> None:
    """The native DeepSeek block (``SparseMoeBlock`` at decode sizes: router in float32,
    sigmoid group-limited routing, counts, experts, shared expert) against torch's
    ``route_grouped`` and the experts called with its choice: the same experts counted, the
    outputs within float32 rounding."""
    torch.manual_seed(0)
    experts, hidden, inter, top_k = 16, 32, 24, 4
    block = SparseMoeBlock(
        hidden, experts, top_k, inter, renormalize=renormalize, shared_intermediate_size=16,
        scoring="sigmoid", n_group=n_group, topk_group=topk_group, routed_scaling_factor=2.5,
    )  # fmt: skip
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.2)
    x = torch.randn(3, hidden)
    with torch.no_grad():
        assert block._native(x)
        got = block(x)
        counts = block.expert_tokens.clone()
        block.reset_stats()
        logits = torch.nn.functional.linear(x, block.gate.weight)
        bias = block.e_score_correction_bias
        assert bias is not None
        weights, ids = route_grouped(logits, bias, top_k, n_group, topk_group, renormalize, 2.5)
        want = block.experts(x, weights, ids) + block.shared_expert(x)  # type: ignore[misc]
    assert torch.equal(counts, torch.bincount(ids.reshape(-1), minlength=experts))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_what_the_latent_step_cannot_run_is_refused(tmp_path: Path) -> None:
    """Softmax-routed blocks with int8 experts beside latent attention (the grouped path is
    the sigmoid one's): no native step. With every projection int8 and no experts, the steps
    stop at the float kernel's rows all the same (kv_b_proj stays float: its absorbed products
    change form above them), and a Mixtral's int8 experts keep it in Python too."""
    from foudre.layers.linear import MAX_ROWS

    path = make_hf_model(tmp_path / "ds", "deepseek_v3", **BASE)
    runner = _llm(path, "float32", quantization="int8").engine.runner
    assert isinstance(runner.decode_path, NativeDecode)
    for block in runner.model.moe_blocks().values():
        block.scoring, block.e_score_correction_bias = "softmax", None
    build = (runner.model, runner.backend, runner.kv_caches, runner.block_size)
    assert NativeDecode.build(*build, -1, runner.group_of_layer) is None
    layers = BASE["num_hidden_layers"]
    dense = make_hf_model(
        tmp_path / "dense", "deepseek_v3", **{**BASE, "first_k_dense_replace": layers}
    )
    runner = _llm(dense, "float32", quantization="int8").engine.runner
    assert isinstance(runner.decode_path, NativeDecode) and not runner.model.moe_blocks()
    assert runner.decode_path.max_rows <= MAX_ROWS[torch.float32]
    mixtral = make_hf_model(tmp_path / "mixtral", "mixtral")
    assert _llm(mixtral, "float32", quantization="int8").engine.runner.decode_path is None
