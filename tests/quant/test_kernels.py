"""Quantizer error bounds, and the packed kernels against the dequantize reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foudre.quant import cpu_qmatmul
from foudre.quant.packing import (
    dequantize_int4,
    pack_int4,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from foudre.quant.qlinear import QuantLinear


def test_int8_error_bound() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 80) * torch.rand(48, 1) * 3
    q, s = quantize_int8(w)
    err = (q.float() * s[:, None] - w).abs()
    assert bool((err <= s[:, None] / 2 + 1e-6).all())


@pytest.mark.parametrize("group", [32, 64, 128, 256])
def test_int4_error_bound(group: int) -> None:
    torch.manual_seed(1)
    w = torch.randn(32, 512) + torch.linspace(-2, 2, 512)
    q, s, z = quantize_int4(w, group)
    assert int(q.max()) <= 15
    deq = dequantize_int4(q, s, z, group)
    g = w.view(32, -1, group)
    bound = (g.amax(2) - g.amin(2)) / 15 / 2
    err = (deq - w).abs().view(32, -1, group)
    assert bool((err <= bound[..., None] + 1e-6).all())


def test_pack_roundtrip() -> None:
    q = torch.randint(0, 16, (7, 64), dtype=torch.uint8)
    assert torch.equal(unpack_int4(pack_int4(q)), q)


SHAPES = [(1, 64, 128), (33, 176, 64), (5, 172, 96), (1, 64, 172)]
# CPU: the native packed kernels; CUDA (when present): the Triton kernels, for real
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,group", [(8, None), (4, 32), (4, 64), (4, 128)])
@pytest.mark.parametrize("m,n,k", SHAPES)
def test_packed_kernel_matches_reference(
    dtype: torch.dtype, bits: int, group: int | None, m: int, n: int, k: int, device: str
) -> None:
    torch.manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k) * 0.1
    bias = torch.randn(n) * 0.1
    mod = QuantLinear.from_float(w, bias, bits, group).to(dtype).to(device)
    x = torch.randn(m, k, dtype=dtype, device=device)
    y, ref = mod(x), mod.forward_reference(x)
    assert y.dtype == dtype and y.shape == (m, n)
    exact = x.float() @ mod.dequantize().t() + mod.bias.float()  # type: ignore[union-attr]
    tol: float | torch.Tensor = 1e-4
    if dtype != torch.float32:
        tol = 3e-2 * exact.abs().max().item() + 1e-2
    elif device == "cpu":  # cpu_qmatmul may round x to int8 per block: its bound
        tol = 1e-4 + cpu_qmatmul.error_bound(x, mod.dequantize(), mod.bits, mod.group_size)
    assert bool(((y.float() - ref.float()).abs() <= tol).all())
    assert bool(((y.float() - exact).abs() <= tol).all())


def test_3d_input_and_dtype_move() -> None:
    mod = QuantLinear.from_float(torch.randn(32, 64), None, 4, 32)
    x = torch.randn(2, 3, 64)
    bound = cpu_qmatmul.error_bound(x.reshape(6, 64), mod.dequantize(), 4, 32)
    tol = 1e-4 + bound.reshape(2, 3, 32)
    assert bool(((mod(x) - mod.forward_reference(x)).abs() <= tol).all())
    y16 = mod.to(torch.bfloat16)(x.bfloat16())
    assert y16.dtype == torch.bfloat16 and y16.shape == (2, 3, 32)


def test_input_scale_and_perm_are_applied() -> None:
    torch.manual_seed(3)
    w = torch.randn(16, 64)
    perm = torch.randperm(64)
    q, s, z = quantize_int4(w[:, perm], 32)
    scale = torch.rand(64) + 0.5
    mod = QuantLinear.from_codes(q, s, z, None, 4, 32, 64, input_scale=scale, perm=perm)
    x = torch.randn(3, 64)
    expected = x @ mod.effective_weight().t()
    tol = 1e-4 + cpu_qmatmul.error_bound(mod._prepare_input(x), mod.dequantize(), 4, 32)
    assert bool(((mod(x) - expected).abs() <= tol).all())
    assert torch.allclose(mod.forward_reference(x), expected, atol=1e-4)


_TRITON_CHECK = """
import torch
from foudre.quant.qlinear import QuantLinear
from foudre.quant import triton_kernels
torch.manual_seed(0)
for bits, group in ((8, None), (4, 32), (4, 64)):
    for m, n, k in ((1, 40, 96), (33, 64, 80)):
        mod = QuantLinear.from_float(torch.randn(n, k), None, bits, group)
        x = torch.randn(m, k)
        y = triton_kernels.quant_matmul(x, mod.qweight, mod.scales, mod.zeros, mod.group_size)
        err = (y - mod.forward_reference(x)).abs().max()
        assert err < 1e-3, (bits, group, m, n, k, err)
print("ok")
"""


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the CUDA parameters run the kernels for real"
)
def test_triton_kernels_interpreted() -> None:
    pytest.importorskip("triton", reason="triton is not installed")
    env = dict(os.environ, TRITON_INTERPRET="1")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", _TRITON_CHECK],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode != 0 and "interpret" in out.stderr.lower() and "not" in out.stderr.lower():
        pytest.skip(f"TRITON_INTERPRET unavailable: {out.stderr[-300:]}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ok" in out.stdout


def test_bf16_compute_dtype_for_float32_inputs() -> None:
    torch.manual_seed(4)
    mod = QuantLinear.from_float(torch.randn(64, 128) * 0.1, torch.randn(64), 4, 32)
    x = torch.randn(3, 128)
    ref = mod.forward_reference(x)
    mod.compute_dtype = torch.bfloat16
    y = mod(x)
    assert y.dtype == torch.float32
    assert (y - ref).abs().max().item() <= 3e-2 * ref.abs().max().item()
