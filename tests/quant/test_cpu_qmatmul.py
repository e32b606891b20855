"""Our native quantized-linear kernels (``cpu_qmatmul``) against dequantize-then-matmul.

The four paths (VNNI, AVX2, AVX-512 float, portable) are each built and checked: the one this
machine takes in-process, the others in subprocesses built with ``FOUDRE_KERNEL_MARCH``.

Tolerance (``cpu_qmatmul.error_bound``): the float paths differ from the float32 reference only
by summation order (a 1e-5 relative bound on ``sum |w| |x|``). The VNNI and AVX2 paths round each
x to its block's int8 grid, ``|x - d q| <= d / 2`` with ``d = max|x| / 127`` over its block
(``cpu_qmatmul.activation_block``: 32, 64 or 128 columns), so its error is at most
``sum_k |w_k| d_k / 2`` more; bfloat16 outputs add their own rounding, ``|y| * 2^-8``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from foudre.quant import cpu_qmatmul, qlinear
from foudre.quant.packing import (
    pack_int6,
    quantize_int4,
    quantize_int6,
    unpack_int4,
    unpack_int6,
)
from foudre.quant.qlinear import NATIVE_MAX_ROWS, QuantLinear, uses_native_kernels
from tests.engine.march import (
    MODELED_MACROS,
    cpu_paths,
    native_paths,
    run_built_for,
    run_check,
)

pytestmark = pytest.mark.skipif(cpu_qmatmul.path() is None, reason="no C++ compiler")

# (bits, group, zero point, n, k, scales' dtype): K not a multiple of 16, 32 or 64, N odd;
# group-wise 8-bit with and without zero points (GGUF's Q8_0 / Q5_0 / Q6_K, and Q5_1 / Q5_K
# repacked); each dtype of scales with each count of scales a VNNI step reads (8, 4, 2 of them:
# groups of 16 / 32 / 64 for 8 bits; 4, 2: 32 / 64 for 4 bits; one for larger groups, float16
# and float32 for 8 bits); 8-bit K = 64 mod 128 once padded (a last step of one half: 192, 300,
# 310, 320, 448, 520 columns) in groups of 16 to 256, with and without zero points; 6 bits
# (GGUF's Q6_K: codes 0..63, an int8 sub-scale per 16 columns, a d per 256) with each dtype of d;
# 8 bits in groups of 32 over chunks of 512 columns (Vnni::steps reads their scales at once)
# with each dtype, then a step and a half (704) or a half (1600)
CASES = [
    (8, None, False, 37, 100, torch.float32),
    (8, None, False, 33, 520, torch.bfloat16),
    (8, None, False, 16, 1024, torch.float16),
    (8, 16, False, 21, 200, torch.float32),
    (8, 16, True, 19, 520, torch.float16),
    (8, 32, False, 37, 100, torch.bfloat16),
    (8, 32, True, 17, 1000, torch.float16),
    (8, 64, True, 33, 300, torch.float32),
    (8, 128, False, 13, 256, torch.float16),
    (8, 256, False, 9, 520, torch.bfloat16),
    (8, 16, False, 23, 192, torch.bfloat16),
    (8, 64, False, 11, 448, torch.float16),
    (8, 64, True, 15, 310, torch.bfloat16),
    (8, 32, True, 11, 192, torch.float16),
    (8, 128, True, 9, 320, torch.float32),
    (8, 32, "const", 19, 300, torch.float32),
    (4, 32, True, 37, 100, torch.float16),
    (4, 32, True, 17, 1000, torch.bfloat16),
    (4, 64, True, 33, 520, torch.float32),
    (4, 64, True, 13, 384, torch.bfloat16),
    (4, 128, True, 16, 1024, torch.bfloat16),
    (4, 256, True, 33, 300, torch.float16),
    (4, 128, True, 11, 640, torch.float32),  # (groups of 128 or more: a loop per scale type)
    (4, 32, "const", 37, 300, torch.float32),
    (4, 128, "const", 19, 384, torch.bfloat16),
    (4, 64, "half", 21, 256, torch.float32),
    (8, 32, "half", 13, 128, torch.float16),
    (8, 32, False, 21, 704, torch.bfloat16),
    (8, 32, True, 7, 1600, torch.float32),
    (8, 32, False, 5, 1536, torch.float16),
    (8, 32, "const", 19, 288, torch.float16),  # (K a multiple of 32, not 64: blocks padded)
    (6, 16, False, 37, 300, torch.float16),
    (6, 16, "raw", 21, 512, torch.float16),
    (6, 16, False, 16, 1024, torch.float32),
    (6, 16, False, 33, 520, torch.bfloat16),
]
ROWS = (1, 2, 3, 16, 64, 150)  # 150: on AVX2 x in panels of 64 rows (kPanelBytes), the last 22


def quant_module(bits: int, group: int | None, zero: bool | str, w: torch.Tensor) -> QuantLinear:
    """Round-to-nearest ``w``; group-wise 8-bit with a zero point: 5-bit codes 0..31 with a
    scale and a (fractional) zero point per group, as GGUF's Q5_1 is repacked; ``"const"``: one
    zero point for every group (8 for 4 bits, as GGUF's Q4_0; 16 for 8 bits, as Q5_0 could: the
    VNNI kernel takes it off in each lane's int32 sum), ``"half"`` one that is not an integer
    (7.5, 15.5: taken off per group at the end); 6 bits ``"raw"``: random codes 0..63, int8
    sub-scales (-128 included) and float16 d of either sign, as a GGUF file's Q6_K blocks."""
    if zero == "raw":
        assert bits == 6
        n, k = w.shape
        kp = -(-k // 256) * 256
        codes = torch.randint(0, 64, (n, kp), dtype=torch.uint8)
        subs = torch.randint(-128, 128, (n, kp // 16), dtype=torch.int8)
        subs[0, 0] = -128
        d = (torch.randn(n, kp // 256) * 1e-3).half()
        return QuantLinear.from_codes(codes, d, None, None, 6, 16, k, scale_dtype=torch.float16,
                                      sub_scales=subs)  # fmt: skip
    if zero in ("const", "half"):
        assert group is not None
        n, k = w.shape
        kp = -(-k // group) * group
        g = torch.nn.functional.pad(w, (0, kp - k)).reshape(n, kp // group, group)
        z0 = (8 if bits == 4 else 16) - (0.5 if zero == "half" else 0)
        scales = g.abs().amax(-1).clamp(min=1e-6) / (z0 - 1)
        q = torch.round(g / scales[..., None] + z0).clamp(0, 2 * int(z0 + 0.5) - 1).reshape(n, kp)
        zeros = torch.full_like(scales, z0)
        return QuantLinear.from_codes(q.to(torch.uint8 if bits == 4 else torch.int8), scales,
                                      zeros, None, bits, group, k)  # fmt: skip
    if not (bits == 8 and zero):
        return QuantLinear.from_float(w, None, bits, group)
    assert group is not None
    n, k = w.shape
    kp = -(-k // group) * group
    g = torch.nn.functional.pad(w, (0, kp - k)).reshape(n, kp // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scales = (hi - lo).clamp(min=1e-6) / 31
    zeros = -lo / scales
    q = torch.round(g / scales[..., None] + zeros[..., None]).clamp(0, 31)
    return QuantLinear.from_codes(q.reshape(n, kp).to(torch.int8), scales, zeros, None, 8, group, k)


def check_kernels() -> None:
    """Every case, row count and dtype through this build's path."""
    for bits, group, zero, n, k, scale_dtype in CASES:
        torch.manual_seed(bits * 1000 + n + k)
        w = torch.randn(n, k) * 0.1 + torch.linspace(-0.05, 0.1, k)  # all-positive groups too
        mod = quant_module(bits, group, zero, w).to(scale_dtype)
        assert (mod.zeros is not None) == (bool(zero) and bits != 6)
        packed = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, mod.group_size, bits)
        assert packed.s.dtype == scale_dtype  # read as stored: each dtype's loads checked
        assert (packed.z is None) == (zero != True)  # noqa: E712 (one zero point: none read)
        const = {4: 8.0, 8: 16.0}.get(bits, 0.0) if zero in ("const", "half") else 0.0
        const -= 0.5 if zero == "half" else 0.0
        assert packed.zc == (32 if bits == 6 else const)  # 6 bits: q - 32
        wd = mod.dequantize()
        if packed.z is not None:  # scales and zero points paired: read with their row stride
            s, z = cpu_qmatmul.pair_scales(packed.s, packed.z)
            paired = dataclasses.replace(packed, s=s, z=z)
            assert paired.s.stride(0) == 2 * paired.s.shape[1]
            for m in (3, 17):  # (17: on AMX's tiles where they take the layout)
                x = torch.randn(m, k)
                assert torch.equal(cpu_qmatmul.matmul(x, paired), cpu_qmatmul.matmul(x, packed))
            got = cpu_qmatmul.dequantize_rows(paired, 1, n, torch.float32)
            assert torch.equal(got, cpu_qmatmul.dequantize_rows(packed, 1, n, torch.float32))
        check_layout(packed, wd, bits, group)
        q8 = bits == 8 and group == 32 and zero in (False, "const")  # (Q8_0, Q5_0)
        if q8 or bits == 4:
            # in blocks of 16 rows (served where interleaves says; every path runs them)
            blocks = cpu_qmatmul.interleave(packed)
            assert blocks.kind == ("int8x16" if q8 else "int4x16") and blocks.rows == n
            rows = cpu_qmatmul.deinterleave(blocks)
            assert torch.equal(rows[0], packed.w)
            groups = packed.k // (group or 1)
            assert all(r.shape == (n, groups) for r in rows[1:])
            assert torch.equal(rows[1], packed.s[:, :groups])
            if not q8:  # (int4: zero points stored, zc where one serves all)
                z = packed.z if packed.z is not None else torch.full_like(rows[2], packed.zc)
                assert torch.equal(rows[2], z[:, :groups])
            check_layout(blocks, wd, bits, group)


def check_layout(
    packed: cpu_qmatmul.Packed, wd: torch.Tensor, bits: int, group: int | None
) -> None:
    """``packed`` (of the dequantized weight ``wd``) against the reference at each of ``ROWS``,
    in both dtypes; its dequantized rows and its large batches' GEMM."""
    n, k = wd.shape
    for m in ROWS:
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(m, k) * torch.rand(m, 1) * 4).to(dtype)
            y = cpu_qmatmul.matmul(x, packed)
            assert y.dtype == dtype and y.shape == (m, n)
            ref = x.float() @ wd.t()
            tol = cpu_qmatmul.error_bound(x.float(), wd, bits, group)
            if dtype == torch.bfloat16:
                tol = tol + ref.abs() * 2**-8
            err = (y.float() - ref).abs()
            assert bool((err <= tol).all()), (bits, group, n, k, m, dtype, (err - tol).max())
    # large batches: the weight dequantized (QuantLinear.dequantize's values) into a GEMM
    wq = cpu_qmatmul.dequantize_rows(packed, 0, n, torch.float32)[:, :k]
    assert torch.equal(wq, wd), (bits, group, n, k)
    wb = cpu_qmatmul.dequantize_rows(packed, 1, n, torch.bfloat16)[:, :k]
    assert torch.equal(wb, wd[1:].bfloat16())
    x = torch.randn(70, k)
    y = cpu_qmatmul.matmul_dequantized(x, packed)
    ref = x @ wq.t()
    assert bool(((y - ref).abs() <= 1e-5 * (x.abs() @ wq.abs().t()) + 1e-6).all())
    yb = cpu_qmatmul.matmul_dequantized(x.bfloat16(), packed)
    assert yb.dtype == torch.bfloat16
    bound = 2**-7 * (x.abs() @ wq.abs().t()) + ref.abs() * 2**-7 + 1e-3
    assert bool(((yb.float() - ref).abs() <= bound).all())


def check_path_avx512() -> None:
    assert cpu_qmatmul.path() == "avx512"
    check_kernels()


def check_path_avx2() -> None:
    assert cpu_qmatmul.path() == "avx2"
    check_kernels()
    test_quantized_activations_are_needed_for_the_bound()
    for m in (1, 3, 5):  # x really rounded, per block of 128
        test_vnni_rounds_x_per_block_of_128(8, None, 200, m)
        test_vnni_rounds_x_per_block_of_128(4, 256, 512, m)
        test_vnni_int6_is_x_rounded_per_128_times_the_weight(768, m)
    from tests.quant.test_gguf_quantized import test_vnni_grouped_int8_is_the_q8_0_dot

    test_vnni_grouped_int8_is_the_q8_0_dot(5)
    # batch 1's strips of 8 rows (reduce8) against the batches' tiles (hsum8), bit for bit
    test_a_row_does_not_depend_on_its_batch()
    test_a_row_does_not_depend_on_the_threads()


def check_path_portable() -> None:
    assert cpu_qmatmul.path() == "portable"
    check_kernels()


def test_kernels_match_dequantized_matmul_on_this_cpu() -> None:
    check_kernels()


def check_path_vnni_without_amx() -> None:
    assert cpu_qmatmul.path() == "vnni"
    for bits, group in ((8, None), (4, 128), (8, 32), (4, 32)):
        assert cpu_qmatmul.amx_rows(bits, group) == 0
    check_kernels()
    test_a_row_does_not_depend_on_its_batch()


def test_amx_is_taken_where_the_cpu_has_it() -> None:
    """A CPU with AMX's int8 tiles (and a build for it) runs int8 per channel, int4 g128 and
    int8 and int4 in groups of 32 on them unless told not to: else the AMX tests would skip
    there and pass without the tiles."""
    if "amx" not in cpu_paths() or native_paths() != cpu_paths():
        pytest.skip("no AMX tiles in this build")
    if os.environ.get("FOUDRE_AMX", "1").startswith("0"):
        assert cpu_qmatmul.amx_rows(8) == 0
    else:  # (0: the compiler defined no __AMX_INT8__, or Linux (before 5.16) refused the tiles)
        rows = tuple(cpu_qmatmul.amx_rows(b, g) for b, g in ((8, None), (4, 128), (8, 32), (4, 32)))
        assert rows == (4, 8, 6, 12), f"AMX on this CPU not taken: amx_rows {rows}"


def test_the_vnni_kernel_beneath_amx() -> None:
    """Where int8 per channel, int4 g128+ and int8 and int4 g32 run on AMX's tiles from
    ``amx_rows`` rows, the VNNI kernel that they replace there (``FOUDRE_AMX=0``, in a fresh
    process: the library asks once)."""
    if cpu_qmatmul.amx_rows(8) == 0:
        pytest.skip("no AMX tiles here: this build's own tests run the VNNI kernel")
    env = dict(os.environ, FOUDRE_AMX="0")
    run_check("tests.quant.test_cpu_qmatmul:check_path_vnni_without_amx", env)


def test_the_march_checks_know_this_build() -> None:
    """``run_built_for`` skips a -march whose code paths this CPU's own build takes (its model of
    the sources' #if's from the CPU's flags): it names the path this library says it built."""
    paths = native_paths()
    if paths is None:
        pytest.skip("built for a -march the tests do not model")
    built = (
        "vnni"
        if "avx512vnni" in paths
        else "avx512"
        if "avx512" in paths
        else "avx2"
        if "avx2" in paths
        else "portable"
    )
    assert cpu_qmatmul.path() == built


def test_the_march_checks_model_every_feature_the_sources_test() -> None:
    """The feature macros of the kernels' #if's are the ones ``native_paths`` models: a source
    choosing a path on another (AVX-VNNI, AMX, ...) would let a host skip checks of a path that
    its own build does not take."""
    root = Path(cpu_qmatmul.__file__).resolve().parents[1]
    tested = set()
    for source in [*root.rglob("*.cpp"), *root.rglob("*.h")]:
        for line in source.read_text().splitlines():
            if re.match(r"\s*#\s*(if|elif)", line):
                tested |= set(re.findall(r"__([A-Z0-9_]+)__", line))
    assert "AVX2" in tested and tested - {"GNUC", "clang"} <= MODELED_MACROS, tested


@pytest.mark.parametrize(
    "march,check", [("skylake-avx512", "avx512"), ("haswell", "avx2"), ("x86-64", "portable")]
)
def test_other_paths_match(march: str, check: str, march_cache: Callable[[str], Path]) -> None:
    """The AVX-512 float path (no VNNI), the AVX2 one and the portable one, built for another
    -march (where this build is not already that path: its own tests run it)."""
    run_built_for(
        march, f"tests.quant.test_cpu_qmatmul:check_path_{check}", "cpu_qmatmul", march_cache
    )


def test_quantized_activations_are_needed_for_the_bound() -> None:
    """The VNNI bound is not vacuous: the float-path bound fails where x is rounded to int8."""
    if not cpu_qmatmul.rounds_activations():
        pytest.skip("this build multiplies in float32")
    torch.manual_seed(5)
    mod = QuantLinear.from_float(torch.randn(64, 512), None, 8)
    x = torch.randn(4, 512)
    y = cpu_qmatmul.matmul(x, cpu_qmatmul.layout(mod.qweight, mod.scales, None, None))
    ref = x @ mod.dequantize().t()
    float_bound = 1e-5 * (x.abs() @ mod.dequantize().abs().t()) + 1e-6
    assert bool(((y - ref).abs() > float_bound).any())
    assert bool(((y - ref).abs() <= cpu_qmatmul.error_bound(x, mod.dequantize())).all())


@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize(
    "bits,group,k", [(8, None, 384), (8, None, 200), (8, None, 192), (4, 128, 384), (4, 256, 512)]
)
def test_vnni_rounds_x_per_block_of_128(bits: int, group: int | None, k: int, m: int) -> None:
    """On the VNNI path per-channel int8, and int4 in groups of 128 or more, are the product of
    x rounded per block of 128 columns (``round_like_kernel``) with the dequantized weight, to
    float32 summation order (terms of ``(|q| + |z|) s``, int8's codes offset by 128 and the
    offset taken off at the end); the rounding is really there, and blocks of 32 would round
    differently."""
    if not cpu_qmatmul.rounds_activations():
        pytest.skip("this build multiplies in float32")
    assert cpu_qmatmul.activation_block(bits, group) == 128
    torch.manual_seed(k + bits)
    mod = QuantLinear.from_float(torch.randn(40, k) * 0.1, None, bits, group)
    x = torch.randn(m, k) * torch.linspace(0.1, 4, k)  # blocks of different ranges
    packed = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, group, bits)
    y = cpu_qmatmul.matmul(x, packed).double()
    wd = mod.dequantize().double()
    xr = cpu_qmatmul.round_like_kernel(x, bits, group).double()
    q = (mod.qweight if bits == 8 else unpack_int4(mod.qweight)).double()[:, :k]
    s = mod.scales.double()
    s = s[:, None] if group is None else s.repeat_interleave(group, 1)[:, :k]
    z = 0 if mod.zeros is None else mod.zeros.double().repeat_interleave(group, 1)[:, :k]
    terms = (q.abs() + z + (256 if bits == 8 else 0)) * s.abs()
    tight = 1e-5 * (xr.abs() @ terms.t()) + 1e-6
    assert bool(((y - xr @ wd.t()).abs() <= tight).all())
    for smaller in ((8, 32), (4, 32)):  # blocks of 32 and 64 columns
        other = cpu_qmatmul.round_like_kernel(x, *smaller).double() @ wd.t()
        assert float((y - other).abs().max()) > 4 * float(tight.max())


@pytest.mark.parametrize("m", [1, 3, 5])
@pytest.mark.parametrize("k", [256, 768])
def test_vnni_int6_is_x_rounded_per_128_times_the_weight(k: int, m: int) -> None:
    """On the VNNI path a 6-bit weight's product is x rounded per block of 128 columns
    (``round_like_kernel``) times the dequantized weight, to float32 summation order: each
    lane's sum is exact in int32 (codes, their offset 32 and the sub-scale), then scaled by
    x's d and the weight's; the rounding is really there, and blocks of 32 would round
    differently."""
    if not cpu_qmatmul.rounds_activations():
        pytest.skip("this build multiplies in float32")
    torch.manual_seed(k + m)
    mod = QuantLinear.from_float(torch.randn(40, k) * 0.1, None, 6, 16)
    x = torch.randn(m, k) * torch.linspace(0.1, 4, k)
    y = cpu_qmatmul.matmul(x, cpu_qmatmul.layout(mod.qweight, mod.scales, None, 16, 6)).double()
    wd = mod.dequantize().double()
    xr = cpu_qmatmul.round_like_kernel(x, 6, 16).double()
    tight = 1e-6 * (xr.abs() @ wd.abs().t()) + 1e-6
    assert bool(((y - xr @ wd.t()).abs() <= tight).all())
    other = cpu_qmatmul.round_like_kernel(x, 8, 32).double() @ wd.t()
    assert float((y - other).abs().max()) > 4 * float(tight.max())


def test_int6_packing() -> None:
    """``pack_int6`` round-trips codes and sub-scales; ``quantize_int6`` keeps each weight
    within half its sub-block's step; a weight off 256 columns, or another group, is refused."""
    torch.manual_seed(3)
    q = torch.randint(0, 64, (5, 512), dtype=torch.uint8)
    subs = torch.randint(-128, 128, (5, 32), dtype=torch.int8)
    packed = pack_int6(q, subs)
    assert packed.shape == (5, 416)
    got_q, got_subs = unpack_int6(packed)
    assert torch.equal(got_q, q) and torch.equal(got_subs, subs)
    w = torch.randn(7, 300) * torch.linspace(0.01, 1, 300)
    codes, sc, d = quantize_int6(w)
    assert codes.shape == (7, 512) and sc.shape == (7, 32) and d.shape == (7, 2)
    step = (d.repeat_interleave(16, 1) * sc.float()).repeat_interleave(16, 1)
    mod = QuantLinear.from_float(w, None, 6, 16)
    assert bool(((mod.dequantize() - w).abs() <= step[:, :300] / 2 + 1e-7).all())
    with pytest.raises(ValueError, match="6-bit codes"):
        pack_int6(q[:, :384], subs[:, :24])
    with pytest.raises(ValueError, match="group_size"):
        QuantLinear(256, 8, 6, 32)
    with pytest.raises(ValueError, match="sub_scales"):  # 6-bit codes without, 4-bit with
        QuantLinear.from_codes(q, d, None, None, 6, 16, 512)
    with pytest.raises(ValueError, match="sub_scales"):
        QuantLinear.from_codes(q & 15, d, d, None, 4, 256, 512, sub_scales=subs)
    bad = dataclasses.replace(cpu_qmatmul.layout(mod.qweight, mod.scales, None, 16, 6), k=256)
    with pytest.raises(ValueError, match="int6 rows"):
        cpu_qmatmul.matmul(torch.randn(1, 256), bad)


def test_bad_input_is_refused() -> None:
    mod = QuantLinear.from_float(torch.randn(8, 64), None, 8)
    packed = cpu_qmatmul.layout(mod.qweight, mod.scales, None, None)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_qmatmul.matmul(torch.randn(2, 64, dtype=torch.float64), packed)
    with pytest.raises(ValueError, match="columns"):
        cpu_qmatmul.matmul(torch.randn(2, packed.k + 1), packed)
    # a layout not made by layout(): K off the kernels' steps, or more than the codes hold
    for k in (packed.k - 32, packed.k + 64):
        with pytest.raises(ValueError, match="multiple of 64"):
            cpu_qmatmul.matmul(torch.randn(2, 32), dataclasses.replace(packed, k=k))


def test_blocks_refuse_what_they_cannot_hold() -> None:
    """``interleave`` refuses the layouts with no form in blocks of 16 rows (int8 per channel,
    in groups of 64, with zero points per group or one that is not an integer; int4 whose
    groups do not divide K), naming the layout; the kernels refuse blocks that are not as
    ``interleave`` lays them out (their shape, rows, group, dtype, contiguity)."""
    torch.manual_seed(2)
    w = torch.randn(20, 300)
    refused = [(8, None, False), (8, 64, False), (8, 32, True), (8, 32, "half"), (4, 256, True)]
    for bits, group, zero in refused:
        mod = quant_module(bits, group, zero, w)
        packed = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, group, bits)
        if bits == 4:  # (K 512 in groups of 256: 384 columns, as a file's could be)
            packed = dataclasses.replace(packed, k=384, w=packed.w[:, :192].contiguous())
        with pytest.raises(ValueError, match="interleave takes") as info:
            cpu_qmatmul.interleave(packed)
        assert packed.kind in str(info.value), (bits, group, zero)
    for bits, group, zero in ((8, 32, False), (4, 128, True), (4, 32, "const")):
        mod = quant_module(bits, group, zero, w)
        blocks = cpu_qmatmul.interleave(
            cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, group, bits)
        )
        x = torch.randn(2, 300)
        cpu_qmatmul.matmul(x, blocks)  # as laid out: taken
        wide = torch.zeros(blocks.w.shape[0], 2 * blocks.w.shape[1], dtype=torch.uint8)
        wrong = {
            "rows": dataclasses.replace(blocks, n=blocks.rows + 16),
            "group": dataclasses.replace(blocks, group=64 if bits == 8 else 16),
            "k": dataclasses.replace(blocks, k=blocks.k + 128),
            "dtype": dataclasses.replace(blocks, w=blocks.w.view(torch.int8)),
            "strides": dataclasses.replace(blocks, w=wide[:, ::2]),
            "zero points": dataclasses.replace(
                blocks, z=None if blocks.z is not None else torch.ones(1)
            ),
        }
        for what, bad in wrong.items():
            with pytest.raises(ValueError, match=f"{blocks.kind} blocks"):
                cpu_qmatmul.matmul(x, bad)
                pytest.fail(f"{blocks.kind} blocks with other {what} taken")


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32), (4, 64), (4, 128), (6, 16)])
@pytest.mark.parametrize("m", [1, 3, 16, 48, 64])
def test_quant_linear_matches_reference(
    bits: int, group: int | None, m: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``QuantLinear`` (ours up to 32 rows, aten's at 48, our dequantized GEMM from 64 (on AMX's
    tiles int8 and int4 g128 leave ours at 1024, int4 g32 at 128, int4 g64's blocks at 256:
    aten's from 33); 6 bits ours below 64) against
    ``forward_reference``, with bias, input scale and an act-order permutation; switched off, 6 bits
    run the reference itself (aten has no kernel for them)."""
    monkeypatch.setitem(NATIVE_MAX_ROWS, bits, 32)
    torch.manual_seed(m + bits)
    k, n = 200, 45
    w = torch.randn(n, k) * 0.1
    perm = torch.randperm(k)
    scale = torch.rand(k) + 0.5
    q = QuantLinear.from_float(w, torch.randn(n), bits, group)
    if bits == 6:
        codes, subs = unpack_int6(q.qweight)
        mod = QuantLinear.from_codes(codes, q.scales, None, q.bias, 6, 16, k, input_scale=scale,
                                     perm=perm, sub_scales=subs)  # fmt: skip
    else:
        mod = QuantLinear.from_codes(
            *(q.qweight, q.scales) if bits == 8 else (unpack_int4(q.qweight), q.scales),
            q.zeros, q.bias, bits, group, k, input_scale=scale, perm=perm,
        )  # fmt: skip
    x = torch.randn(2, m, k)
    y, ref = mod(x), mod.forward_reference(x)
    assert y.shape == (2, m, n)
    xp = mod._prepare_input(x).reshape(-1, k)
    tol = cpu_qmatmul.error_bound(xp, mod.dequantize(), bits, group).reshape(2, m, n) + 1e-5
    assert bool(((y - ref).abs() <= tol).all())
    if bits == 6:  # switched off: the reference itself, not the kernel (which rounds x on VNNI)
        # (2 m rows from dequantized_gemm_rows on run the dequantized GEMM, which need not differ)
        integer = 2 * m < qlinear.dequantized_gemm_rows(6, 16)
        assert not (integer and cpu_qmatmul.rounds_activations()) or not torch.equal(y, ref)
        monkeypatch.setenv("FOUDRE_NATIVE_QMATMUL", "0")
        assert torch.equal(mod(x), ref)


def test_a_row_does_not_depend_on_its_batch() -> None:
    """Each row's result is the same bit for bit alone as in any batch (its quantization, sums
    and their order are its own), so an engine's output does not depend on the other requests;
    where a layout runs on AMX's tiles from ``amx_rows`` rows (at batch 1 the VNNI kernel is
    faster), within the batches on each side of that (the tiles round their sums differently),
    as within those below the dequantized GEMM's rows."""
    torch.manual_seed(7)
    # (one zero point, Q8_0's none and Q4_0's 8, and 6 bits: the offsets in the lanes' sums;
    # int4 g32 with zero points: 10 groups, a vector of 8 and two past it, in the AVX2 tiles)
    # (batch 1 sums 16 weight rows at a time (VNNI) or 8 (AVX2), reduced together, a batch
    # each row alone: 70 rows, strips and a last 6 rows on their own)
    for bits, group, zero in ((8, None, False), (4, 64, True), (4, 128, True), (8, 32, False),
                              (4, 32, "const"), (4, 32, True), (6, 16, False)):  # fmt: skip
        mod = quant_module(bits, group, zero, torch.randn(70, 300))
        packed = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, mod.group_size, bits)
        # (int8 per channel, int4 g128+, int8 and int4 g32 on AMX's tiles from amx_rows() rows:
        # the same bits among batches from there, and among batches below them, the VNNI kernel's)
        amx = cpu_qmatmul.amx_rows(bits, group)
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(37, 300).to(dtype)
            batch = cpu_qmatmul.matmul(x, packed)
            for i in (0, 5, 36):
                alone = cpu_qmatmul.matmul(x[i : i + 1], packed)
                few = min(3, amx - 1) if amx else 3
                assert torch.equal(cpu_qmatmul.matmul(x[i : i + few], packed)[0], alone[0])
                if amx:
                    lo = min(i, 37 - amx)
                    tiles = cpu_qmatmul.matmul(x[lo : lo + amx], packed)
                    assert torch.equal(tiles[i - lo], batch[i])
                    if dtype == torch.float32:  # (the tiles ran: another rounding)
                        assert not torch.equal(alone[0], batch[i])
                else:
                    assert torch.equal(alone, batch[i : i + 1])


def test_interleaved_rows_do_not_depend_on_batch_or_threads() -> None:
    """Q8_0, Q5_0 and int4 (Q4_0's form too) in blocks of 16 rows (``interleave``): a row's
    result is the same bits alone as in a batch of any size, on either side of ``amx_rows`` too
    (the VNNI kernel and AMX's tiles form the same int32 sums and scale them in one order), and
    on 1 or 3 threads."""
    torch.manual_seed(13)
    threads = torch.get_num_threads()
    try:
        cases = ((8, 32, False), (8, 32, "const"), (4, 128, True), (4, 32, "const"), (4, 64, True),
                 (4, 256, True))  # fmt: skip
        for bits, group, zero in cases:
            mod = quant_module(bits, group, zero, torch.randn(70, 300))  # (300: 512 for g256)
            packed = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, group, bits)
            blocks = cpu_qmatmul.interleave(packed)
            for dtype in (torch.bfloat16, torch.float32):
                x = torch.randn(37, 300).to(dtype)
                batch = cpu_qmatmul.matmul(x, blocks)
                for i in (0, 5, 36):
                    for few in (1, 2, 3, 5, 6, 7, 17):
                        lo = min(i, 37 - few)
                        part = cpu_qmatmul.matmul(x[lo : lo + few], blocks)
                        assert torch.equal(part[i - lo], batch[i]), (bits, zero, dtype, i, few)
                for n in (1, 3):
                    torch.set_num_threads(n)
                    for m in (1, 37):
                        assert torch.equal(cpu_qmatmul.matmul(x[:m], blocks), batch[:m])
                torch.set_num_threads(threads)
    finally:
        torch.set_num_threads(threads)


def test_modules_interleave_once_built(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``QuantLinear`` of Q8_0's form (and Q5_0's, one zero point), or of int4 (Q4_0's form
    too), becomes blocks of 16 rows when its layout is built on the VNNI path: the same values
    (``dequantize``), its products within the kernels' bound, its ``state_dict`` the rows, which
    ``load_state_dict`` and a move (``_apply``) give back to the buffers; ``FOUDRE_REPACK=0``
    keeps the rows."""
    if cpu_qmatmul.path() != "vnni":
        pytest.skip("blocks of 16 rows are built on the VNNI path only")
    torch.manual_seed(5)
    # (280: 288 columns, the Q5_0 blocks 320; int4: 300 columns, 384, zero points stored, or
    # Q4_0's one 8)
    cases = ((8, 32, False, 300), (8, 32, "const", 280), (4, 128, True, 300), (4, 32, "const", 300))
    for bits, group, zero, k in cases:
        mod = quant_module(bits, group, zero, torch.randn(40, k)).to(torch.float16)
        rows = {name: t.clone() for name, t in mod.state_dict().items()}
        wd = mod.dequantize()
        assert not mod.interleaved
        mod._native_layout()
        assert mod.interleaved and mod.qweight.dtype == torch.uint8
        assert mod.scales.numel() == 0 and mod.scales.dtype == torch.float16
        assert mod._native_layout().kind == ("int8x16" if bits == 8 else "int4x16")
        assert torch.equal(mod.dequantize(), wd)
        x = torch.randn(5, k)
        tol = cpu_qmatmul.error_bound(x, wd, bits, group) + 1e-5
        assert bool(((mod(x) - x @ wd.t()).abs() <= tol).all())
        saved = mod.state_dict()
        assert saved.keys() == rows.keys()
        assert all(torch.equal(saved[name], rows[name]) for name in rows), (bits, zero)
        other = quant_module(bits, group, zero, torch.randn(40, k)).to(torch.float16)
        other._native_layout()
        other.load_state_dict(rows)
        assert not other.interleaved and torch.equal(other.dequantize(), wd)
        mod.float()  # a move: rows again (float32 scales now)
        assert not mod.interleaved and torch.equal(mod.qweight, rows["qweight"])
        assert torch.equal(mod.dequantize(), wd)
        if bits == 4:  # aten's kernels (float16 x, or too many rows) from the rows again
            mod._native_layout()
            before = mod(x.half())
            assert mod.interleaved and before.dtype == torch.float16
            assert bool(((before.float() - x @ wd.t()).abs() <= 2 * tol + 1e-2).all())
    monkeypatch.setenv("FOUDRE_REPACK", "0")
    mod = quant_module(8, 32, False, torch.randn(40, 300))
    assert mod._native_layout().kind == "int8g" and not mod.interleaved


def test_interleaved_rows_keep_their_dtypes() -> None:
    """Blocks of 16 rows give back the module's rows as they were: float16 scales beside float32
    zero points (which the layout casts to float32 together), and a zero point of one value not
    held in the blocks (zc) exactly, not rounded through the scales' dtype."""
    if cpu_qmatmul.path() != "vnni":
        pytest.skip("blocks of 16 rows are built on the VNNI path only")
    torch.manual_seed(1)
    q, s, z = quantize_int4(torch.randn(40, 256), 32)
    for zeros in (torch.full_like(s, 7.3), z + 0.3):  # (one value: zc; several: stored)
        mod = QuantLinear.from_codes(q, s.half(), zeros, None, 4, 32, 256, scale_dtype=torch.half)
        mod._buffers["zeros"] = zeros.float()  # (wider than the scales)
        rows = {name: t.clone() for name, t in mod.state_dict().items()}
        mod._native_layout()
        assert mod.interleaved
        saved = mod.state_dict()
        assert all(saved[n].dtype == t.dtype and torch.equal(saved[n], t) for n, t in rows.items())
        mod._restore()
        assert torch.equal(mod.scales, rows["scales"]) and mod.scales.dtype == torch.half
        assert torch.equal(mod.zeros, rows["zeros"]) and mod.zeros.dtype == torch.float32


def test_a_row_does_not_depend_on_the_threads() -> None:
    """The tasks are handed out guided (any thread may take any rows) and batch 1 takes strips
    (16 rows on the VNNI path, 8 on the AVX2 one) only where there are as many strips as
    threads (else one row a task): each row's result is the same bits on 1, 2 and 3 threads, at
    batch 1 (40 rows: VNNI strips on up to two threads, one row a task on three; AVX2's five
    strips on all three), 3 and 37, for every kind (the scales prefetched ahead up to the last
    row)."""
    torch.manual_seed(11)
    threads = torch.get_num_threads()
    cases = ((8, None, False), (4, 128, True), (4, 32, "const"), (8, 32, True), (6, 16, False))
    try:
        for bits, group, zero in cases:
            mod = quant_module(bits, group, zero, torch.randn(40, 384))
            packed = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, mod.group_size, bits)
            for m in (1, 3, 37):
                x = torch.randn(m, 384, dtype=torch.bfloat16)
                results = []
                for n in (1, 2, 3):
                    torch.set_num_threads(n)
                    results.append(cpu_qmatmul.matmul(x, packed))
                assert all(torch.equal(r, results[0]) for r in results), (bits, group, m)
    finally:
        torch.set_num_threads(threads)


def test_switched_off_runs_aten(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FOUDRE_NATIVE_QMATMUL", "0")
    assert not uses_native_kernels(torch.float32)
    mod = QuantLinear.from_float(torch.randn(16, 64), None, 8)
    x = torch.randn(1, 64)
    assert torch.allclose(mod(x), mod.forward_reference(x), atol=1e-4)


def test_paired_scales_change_no_result() -> None:
    """``pair_scales`` puts a row's scales and zero points side by side in one buffer (one
    stream for the kernels): the products, the dequantized rows and the module's values are
    the same bit for bit (K = 384: no padding, which copies); a layout with one zero point
    (none read) is left as it is."""
    torch.manual_seed(3)
    for bits, group in ((4, 32), (4, 128), (8, 32)):
        mod = quant_module(bits, group, True, torch.randn(37, 384) * 0.1).to(torch.bfloat16)
        assert mod.zeros is not None
        scales, zeros = cpu_qmatmul.pair_scales(mod.scales, mod.zeros)
        assert zeros is not None
        assert scales.untyped_storage().data_ptr() == zeros.untyped_storage().data_ptr()
        assert scales.stride(0) == 2 * scales.shape[1]
        assert torch.equal(scales, mod.scales) and torch.equal(zeros, mod.zeros)
        apart = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, group, bits)
        paired = cpu_qmatmul.layout(mod.qweight, scales, zeros, group, bits)
        assert paired.s.data_ptr() == scales.data_ptr()  # read in place, not copied
        for m in (1, 3, 16):
            x = torch.randn(m, 384).bfloat16()
            assert torch.equal(cpu_qmatmul.matmul(x, paired), cpu_qmatmul.matmul(x, apart))
        for dtype in (torch.float32, torch.bfloat16):
            got = cpu_qmatmul.dequantize_rows(paired, 2, 30, dtype)
            assert torch.equal(got, cpu_qmatmul.dequantize_rows(apart, 2, 30, dtype))
        # QuantLinear pairs its own buffers when it first builds the layout (in inference mode
        # too: the buffers stay writable)
        before = mod.dequantize()
        x = torch.randn(2, 384).bfloat16()
        with torch.inference_mode():
            mod._native_layout()
        assert mod.scales.untyped_storage().data_ptr() == mod.zeros.untyped_storage().data_ptr()
        assert torch.equal(mod.dequantize(), before)
        mod.scales.mul_(1)  # not an inference tensor
        if uses_native_kernels(torch.bfloat16):
            assert torch.equal(mod(x), cpu_qmatmul.matmul(x, apart))
    const = quant_module(4, 32, "const", torch.randn(5, 128))
    same = cpu_qmatmul.pair_scales(const.scales, const.zeros)
    assert same[0] is const.scales and same[1] is const.zeros
    # a layout whose zero points do not share the scales' row stride is refused
    own = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, 32, 8)  # the module's, paired
    assert own.z is not None and own.z.stride() == own.s.stride() != own.z.contiguous().stride()
    odd = dataclasses.replace(own, z=own.z.contiguous())
    with pytest.raises(ValueError, match="row stride"):
        cpu_qmatmul.matmul(torch.randn(1, 384), odd)


def test_the_avx2_path_hands_each_layout_its_own_gemm_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the AVX2 path each layout leaves the integer kernel at its own measured crossing
    (``qlinear.AVX2_GEMM_ROWS``): group-wise 8 bits in groups of 16, whose steps scale two
    groups a step, well before those of 32 or more; elsewhere the shared rows apply."""
    rows = qlinear.AVX2_GEMM_ROWS
    monkeypatch.setattr(cpu_qmatmul, "amx_rows", lambda bits, group, blocks=False: 0)
    monkeypatch.setattr(cpu_qmatmul, "path", lambda: "avx2")
    layouts = {
        (8, None): "wide", (4, 128): "wide", (4, 256): "wide", (4, 32): "int4", (4, 64): "int4",
        (8, 32): "grouped8", (8, 128): "grouped8", (8, 16): "grouped8_16",
    }  # fmt: skip
    for (bits, group), key in layouts.items():
        assert qlinear.dequantized_gemm_rows(bits, group) == rows[key], (bits, group)
    assert rows["grouped8_16"] < rows["grouped8"]
    monkeypatch.setattr(cpu_qmatmul, "path", lambda: "vnni")
    assert qlinear.dequantized_gemm_rows(8, 16) == qlinear.GROUPED8_GEMM_ROWS
    assert qlinear.dequantized_gemm_rows(4, 32) == qlinear.DEQUANTIZED_GEMM_ROWS
    assert qlinear.dequantized_gemm_rows(8, None) == qlinear.DEQUANTIZED_GEMM_ROWS
    # the layouts on AMX's tiles: up to AMX_GEMM_ROWS (groups of 32 AMX_GROUPS32_GEMM_ROWS;
    # int4 in groups of 64 in blocks of 16 rows AMX_BLOCKS64_GEMM_ROWS), the others as before
    amx = {(8, None), (4, 128), (8, 32), (4, 32)}

    def amx_rows(bits: int, group: int | None, blocks: bool = False) -> int:
        return 4 * ((bits, group) in amx or (blocks and (bits, group) == (4, 64)))

    monkeypatch.setattr(cpu_qmatmul, "amx_rows", amx_rows)
    assert qlinear.dequantized_gemm_rows(4, 64) == qlinear.AMX_BLOCKS64_GEMM_ROWS
    monkeypatch.setenv("FOUDRE_REPACK", "0")  # (rows: no tiles for groups of 64)
    assert qlinear.dequantized_gemm_rows(8, None) == qlinear.AMX_GEMM_ROWS
    assert qlinear.dequantized_gemm_rows(4, 128) == qlinear.AMX_GEMM_ROWS
    assert qlinear.dequantized_gemm_rows(8, 32) == qlinear.AMX_GROUPS32_GEMM_ROWS[8]
    assert qlinear.dequantized_gemm_rows(4, 32) == qlinear.AMX_GROUPS32_GEMM_ROWS[4]
    assert qlinear.dequantized_gemm_rows(8, 16) == qlinear.GROUPED8_GEMM_ROWS
    assert qlinear.dequantized_gemm_rows(4, 64) == qlinear.DEQUANTIZED_GEMM_ROWS
    # and where each is: int8 per channel, int4 in groups of 128 or more, int8 and int4 in
    # groups of 32 (their blocks too, and int4's in groups of 64), or none
    monkeypatch.undo()
    if cpu_qmatmul.amx_rows(8):
        assert cpu_qmatmul.amx_rows(4, 128) and cpu_qmatmul.amx_rows(4, 256)
        assert cpu_qmatmul.amx_rows(8, 32) and cpu_qmatmul.amx_rows(4, 32)
        assert all(cpu_qmatmul.amx_rows(4, g, blocks=True) for g in (32, 64, 128, 256))
        assert cpu_qmatmul.amx_rows(8, 32, blocks=True)
    assert cpu_qmatmul.amx_rows(8, 16) == cpu_qmatmul.amx_rows(8, 64) == 0
    assert cpu_qmatmul.amx_rows(4, 64) == 0
