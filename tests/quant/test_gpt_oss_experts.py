"""gpt-oss's experts in one native call at decode sizes (``layers/fused_moe.gpt_oss_experts``
for float weights, ``quant/mxfp4.native_experts`` for MXFP4 ones) against the torch path they
replace (``grouped_experts`` over each expert's own calls) and against transformers' gpt-oss
experts.

Tolerances: MXFP4 products are ``native_matmul``'s bit for bit and the activation rounds as
torch's ops do, so bfloat16 outputs are equal but for a rare ulp where the exponential of a
sigmoid differs in its last float32 bit (``2^-7 |y|`` allowed), float32 ones within ``1e-5``
relative; float weights sum their products in another order than ``layers/linear``'s kernel
(float32: ``1e-5`` of the largest output; bfloat16: one rounding, ``2^-7``)."""

from __future__ import annotations

import weakref
from functools import partial

import pytest
import torch

from foudre.layers import fused_moe, moe
from foudre.layers.moe import ClampedSwiGLUExperts, clamped_swiglu, grouped_experts, swiglu_params
from foudre.quant import mxfp4
from foudre.quant.mxfp4 import MXFP4Experts

E, H, INTER = 6, 64, 96
TOL = {torch.float32: 1e-5, torch.bfloat16: 2.0**-7}

needs_native = pytest.mark.skipif(
    fused_moe._library() is None or mxfp4._library() is None, reason="native kernels not built"
)


def float_experts(dtype: torch.dtype, seed: int = 0) -> ClampedSwiGLUExperts:
    g = torch.Generator().manual_seed(seed)
    m = ClampedSwiGLUExperts(E, H, INTER, alpha=1.702, limit=7.0)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.4)
    return m.to(dtype)


def routing(rows: int, k: int = 3, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(rows)])
    weights = torch.softmax(torch.randn(rows, k, generator=g), dim=-1)
    return weights, ids


def assert_near(got: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == expected.dtype == dtype and got.shape == expected.shape
    err = float((got.float() - expected.float()).abs().max())
    assert err <= TOL[dtype] * float(expected.float().abs().max()), err


def native_matches_torch(
    m: torch.nn.Module, rows: int, seed: int, dtype: torch.dtype, mp: pytest.MonkeyPatch
) -> None:
    """``m`` over ``rows`` random rows (from ``seed``) takes the native call, and gives the
    torch path's output (``grouped_experts`` over its own experts) within the tolerance."""
    x = torch.randn(rows, H, generator=torch.Generator().manual_seed(seed)).to(dtype)
    weights, ids = routing(rows)
    with torch.no_grad():
        expected = grouped_experts(x, weights, ids, E, m.expert)
        no_torch_path(mp)
        got = m(x, weights, ids)
    assert_near(got, expected, dtype)


def no_torch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the torch path fail, so a test sees the native call taken."""

    def refuse(*args: object, **kwargs: object) -> torch.Tensor:
        raise AssertionError("the torch path ran")

    monkeypatch.setattr(moe, "grouped_experts", refuse)
    monkeypatch.setattr(mxfp4, "grouped_experts", refuse)
    monkeypatch.setattr("foudre.quant.experts.grouped_experts", refuse)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_float_experts_match_the_torch_path(
    dtype: torch.dtype, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    native_matches_torch(float_experts(dtype), rows, 2, dtype, monkeypatch)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rows", [1, 4, 9])
def test_mxfp4_experts_match_the_torch_path(
    dtype: torch.dtype, interleaved: bool, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    m = MXFP4Experts.from_experts(float_experts(torch.float32)).to(dtype)
    m.activation = partial(clamped_swiglu, alpha=1.702, limit=7.0, interleaved=interleaved)
    native_matches_torch(m, rows, 3, dtype, monkeypatch)


@needs_native
def test_float_experts_match_transformers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Transformers' gpt-oss experts (float32, interleaved gate_up ``[E, H, 2I]``) and ours
    holding the same weights as the loader lays them out, over the same routing."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(
        hidden_size=H, intermediate_size=INTER, num_local_experts=E, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    hf = GptOssExperts(config).eval()
    ours = ClampedSwiGLUExperts(E, H, INTER, alpha=hf.alpha, limit=hf.limit)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.5)
        gu, gub = hf.gate_up_proj, hf.gate_up_proj_bias
        ours.gate_up_proj.copy_(torch.cat([gu[..., 0::2], gu[..., 1::2]], -1).transpose(1, 2))
        ours.gate_up_proj_bias.copy_(torch.cat([gub[..., 0::2], gub[..., 1::2]], -1))
        ours.down_proj.copy_(hf.down_proj.transpose(1, 2))
        ours.down_proj_bias.copy_(hf.down_proj_bias)
        weights, ids = routing(5, k=2)
        x = torch.randn(5, H)
        expected = hf(x, ids, weights)
        no_torch_path(monkeypatch)
        got = ours(x, weights, ids)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


@needs_native
def test_bad_routing_is_refused() -> None:
    m = float_experts(torch.float32)
    x = torch.randn(2, H)
    weights, ids = routing(2)
    with pytest.raises(IndexError, match="expert id"):
        fused_moe.gpt_oss_experts(
            x, weights, ids + E, m.gate_up_proj, m.gate_up_proj_bias, m.down_proj,
            m.down_proj_bias, 1.702, 7.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="down_bias"):
        fused_moe.gpt_oss_experts(
            x, weights, ids, m.gate_up_proj, m.gate_up_proj_bias, m.down_proj,
            m.down_proj_bias[:, :3], 1.702, 7.0,
        )  # fmt: skip
    with pytest.raises(ValueError, match="ids and weights"):
        fused_moe.gpt_oss_experts(
            x, weights[:1], ids, m.gate_up_proj, None, m.down_proj, None, 1.702, 7.0
        )
    mx = MXFP4Experts.from_experts(m)
    with pytest.raises(IndexError, match="expert id"):
        mxfp4.native_experts(x, weights, ids - E, mx)


def test_swiglu_params_and_from_experts() -> None:
    """``from_experts`` of gpt-oss's float experts holds their activation as a partial of
    ``clamped_swiglu`` (what the native call reads), not a method keeping the float module."""
    m = float_experts(torch.float32)
    mx = MXFP4Experts.from_experts(m)
    assert swiglu_params(mx.activation) == (1.702, 7.0, False)
    assert swiglu_params(moe.silu_mul) is None
    assert swiglu_params(partial(clamped_swiglu, alpha=1.0)) is None
    gone = weakref.ref(m)
    del m
    assert gone() is None


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_and_int4_quantize_gpt_oss_experts(
    bits: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``quantize_`` with int8 / int4 turns gpt-oss's experts into ``QuantExperts`` keeping their
    biases and clamped SwiGLU: the same output as the float experts holding the dequantized
    weights. int8 at decode sizes runs the native call, x not rounded: within the dtype's
    tolerance; int4 runs the torch path, whose kernels round x to int8 (1/127 of a block's
    largest |x|, a few percent after two products and the activation)."""
    from torch import nn

    from foudre.quant import Int4WeightOnly, Int8WeightOnly, quantize_
    from foudre.quant.experts import QuantExperts

    model = nn.Module()
    model.experts = float_experts(dtype)
    reference = float_experts(torch.float32)
    quantize_(model, Int8WeightOnly() if bits == 8 else Int4WeightOnly(group_size=32))
    q = model.experts
    assert isinstance(q, QuantExperts) and swiglu_params(q.activation) == (1.702, 7.0, False)
    with torch.no_grad():
        reference.gate_up_proj.copy_(torch.stack([m.dequantize() for m in q.gate_up]))
        reference.down_proj.copy_(torch.stack([m.dequantize() for m in q.down]))
        reference = reference.to(dtype)
        x = torch.randn(5, H, generator=torch.Generator().manual_seed(4)).to(dtype)
        weights, ids = routing(5)
        expected = grouped_experts(x, weights, ids, E, reference.expert)
        if bits == 8 and fused_moe._library() is not None:
            no_torch_path(monkeypatch)
            got = q(x, weights, ids)
            assert_near(got, expected, dtype)
            return
        got = q(x, weights, ids)
    err = float((got.float() - expected.float()).abs().max())
    assert err <= 0.03 * float(expected.float().abs().max()), err


@needs_native
def test_int8_experts_follow_their_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native int8 call reads each expert's codes, scales and biases where they are at the
    call: after ``place_in_huge_pages`` moves them under the same tensors (``set_``), and in a
    deep copy of the module, the output is the one computed before; another width of x, or a
    scheme that does not quantize gpt-oss's experts (fp8), leaves them to the torch path and in
    float."""
    import copy

    from torch import nn

    from foudre.native import huge_pages
    from foudre.quant import Fp8, Int8WeightOnly, quantize_

    model = nn.Module()
    model.experts = float_experts(torch.float32)
    quantize_(model, Int8WeightOnly())
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(5))
    weights, ids = routing(2)
    with torch.inference_mode():
        before = model.experts(x, weights, ids)
        huge_pages.place_in_huge_pages(model)
        junk = [torch.full((1 << 12,), 77, dtype=torch.int8) for _ in range(200)]  # reuse
        twin = copy.deepcopy(model.experts)
        no_torch_path(monkeypatch)
        assert torch.equal(model.experts(x, weights, ids), before)
        del model
        assert torch.equal(twin(x, weights, ids), before)
        monkeypatch.undo()
        wide = torch.randn(2, H + 8)
        with pytest.raises(ValueError, match="columns"):  # the torch path: no stray read
            twin(wide, weights, ids)
    del junk
    kept = nn.Module()
    kept.experts = float_experts(torch.float32)
    quantize_(kept, Fp8())
    assert isinstance(kept.experts, ClampedSwiGLUExperts)
