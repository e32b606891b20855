"""FP8 (e4m3) weights: the quantizer's bound, ``Fp8Linear`` against dequantize-then-matmul, the
activation-quantized ``torch._scaled_mm`` path against its float64 emulation (torch's CPU build
runs ``_scaled_mm``), dtype moves, and ``quantization="fp8"`` through the engine against the
float model with the same rounded weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from foudre import LLM, SamplingParams
from foudre.quant import Fp8, Fp8Linear, config_for_method, quantize_
from foudre.quant.calib import run_sequence
from foudre.quant.fp8 import (
    FP8_MAX,
    quantize_fp8,
    quantize_rows,
    scaled_mm,
    scaled_mm_reference,
    uses_scaled_mm,
)
from tests.conftest import make_hf_model


def test_quantize_fp8_error_bound() -> None:
    torch.manual_seed(0)
    w = torch.randn(40, 96) * torch.rand(40, 1) * 3
    w[3] = 0.0  # a row of zeros: scale 1, codes 0
    q, s = quantize_fp8(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    deq = q.float() * s[:, None]
    # 3 mantissa bits: within 2^-4 of each value; below e4m3's normals (2^-6), half a
    # subnormal step (2^-10 of the scale)
    bound = torch.maximum(w.abs() * 2**-4, s[:, None] * 2**-10)
    assert bool(((deq - w).abs() <= bound * (1 + 1e-6)).all())
    rows = torch.arange(40) != 3
    # each row's largest magnitude is 448 * scale: exact but for the scale's float32 rounding
    assert torch.allclose(deq[rows].abs().amax(1), w[rows].abs().amax(1), rtol=1e-6, atol=0)
    assert s[3] == 1.0 and bool((deq[3] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 72), (5, 72), (2, 3, 72)])
def test_fp8_linear_matches_dequantize_reference(dtype: torch.dtype, shape: tuple[int]) -> None:
    torch.manual_seed(1)
    mod = Fp8Linear.from_float(torch.randn(33, 72), torch.randn(33)).to(dtype)
    x = torch.randn(*shape).to(dtype)
    y, ref = mod(x), mod.forward_reference(x)
    assert y.dtype == dtype and y.shape == (*shape[:-1], 33)
    exact = x.double() @ mod.dequantize().double().t() + mod.bias.double()  # type: ignore[union-attr]
    tol = 1e-4 if dtype == torch.float32 else 2e-2 * exact.abs().max().item()
    assert bool(torch.isfinite(y).all())
    assert (y.double() - exact).abs().max().item() <= tol
    assert (ref.double() - exact).abs().max().item() <= tol


def test_scaled_mm_matches_its_emulation() -> None:
    """The activation-quantized path (per-token e4m3 activations, ``torch._scaled_mm``) against
    the same rounding in float64, and its distance from the weight-only product: e4m3's."""
    torch.manual_seed(2)
    w = torch.randn(48, 64)
    q, s = quantize_fp8(w)
    x = torch.randn(7, 64) * torch.rand(7, 1) * 4
    emulated = scaled_mm_reference(x, q, s)
    for out_dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2**-8)):
        y = scaled_mm(x, q, s, out_dtype)
        assert y.dtype == out_dtype and y.shape == (7, 48)
        err = (y.double() - emulated).abs().max().item()
        assert err <= tol * emulated.abs().max().item()
    weight_only = x.double() @ (q.double() * s.double()[:, None]).t()
    rel = (emulated - weight_only).norm() / weight_only.norm()
    assert 0 < rel.item() < 2**-4
    xq, xs = quantize_rows(x)
    assert bool((xq.float().abs().amax(1) == FP8_MAX).all()) and xs.shape == (7, 1)


def test_scaled_mm_only_on_hopper_bf16_batches() -> None:
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    assert not uses_scaled_mm(x, 48)  # CPU: weight-only
    if torch.cuda.is_available():
        cuda = x.cuda()
        hopper = torch.cuda.get_device_capability() >= (9, 0)
        assert uses_scaled_mm(cuda, 48) == hopper
        assert not uses_scaled_mm(cuda[:1], 48)  # decode rows: the Triton kernels
        assert not uses_scaled_mm(cuda.float(), 48)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("rows", [1, 16, 64])
def test_fp8_linear_on_cuda(rows: int) -> None:
    """On a GPU: the weight-only Triton path against dequantize-then-matmul, and (Hopper,
    bfloat16, more than ``TRITON_MAX_ROWS`` rows) ``torch._scaled_mm`` against its emulation."""
    torch.manual_seed(3)
    mod = Fp8Linear.from_float(torch.randn(96, 128), torch.randn(96)).cuda()
    x = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
    y = mod(x).double()
    bias = mod.bias.double()  # type: ignore[union-attr]
    if uses_scaled_mm(x, 96):
        want = scaled_mm_reference(x, mod.weight, mod.weight_scale) + bias
    else:
        want = x.double() @ mod.dequantize().double().t() + bias
    assert (y - want).abs().max().item() <= 2e-2 * want.abs().max().item()


def test_dtype_moves_keep_fp8_weight_and_float32_scales() -> None:
    mod = Fp8Linear.from_float(torch.randn(16, 32), torch.randn(16))
    before = mod.dequantize()
    mod = mod.to(torch.bfloat16)
    assert mod.weight.dtype == torch.float8_e4m3fn and mod.weight_scale.dtype == torch.float32
    assert mod.bias is not None and mod.bias.dtype == torch.bfloat16
    assert torch.equal(mod.dequantize(), before)
    mod.half()
    assert mod.weight.dtype == torch.float8_e4m3fn and mod.bias.dtype == torch.float16
    state = mod.state_dict()
    other = Fp8Linear(32, 16, bias=True, dtype=torch.float16)
    other.load_state_dict(state)
    assert torch.equal(other.dequantize(), before)


def test_quantize_swaps_linears_and_skips_head(hf_llama: Path) -> None:
    from foudre.loading.loader import load_model

    model = load_model(str(hf_llama), None, "float32", torch.device("cpu"), None).model
    assert config_for_method("fp8") == Fp8()
    applied = quantize_(model, Fp8())
    fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
    assert fp8 == set(applied) and len(fp8) == 2 * 4  # qkv, o, gate_up, down per layer
    assert isinstance(model.lm_head, nn.Linear)


def test_engine_fp8_generates_within_fp8_error(tmp_path: Path) -> None:
    """``LLM(quantization="fp8")``: the logits equal those of the float model whose linears
    hold the same e4m3-rounded weights (dequantize-then-matmul), and stay within e4m3's error of
    the unquantized model's."""
    path = make_hf_model(tmp_path / "m", "llama")
    common = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=128)
    ref = LLM(str(path), **common)  # type: ignore[arg-type]
    fp8 = LLM(str(path), quantization="fp8", **common)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[1, 17, 90, 4, 250, 33], [1, 5]]
    outs = [o.outputs[0].token_ids for o in fp8.generate(prompts, params)]
    assert [len(o) for o in outs] == [12, 12]
    m = fp8.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]

    float_model, fp8_model = ref.engine.model, fp8.engine.model
    ids = prompts[0] + outs[0]
    with torch.no_grad():
        want = float_model.compute_logits(run_sequence(float_model, ids))
        got = fp8_model.compute_logits(run_sequence(fp8_model, ids))
        for name, mod in fp8_model.named_modules():
            if isinstance(mod, Fp8Linear):
                lin = float_model.get_submodule(name)
                assert isinstance(lin, nn.Linear)
                lin.weight.copy_(mod.dequantize())
        rounded = float_model.compute_logits(run_sequence(float_model, ids))
    assert (got - rounded).abs().max().item() <= 1e-4 * rounded.abs().max().item()
    rel = ((got - want).norm() / want.norm()).item()
    assert 0 < rel < 0.1  # e4m3 weights: a few percent
    assert (got.argmax(-1) == want.argmax(-1)).float().mean().item() >= 0.75


def test_fp8_float16_neither_overflows_nor_loses_small_rows() -> None:
    """float16 activations: codes up to 448 times large activations would overflow a float16
    product before the scale, and tiny scales would be float16 subnormals; the float16 path
    dequantizes first."""
    torch.manual_seed(5)
    w = torch.randn(16, 4096) * 0.02
    w[3] *= 1e-2  # a row of small weights: its scale is a float16 subnormal
    mod = Fp8Linear.from_float(w, None).half()
    x = torch.randn(4, 4096)
    x[:, :8] *= 60  # outliers, as real hidden states have
    y = mod(x.half()).double()
    exact = x.half().double() @ mod.dequantize().double().t()
    assert bool(torch.isfinite(y).all())
    assert bool(((y - exact).abs() <= 2e-3 * exact.abs() + 1e-2 * exact.abs().amax(0)).all())
