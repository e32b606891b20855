"""``layers.linear.linear``'s torch paths past the CPU kernel's rows: bfloat16 products in
float32 where the CPU has no bfloat16 arithmetic (``gemm_dtype``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foudre.layers import fused
from foudre.layers import linear as linear_mod
from foudre.quant import cpu_qmatmul
from foudre.quant.qlinear import QuantLinear


@pytest.mark.parametrize("gemm", [True, False])  # the AVX2 build's GEMM, or MKL's over chunks
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n", [300, 40])  # a partial last chunk of BF16_CHUNK, and one chunk
def test_bfloat16_rows_in_float32(
    gemm: bool, bias: bool, n: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Widened: the float32 product (and bias) rounded once to bfloat16, whatever this CPU
    has, through the AVX2 build's GEMM up to ``GEMM_ROWS`` rows where it has one, else MKL's
    over widened chunks; not widened where bfloat16 GEMMs are fast: torch's own bfloat16 GEMM."""
    if gemm and not fused.has_gemm():
        pytest.skip("this build has no bfloat16 GEMM (AVX2 only)")
    g = torch.Generator().manual_seed(n)
    x = torch.randn(70, 96, generator=g).bfloat16()
    w = torch.randn(n, 96, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    ref = F.linear(x.float(), w.float(), None if b is None else b.float())
    monkeypatch.setattr(linear_mod, "gemm_dtype", lambda dtype: torch.float32)
    monkeypatch.setattr(linear_mod, "GEMM_ROWS", 70 if gemm else 69)
    calls: list[int] = []
    kernel = fused.gemm_unchecked
    monkeypatch.setattr(fused, "gemm_unchecked", lambda x, *a: calls.append(1) or kernel(x, *a))
    y = linear_mod.linear(x, w, b)
    assert calls == ([1] if gemm else [])
    assert y.dtype == torch.bfloat16 and y.shape == (70, n)
    # float32 sums in another order than ref's, then one rounding: within a bf16 ulp
    assert bool(((y.float() - ref).abs() <= ref.abs() * 2**-7 + 1e-5).all())
    assert (y == ref.bfloat16()).float().mean() > 0.95
    monkeypatch.setattr(linear_mod, "gemm_dtype", lambda dtype: dtype)
    assert torch.equal(linear_mod.linear(x, w, b), F.linear(x, w, b))


def test_gemm_dtype() -> None:
    assert linear_mod.gemm_dtype(torch.float32) == torch.float32
    fast = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert linear_mod.gemm_dtype(torch.bfloat16) == (torch.bfloat16 if fast else torch.float32)


@pytest.mark.skipif(cpu_qmatmul.path() is None, reason="no C++ compiler")
def test_dequantized_gemm_widens_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A quantized weight's large-batch product in float32 where bfloat16 GEMMs are slow: the
    dequantized weight unrounded (closer to the float32 reference than its bfloat16 copy)."""
    torch.manual_seed(3)
    mod = QuantLinear.from_float(torch.randn(48, 256) * 0.1, None, 4, 128)
    packed = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, 128, 4)
    x = torch.randn(80, 256).bfloat16()
    ref = x.float() @ mod.dequantize().t()
    monkeypatch.setattr(cpu_qmatmul, "gemm_dtype", lambda dtype: torch.float32)
    wide = cpu_qmatmul.matmul_dequantized(x, packed)
    assert wide.dtype == torch.bfloat16
    assert bool(((wide.float() - ref).abs() <= ref.abs() * 2**-8 + 1e-4).all())
    monkeypatch.setattr(cpu_qmatmul, "gemm_dtype", lambda dtype: dtype)
    narrow = cpu_qmatmul.matmul_dequantized(x, packed)
    assert (narrow.float() - ref).abs().sum() > (wide.float() - ref).abs().sum()
