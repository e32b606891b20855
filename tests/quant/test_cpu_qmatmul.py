"""Our native quantized-linear kernels (``cpu_qmatmul``) against dequantize-then-matmul.

The three paths (VNNI, AVX-512 float, portable) are each built and checked: the one this machine
takes in-process, the others in subprocesses built with ``FOUDRE_KERNEL_MARCH``.

Tolerance (``cpu_qmatmul.error_bound``): the float paths differ from the float32 reference only
by summation order (a 1e-5 relative bound on ``sum |w| |x|``). The VNNI path rounds each x to its
block's int8 grid, ``|x - d q| <= d / 2`` with ``d = max|x| / 127`` over its block of 32
columns, so its error is at most ``sum_k |w_k| d_k / 2`` more; bfloat16 outputs add their own
rounding, ``|y| * 2^-8``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from foudre.quant import cpu_qmatmul
from foudre.quant.packing import unpack_int4
from foudre.quant.qlinear import NATIVE_MAX_ROWS, QuantLinear, uses_native_kernels
from tests.engine.march import run_built_for

pytestmark = pytest.mark.skipif(cpu_qmatmul.path() is None, reason="no C++ compiler")

# (bits, group, n, k): K not a multiple of 32 or 64, N odd
CASES = [
    (8, None, 37, 100),
    (8, None, 33, 520),
    (8, None, 16, 1024),
    (4, 32, 37, 100),
    (4, 32, 17, 1000),
    (4, 64, 33, 520),
    (4, 128, 16, 1024),
    (4, 256, 33, 300),
]
ROWS = (1, 3, 16, 64)


def check_kernels() -> None:
    """Every case, row count and dtype through this build's path."""
    for bits, group, n, k in CASES:
        torch.manual_seed(bits * 1000 + n + k)
        w = torch.randn(n, k) * 0.1 + torch.linspace(-0.05, 0.1, k)  # all-positive groups too
        mod = QuantLinear.from_float(w, None, bits, group)
        packed = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, mod.group_size)
        wd = mod.dequantize()
        for m in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k) * torch.rand(m, 1) * 4).to(dtype)
                y = cpu_qmatmul.matmul(x, packed, group)
                assert y.dtype == dtype and y.shape == (m, n)
                ref = x.float() @ wd.t()
                tol = cpu_qmatmul.error_bound(x.float(), wd)
                if dtype == torch.bfloat16:
                    tol = tol + ref.abs() * 2**-8
                err = (y.float() - ref).abs()
                assert bool((err <= tol).all()), (bits, group, n, k, m, dtype, (err - tol).max())


def check_path_avx512() -> None:
    assert cpu_qmatmul.path() == "avx512"
    check_kernels()


def check_path_portable() -> None:
    assert cpu_qmatmul.path() == "portable"
    check_kernels()


def test_kernels_match_dequantized_matmul_on_this_cpu() -> None:
    check_kernels()


@pytest.mark.parametrize("march,check", [("skylake-avx512", "avx512"), ("x86-64", "portable")])
def test_other_paths_match(march: str, check: str, tmp_path: Path) -> None:
    """The AVX-512 float path (no VNNI) and the portable one, built for another -march."""
    run_built_for(
        march, f"tests.quant.test_cpu_qmatmul:check_path_{check}", "cpu_qmatmul", tmp_path
    )


def test_quantized_activations_are_needed_for_the_bound() -> None:
    """The VNNI bound is not vacuous: the float-path bound fails where x is rounded to int8."""
    if cpu_qmatmul.path() != "vnni":
        pytest.skip("this build multiplies in float32")
    torch.manual_seed(5)
    mod = QuantLinear.from_float(torch.randn(64, 512), None, 8)
    x = torch.randn(4, 512)
    y = cpu_qmatmul.matmul(x, cpu_qmatmul.layout(mod.qweight, mod.scales, None, None), None)
    ref = x @ mod.dequantize().t()
    float_bound = 1e-5 * (x.abs() @ mod.dequantize().abs().t()) + 1e-6
    assert bool(((y - ref).abs() > float_bound).any())
    assert bool(((y - ref).abs() <= cpu_qmatmul.error_bound(x, mod.dequantize())).all())


def test_bad_input_is_refused() -> None:
    mod = QuantLinear.from_float(torch.randn(8, 64), None, 8)
    packed = cpu_qmatmul.layout(mod.qweight, mod.scales, None, None)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_qmatmul.matmul(torch.randn(2, 64, dtype=torch.float64), packed, None)
    with pytest.raises(ValueError, match="columns"):
        cpu_qmatmul.matmul(torch.randn(2, 65), packed, None)


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32), (4, 128)])
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_quant_linear_matches_reference(
    bits: int, group: int | None, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``QuantLinear`` (ours up to 32 rows, aten's above) against ``forward_reference``, with
    bias, input scale and an act-order permutation."""
    monkeypatch.setitem(NATIVE_MAX_ROWS, bits, 32)
    torch.manual_seed(m + bits)
    k, n = 200, 45
    w = torch.randn(n, k) * 0.1
    perm = torch.randperm(k)
    q = QuantLinear.from_float(w, torch.randn(n), bits, group)
    mod = QuantLinear.from_codes(
        *(q.qweight, q.scales) if bits == 8 else (unpack_int4(q.qweight), q.scales),
        q.zeros, q.bias, bits, group, k, input_scale=torch.rand(k) + 0.5, perm=perm,
    )  # fmt: skip
    x = torch.randn(2, m, k)
    y, ref = mod(x), mod.forward_reference(x)
    assert y.shape == (2, m, n)
    xp = mod._prepare_input(x).reshape(-1, k)
    tol = cpu_qmatmul.error_bound(xp, mod.dequantize()).reshape(2, m, n) + 1e-5
    assert bool(((y - ref).abs() <= tol).all())


def test_a_row_does_not_depend_on_its_batch() -> None:
    """Each row's result is the same bit for bit alone as in any batch (its quantization, sums
    and their order are its own), so an engine's output never depends on the other requests."""
    torch.manual_seed(7)
    for bits, group in ((8, None), (4, 64)):
        mod = QuantLinear.from_float(torch.randn(70, 300), None, bits, group)
        packed = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, mod.group_size)
        x = torch.randn(37, 300).bfloat16()
        batch = cpu_qmatmul.matmul(x, packed, group)
        for i in (0, 5, 36):
            assert torch.equal(cpu_qmatmul.matmul(x[i : i + 1], packed, group), batch[i : i + 1])
            assert torch.equal(cpu_qmatmul.matmul(x[i : i + 3], packed, group)[0], batch[i])


def test_switched_off_runs_aten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOUDRE_NATIVE_QMATMUL", "0")
    assert not uses_native_kernels(torch.float32)
    mod = QuantLinear.from_float(torch.randn(16, 64), None, 8)
    x = torch.randn(1, 64)
    assert torch.allclose(mod(x), mod.forward_reference(x), atol=1e-4)
