"""MXFP4 weights kept packed (``foudre.quant.mxfp4``): the reference dequantizer against
transformers' (``convert_moe_packed_tensors``), the quantizer and the GGUF reader against the
gguf package's own MXFP4 quantizer and dequantizer, the native CPU kernel (each ISA path: this
build in-process, the others built for another ``-march`` in a subprocess) and the Triton kernels
(``TRITON_INTERPRET=1``) against dequantize-then-matmul in float64, and ``MXFP4Experts`` against
transformers' gpt-oss experts holding the dequantized weights.

Tolerance: the kernels sum float32 products of exact values (every MXFP4 value and every
bfloat16 x is exact in float32), so they differ from the float64 product by summation order
(``1e-5 sum |x| |w|``); bfloat16 outputs add their rounding (``2^-8 |y|``, and the bias's)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from foudre.quant import mxfp4
from foudre.quant.mxfp4 import (
    MXFP4Experts,
    dequantize_mxfp4,
    from_gguf,
    mxfp4_matmul,
    native_matmul,
    quantize_mxfp4,
    to_gguf,
)
from tests.conftest import make_hf_model
from tests.engine.march import run_built_for
from tests.triton_check import run_triton_check


def random_layout(*shape: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks ``[*shape, 16]`` (every code) and scales ``[*shape]`` near 2^0."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*shape, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(120, 132, shape, generator=g, dtype=torch.uint8)
    return blocks, scales


def bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
    """The float64 reference ``x @ w.T + bias`` and the bound on a kernel's distance to it."""
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.t()
    b = torch.zeros(w.shape[0], dtype=torch.float64) if bias is None else bias.double()
    tol = 1e-5 * (x64.abs() @ w64.abs().t()) + 1e-6
    if dtype == torch.bfloat16:
        tol = tol + 2.0**-7 * ((ref + b).abs() + b.abs())
    return ref + b, tol


def check_product(fn: Callable[..., torch.Tensor], ms: tuple[int, ...] = (1, 7, 64)) -> None:
    """``fn(x, blocks, scales, bias)`` against dequantize-then-matmul: N odd, K 32 mod 64,
    M rows each of ``ms``, float32 and bfloat16 x, with and without a bias."""
    n, k = 37, 160
    blocks, scales = random_layout(n, k // 32, seed=1)
    w = dequantize_mxfp4(blocks, scales, torch.float64)
    for m in ms:
        for dtype in (torch.float32, torch.bfloat16):
            for bias in (None, torch.randn(n)):
                x = torch.randn(m, k).to(dtype)
                y = fn(x, blocks, scales, bias)
                assert y.dtype == dtype and y.shape == (m, n)
                ref, tol = bound(x, w, bias, dtype)
                err = (y.double() - ref).abs()
                assert bool((err <= tol).all()), (m, dtype, bias is None, float(err.max()))


def _check_path(name: str) -> None:
    assert mxfp4.path() == name, mxfp4.path()
    check_product(mxfp4.native_matmul)
    check_product(mxfp4.dequantized_matmul, ms=(1, 40))
    blocks, scales = random_layout(5, 7, seed=3)
    for dtype in (torch.float32, torch.bfloat16):
        rows = mxfp4.dequantize_rows(blocks, scales, 1, 4, dtype)
        assert torch.equal(rows, dequantize_mxfp4(blocks[1:4], scales[1:4], dtype))


def check_path_avx512() -> None:
    _check_path("avx512")


def check_path_avx2() -> None:
    _check_path("avx2")


def check_path_portable() -> None:
    _check_path("portable")


native = pytest.mark.skipif(mxfp4.path() is None, reason="no C++ compiler")


# ----------------------------------------------------------------------------- reference


def test_dequantize_matches_transformers() -> None:
    """Every code, scales around 2^0, stacked experts: transformers' gpt-oss dequantizer gives
    the same values (it returns ``[E, K, N]``)."""
    convert = pytest.importorskip("transformers.integrations.mxfp4").convert_moe_packed_tensors
    blocks, scales = random_layout(3, 40, 4)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 200  # the subnormal 2^-127, and a large scale
    ours = dequantize_mxfp4(blocks, scales)
    assert ours.shape == (3, 40, 128)
    theirs = convert(blocks, scales, dtype=torch.float32).transpose(1, 2)
    assert torch.equal(ours, theirs)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours)  # exact


def test_quantize_matches_gguf() -> None:
    """``quantize_mxfp4`` picks ggml's scale (floor(log2 max) - 2) and each value's nearest
    E2M1 multiple (random floats: no ties), as the gguf package's quantizer."""
    gguf = pytest.importorskip("gguf")
    w = torch.randn(24, 256) * torch.logspace(-3, 3, 24)[:, None]
    w[0, :32] = 0  # a block of zeros
    blocks, scales = quantize_mxfp4(w)
    raw = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType.MXFP4)
    theirs = from_gguf(raw, tuple(w.shape))
    assert torch.equal(blocks, theirs[0]) and torch.equal(scales, theirs[1])
    assert torch.equal(dequantize_mxfp4(blocks, scales)[0, :32], torch.zeros(32))


def test_quantize_rounds_ties_to_even_and_saturates() -> None:
    """Midpoints of the E2M1 grid go to the even code (OCP's round to nearest even); a block's
    values beyond 6 times its scale saturate to 6; signs kept."""
    w = torch.zeros(1, 32)
    w[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.5])  # max 7.5: scale 1
    w[0, 8:16] = -w[0, :8]
    got = dequantize_mxfp4(*quantize_mxfp4(w))[0]
    expected = torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0])
    assert torch.equal(got[:8], expected) and torch.equal(got[8:16], -expected)


def test_refuses_k_not_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 100))
    blocks, scales = random_layout(8, 3)
    with pytest.raises(ValueError, match="K = 96"):
        mxfp4_matmul(torch.randn(2, 100), blocks, scales)
    with pytest.raises(ValueError, match="scales"):
        mxfp4_matmul(torch.randn(2, 96), blocks, scales[:, :2])
    with pytest.raises(ValueError, match="hidden_size a multiple of 32"):
        MXFP4Experts(2, 100, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        from_gguf(np.zeros(17 * 4, np.uint8), (4, 48))
    # a weight elsewhere than x (here: on the meta device), or not where the kernels read
    with pytest.raises(ValueError, match="x on cpu"):
        mxfp4_matmul(torch.randn(2, 96), blocks.to("meta"), scales.to("meta"))
    with pytest.raises(ValueError, match="CPU tensors"):
        native_matmul(torch.randn(2, 96, device="meta"), blocks.to("meta"), scales.to("meta"))


def test_reference_product() -> None:
    check_product(mxfp4.mxfp4_matmul_reference, ms=(1, 7))


# ----------------------------------------------------------------------------- CPU kernel


@native
def test_native_kernel_of_this_build() -> None:
    """The path this CPU's build takes, M = 1, 7, 64, float32 and bfloat16, bias or none."""
    check_product(mxfp4.native_matmul)


@native
def test_native_dequantization_of_this_build() -> None:
    """The native dequantizer (rows of the weight, for the GEMM path) gives the reference's
    values, bit for bit, in float32 and bfloat16."""
    blocks, scales = random_layout(9, 5, seed=4)
    scales[0, 0], scales[1, 1] = 0, 255  # 2^-127 (subnormal) and +inf (NaN: 0 * inf)
    for dtype in (torch.float32, torch.bfloat16):
        rows = mxfp4.dequantize_rows(blocks, scales, 0, 9, dtype)
        ref = dequantize_mxfp4(blocks, scales, dtype)  # (0 times +inf: NaN in both)
        torch.testing.assert_close(rows, ref, rtol=0, atol=0, equal_nan=True)


@native
def test_mxfp4_matmul_dispatch() -> None:
    """``mxfp4_matmul`` on the CPU: the kernel below ``GEMM_ROWS`` rows, the weight dequantized
    a few rows at a time into torch's GEMM from there (chunks smaller than the weight)."""
    check_product(mxfp4_matmul, ms=(1, mxfp4.GEMM_ROWS - 1, mxfp4.GEMM_ROWS, 64))
    old = mxfp4.DEQUANTIZED_CHUNK_BYTES
    try:
        mxfp4.DEQUANTIZED_CHUNK_BYTES = 16 * 160 * 4  # 16 rows a chunk of the 37
        check_product(mxfp4.dequantized_matmul, ms=(40,))
    finally:
        mxfp4.DEQUANTIZED_CHUNK_BYTES = old


@native
@pytest.mark.parametrize(
    "march,check", [("skylake-avx512", "avx512"), ("haswell", "avx2"), ("x86-64", "portable")]
)
def test_other_paths_match(march: str, check: str, march_cache: Callable[[str], Path]) -> None:
    """The AVX-512, AVX2 and portable paths, each built for its -march in a fresh process."""
    run_built_for(march, f"tests.quant.test_mxfp4:check_path_{check}", "cpu_mxfp4", march_cache)


# ----------------------------------------------------------------------------- Triton

_TRITON = """
import sys, torch
from foudre.quant import mxfp4_triton as mt
from tests.quant.test_mxfp4 import bound, random_layout
from foudre.quant.mxfp4 import dequantize_mxfp4

device = torch.device(sys.argv[1])
n, k = 70, 160  # N not a multiple of the tiles, K / 2 not of BLOCK_C
blocks, scales = random_layout(n, k // 32, seed=2)
w = dequantize_mxfp4(blocks, scales, torch.float64)
cases = [  # (GEMV kernel, M, dtype, bias)
    (True, 1, torch.bfloat16, True), (True, 1, torch.float32, False),
    (True, 7, torch.bfloat16, False), (True, 7, torch.float32, True),
    (False, 1, torch.float32, True), (False, 7, torch.float16, False),
    (False, 64, torch.float32, False), (False, 64, torch.float16, True),
]
for gemv, m, dtype, with_bias in cases:
    bias = torch.randn(n) if with_bias else None
    x = torch.randn(m, k).to(dtype)
    y = mt.matmul(x.to(device), blocks.to(device), scales.to(device),
                  None if bias is None else bias.to(device), gemv=gemv).cpu()
    ref, tol = bound(x, w, bias, torch.bfloat16 if dtype != torch.float32 else dtype)
    err = (y.double() - ref).abs()
    assert y.dtype == dtype and bool((err <= tol).all()), (gemv, m, dtype, float(err.max()))
print("ok")
"""


def test_triton_kernels_interpreted() -> None:
    """The GEMV kernel (bfloat16, float32; M = 1, 7) and the tiled one (float32, float16: the
    interpreter's bfloat16 ``tl.dot`` is wrong; M = 1, 7, 64), with and without bias."""
    run_triton_check(_TRITON, "cpu", timeout=300)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_triton_kernels_on_gpu() -> None:
    run_triton_check(_TRITON, "cuda", interpret=False, timeout=300)


_TRITON_EXPERTS = """
import sys, torch
from foudre.quant import mxfp4_triton as mt
from foudre.quant.mxfp4 import MXFP4Experts

device = torch.device(sys.argv[1])
g = torch.Generator().manual_seed(7)
e, h, i = 5, 64, 96


def act(x):  # gpt-oss's clamped SwiGLU over the interleaved gate/up
    gate, up = x[:, 0::2].clamp(max=7.0), x[:, 1::2].clamp(-7.0, 7.0)
    return (up + 1) * gate * torch.sigmoid(gate * 1.702)


for bias in (True, False):
    ours = MXFP4Experts.from_float(
        torch.randn(e, 2 * i, h, generator=g) * 0.3, torch.randn(e, h, i, generator=g) * 0.3,
        torch.randn(e, 2 * i, generator=g) if bias else None,
        torch.randn(e, h, generator=g) if bias else None, activation=act,
    )
    for t, dtype in ((1, torch.float32), (9, torch.float32), (40, torch.float16)):
        x = torch.randn(t, h, generator=g)
        ids = torch.stack([torch.randperm(e, generator=g)[:3] for _ in range(t)])
        weights = torch.softmax(torch.randn(t, 3, generator=g), dim=-1)
        with torch.no_grad():
            expected = ours(x, weights, ids)  # the CPU's grouped path, float32
            on = ours.to(device=device, dtype=dtype)
            got = mt.fused_experts(
                x.to(device, dtype),
                (on.gate_up_proj_blocks, on.gate_up_proj_scales, on.gate_up_proj_bias),
                (on.down_proj_blocks, on.down_proj_scales, on.down_proj_bias),
                weights.to(device), ids.to(device), act,
            ).cpu().float()
            ours.to(device="cpu", dtype=torch.float32)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        err = float((got - expected).abs().max())
        assert err <= tol * float(expected.abs().max() + 1), (bias, t, dtype, err)
print("ok")
"""


def test_triton_fused_experts_interpreted() -> None:
    """``mxfp4_triton.fused_experts`` (``MXFP4Experts`` on CUDA: grouped kernels over the pairs
    sorted on the device) against the grouped CPU path: 1, 9 and 40 tokens, top-3 of 5, with
    and without biases, float32 and float16 (the interpreter's bfloat16 ``tl.dot`` is wrong)."""
    run_triton_check(_TRITON_EXPERTS, "cpu", timeout=300)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_triton_fused_experts_on_gpu() -> None:
    run_triton_check(_TRITON_EXPERTS, "cuda", interpret=False, timeout=300)


# ----------------------------------------------------------------------------- GGUF


def test_gguf_tensor_reads_packed() -> None:
    """A GGUF MXFP4 tensor (``gguf.quants.quantize``, stacked experts ``[E, N, K]``) read by
    ``from_gguf`` dequantizes to what ``gguf.quants.dequantize`` gives; ``to_gguf`` writes the
    same bytes back."""
    gguf = pytest.importorskip("gguf")
    qt = gguf.GGMLQuantizationType.MXFP4
    w = np.random.default_rng(0).standard_normal((3, 20, 96)).astype(np.float32)
    raw = gguf.quants.quantize(w, qt)
    assert raw.shape == (3, 20, 3 * 17)
    blocks, scales = from_gguf(raw.reshape(-1), w.shape)
    assert blocks.shape == (3, 20, 3, 16) and scales.shape == (3, 20, 3)
    theirs = torch.from_numpy(gguf.quants.dequantize(raw, qt))
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs)
    assert torch.equal(to_gguf(blocks, scales), torch.from_numpy(raw).reshape(60, -1))


def test_gguf_file_tensor_reads_packed(tmp_path: Path) -> None:
    """An MXFP4 tensor of stacked experts written into a GGUF file (``gguf.GGUFWriter``) and
    found by foudre's GGUF reader (``read_gguf``: its shape in PyTorch order, its bytes in the
    map) reads as ``from_gguf``'s docstring says into the values gguf dequantizes."""
    gguf = pytest.importorskip("gguf")
    from foudre.loading.gguf import read_gguf

    qt = gguf.GGMLQuantizationType.MXFP4
    w = np.random.default_rng(1).standard_normal((2, 6, 64)).astype(np.float32)
    raw = gguf.quants.quantize(w, qt)
    writer = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt-oss")
    writer.add_tensor("blk.0.ffn_down_exps.weight", raw, raw_dtype=qt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    f = read_gguf(tmp_path / "x.gguf")
    t = f.tensors["blk.0.ffn_down_exps.weight"]
    assert t.shape == (2, 6, 64)
    blocks, scales = from_gguf(f.data[t.offset : t.offset + t.nbytes], t.shape)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qt))
    assert torch.equal(dequantize_mxfp4(blocks, scales), expected)


# ----------------------------------------------------------------------------- experts


def _hf_gpt_oss_experts(e: int, h: int, i: int):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = transformers.GptOssConfig(
        hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=2
    )
    torch.manual_seed(0)
    hf = GptOssExperts(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.5)
    return hf


def _swiglu(alpha: float, limit: float) -> Callable[[torch.Tensor], torch.Tensor]:
    """gpt-oss's clamped SwiGLU over the interleaved gate_up (gate even columns, up odd)."""

    def act(h: torch.Tensor) -> torch.Tensor:
        gate, up = h[:, 0::2].clamp(max=limit), h[:, 1::2].clamp(-limit, limit)
        return (up + 1) * gate * torch.sigmoid(gate * alpha)

    return act


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_experts_match_transformers_gpt_oss(tokens: int) -> None:
    """``MXFP4Experts.from_float`` of transformers' gpt-oss experts (weights transposed to
    ``[out, in]``, biases, the interleaved gate/up kept) gives, for the same routing, what
    those experts give holding the dequantized weights (float32)."""
    e, h, i = 4, 64, 96
    hf = _hf_gpt_oss_experts(e, h, i)
    ours = MXFP4Experts.from_float(
        hf.gate_up_proj.transpose(1, 2),
        hf.down_proj.transpose(1, 2),
        hf.gate_up_proj_bias,
        hf.down_proj_bias,
        activation=_swiglu(hf.alpha, hf.limit),
    )
    gate_up, down = ours.dequantize()
    with torch.no_grad():
        hf.gate_up_proj.copy_(gate_up.transpose(1, 2))
        hf.down_proj.copy_(down.transpose(1, 2))
    x = torch.randn(tokens, h)
    ids = torch.stack([torch.randperm(e)[:2] for _ in range(tokens)])
    weights = torch.softmax(torch.randn(tokens, 2), dim=-1)
    with torch.no_grad():
        expected = hf(x, ids, weights)
        got = ours(x, weights, ids)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()


def test_experts_in_bfloat16() -> None:
    """In a bfloat16 model (biases cast by ``.to``, bytes kept) the experts stay within
    bfloat16's rounding of the float32 result over the same packed weights."""
    hf = _hf_gpt_oss_experts(4, 64, 96)
    act = _swiglu(hf.alpha, hf.limit)
    args = (hf.gate_up_proj.transpose(1, 2), hf.down_proj.transpose(1, 2))
    ours = MXFP4Experts.from_float(*args, hf.gate_up_proj_bias, hf.down_proj_bias, act)
    x = torch.randn(6, 64)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(6)])
    weights = torch.softmax(torch.randn(6, 2), dim=-1)
    with torch.no_grad():
        expected = ours(x, weights, ids)
        got = ours.to(torch.bfloat16)(x.bfloat16(), weights, ids)
    assert got.dtype == torch.bfloat16 and ours.down_proj_blocks.dtype == torch.uint8
    scale = expected.abs().max()
    assert float((got.float() - expected).abs().max()) <= 0.05 * float(scale)


def test_from_experts_matches_the_float_experts() -> None:
    """``from_experts`` of ``layers.moe.Experts`` ([gate | up], SiLU): the same routed output
    as those experts holding the dequantized weights."""
    from foudre.layers.moe import Experts

    torch.manual_seed(0)
    float_experts = Experts(3, 64, 32)
    with torch.no_grad():
        float_experts.gate_up_proj.normal_(0, 0.3)
        float_experts.down_proj.normal_(0, 0.3)
    ours = MXFP4Experts.from_experts(float_experts)
    assert ours.gate_up_proj_bias is None
    gate_up, down = ours.dequantize()
    with torch.no_grad():
        float_experts.gate_up_proj.copy_(gate_up)
        float_experts.down_proj.copy_(down)
        x = torch.randn(5, 64)
        ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0]])
        weights = torch.softmax(torch.randn(5, 2), dim=-1)
        expected = float_experts(x, weights, ids)
        got = ours(x, weights, ids)
    assert torch.allclose(got, expected, atol=1e-5, rtol=1e-4), (got - expected).abs().max()


def test_every_expert_path_matches() -> None:
    """The path taken while a CUDA graph is captured (``every_expert``: every expert over every
    row, weight 0 where not chosen) gives the grouped path's output."""
    from foudre.layers.moe import every_expert

    g = torch.Generator().manual_seed(5)
    ours = MXFP4Experts.from_float(
        torch.randn(3, 64, 32, generator=g), torch.randn(3, 32, 32, generator=g)
    )
    x = torch.randn(4, 32, generator=g)
    ids = torch.tensor([[0, 2], [1, 0], [2, 1], [0, 1]])
    weights = torch.softmax(torch.randn(4, 2, generator=g), dim=-1)
    with torch.no_grad():
        grouped = ours(x, weights, ids)
        dense = every_expert(x, weights, ids, 3, ours.expert)
    torch.testing.assert_close(dense, grouped, rtol=1e-5, atol=1e-5)


def test_from_tensors_holds_the_checkpoint_tensors() -> None:
    """``from_tensors`` over a layer's checkpoint tensors holds them as they are (no copy) and
    computes what ``from_float`` built them from; missing or misshapen tensors are named."""
    g = torch.Generator().manual_seed(6)
    source = MXFP4Experts.from_float(
        torch.randn(2, 64, 64, generator=g),
        torch.randn(2, 64, 32, generator=g),
        torch.randn(2, 64, generator=g).bfloat16(),
        torch.randn(2, 64, generator=g).bfloat16(),
    )
    tensors = source.state_dict()
    ours = MXFP4Experts.from_tensors(tensors)
    assert (ours.hidden_size, ours.intermediate_size, ours.num_experts) == (64, 32, 2)
    assert ours.down_proj_blocks.data_ptr() == tensors["down_proj_blocks"].data_ptr()
    x, ids, weights = torch.randn(3, 64), torch.tensor([[0, 1], [1, 0], [1, 0]]), torch.ones(3, 2)
    with torch.no_grad():
        assert torch.equal(ours(x, weights, ids), source(x, weights, ids))
    with pytest.raises(ValueError, match="missing down_proj_scales"):
        MXFP4Experts.from_tensors({k: v for k, v in tensors.items() if k != "down_proj_scales"})
    half = {n: tensors[n][:, :32] for n in ("down_proj_blocks", "down_proj_scales")}
    with pytest.raises(ValueError, match="do not fit"):
        MXFP4Experts.from_tensors(tensors | half)
    with pytest.raises(ValueError, match="both biases"):
        MXFP4Experts.from_tensors({k: v for k, v in tensors.items() if k != "down_proj_bias"})


class _BiasedExperts(torch.nn.Module):
    """Experts of ``layers.moe.Experts``' layout with biases and an activation of their own
    (gpt-oss's clamped SwiGLU over ``[gate | up]``), as a model may hold them."""

    def __init__(self, e: int, h: int, i: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(8)
        self.num_experts = e
        self.gate_up_proj = torch.nn.Parameter(torch.randn(e, 2 * i, h, generator=g) * 0.3)
        self.gate_up_proj_bias = torch.nn.Parameter(torch.randn(e, 2 * i, generator=g))
        self.down_proj = torch.nn.Parameter(torch.randn(e, h, i, generator=g) * 0.3)
        self.down_proj_bias = torch.nn.Parameter(torch.randn(e, h, generator=g))

    def activation(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        gate, up = gate.clamp(max=7.0), up.clamp(-7.0, 7.0)
        return (up + 1) * gate * torch.sigmoid(gate * 1.702)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        h = self.activation(x @ self.gate_up_proj[e].t() + self.gate_up_proj_bias[e])
        return h @ self.down_proj[e].t() + self.down_proj_bias[e]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        from foudre.layers.moe import grouped_experts

        return grouped_experts(x, weights, ids, self.num_experts, self.expert)


def test_quantize_takes_experts_with_biases_and_their_activation() -> None:
    """``quantize_`` with ``MXFP4`` turns experts of ``Experts``' layout with biases and their
    own activation (gpt-oss's float experts) into ``MXFP4Experts`` keeping both: the output of
    the float module holding the dequantized weights; int8 leaves such experts in float."""
    from foudre.quant import MXFP4, Int8WeightOnly, quantize_

    model = torch.nn.Module()
    model.experts = _BiasedExperts(3, 64, 32)
    model.proj = torch.nn.Linear(64, 64)
    quantize_(model, {"*experts": MXFP4(), "*": Int8WeightOnly()})  # type: ignore[arg-type]
    ours = model.experts
    assert isinstance(ours, MXFP4Experts) and type(model.proj).__name__ == "QuantLinear"
    reference = _BiasedExperts(3, 64, 32)
    gate_up, down = ours.dequantize()
    with torch.no_grad():
        reference.gate_up_proj.copy_(gate_up)
        reference.down_proj.copy_(down)
        x = torch.randn(5, 64)
        ids = torch.tensor([[0, 1], [2, 0], [1, 2], [0, 2], [1, 0]])
        weights = torch.softmax(torch.randn(5, 2), dim=-1)
        torch.testing.assert_close(ours(x, weights, ids), reference(x, weights, ids))
    kept = torch.nn.Module()
    kept.experts = _BiasedExperts(3, 64, 32)
    quantize_(kept, Int8WeightOnly())  # type: ignore[arg-type]
    assert isinstance(kept.experts, _BiasedExperts)


def test_experts_state_dict_uses_the_checkpoint_names() -> None:
    """The buffers carry gpt-oss's checkpoint names and shapes, uint8 kept through ``.to``."""
    mod = MXFP4Experts(4, 64, 96).to(torch.bfloat16)
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in mod.state_dict().items()}
    assert shapes == {
        "gate_up_proj_blocks": ((4, 192, 2, 16), torch.uint8),
        "gate_up_proj_scales": ((4, 192, 2), torch.uint8),
        "down_proj_blocks": ((4, 64, 3, 16), torch.uint8),
        "down_proj_scales": ((4, 64, 3), torch.uint8),
        "gate_up_proj_bias": ((4, 192), torch.bfloat16),
        "down_proj_bias": ((4, 64), torch.bfloat16),
    }


# ----------------------------------------------------------------------------- the engine

PROMPTS = [[1, *range(10, 40)], [1, 5, 9], [1, *range(60, 75)]]


@pytest.fixture(scope="module")
def grid_moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A random Qwen2-MoE whose experts' weights lie on the MXFP4 grid (rounded through
    ``quantize_mxfp4``, then saved): quantizing them again at load keeps every value, so
    transformers' float model is the oracle of its MXFP4 run. Returns the path and the model."""
    transformers = pytest.importorskip("transformers")
    path = make_hf_model(
        tmp_path_factory.mktemp("mxfp4_moe"),
        "qwen2_moe",
        num_hidden_layers=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=64,
    )
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.copy_(dequantize_mxfp4(*quantize_mxfp4(p)))  # [E, out, in]: in last
    hf.save_pretrained(path, safe_serialization=True)
    hf.generation_config.eos_token_id = None  # our run ignores EOS too
    return path, hf


def test_llm_with_mxfp4_experts_matches_transformers(grid_moe: tuple[Path, Any]) -> None:
    """``LLM(..., quantization="mxfp4")``: the experts become ``MXFP4Experts`` (the other
    linears float) and the greedy continuations of a batch of prompts of different lengths are
    transformers' token for token (float32); every block returns to the pool."""
    from foudre import LLM, SamplingParams

    path, hf = grid_moe
    llm = LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, quantization="mxfp4",
        num_kv_blocks=64, max_model_len=256,
    )  # fmt: skip
    model = llm.engine.runner.model
    kinds = {type(m).__name__ for m in model.modules()}
    assert "MXFP4Experts" in kinds and "QuantLinear" not in kinds
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]


def test_mxfp4_method_refuses_a_model_without_experts(tmp_path: Path) -> None:
    from foudre import LLM
    from foudre.loading.errors import ModelLoadError

    path = make_hf_model(tmp_path / "dense", "llama")
    with pytest.raises(ModelLoadError, match="mxfp4 quantizes the routed experts"):
        LLM(str(path), dtype="float32", skip_tokenizer_init=True, quantization="mxfp4")


def test_gpt_oss_float_checkpoint_quantized_to_mxfp4_at_load(tmp_path: Path) -> None:
    """A float gpt-oss checkpoint whose experts lie on the MXFP4 grid, loaded with
    ``quantization="mxfp4"``: every layer's experts become ``MXFP4Experts`` keeping the
    biases and the clamped SwiGLU, and the greedy ids of a batch are transformers' (float32)."""
    from foudre import LLM, SamplingParams
    from tests.oracles.test_gpt_oss import CONFIG  # (gpt-oss's small random config)

    transformers = pytest.importorskip("transformers")
    path = make_hf_model(tmp_path / "gpt_oss", "gpt_oss", **CONFIG)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # transformers' experts are [E, in, out]: rounded along in
        for name, p in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                grid = dequantize_mxfp4(*quantize_mxfp4(p.transpose(1, 2).contiguous()))
                p.copy_(grid.transpose(1, 2))
    hf.save_pretrained(path, safe_serialization=True)
    hf.generation_config.eos_token_id = None
    llm = LLM(
        str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
        quantization="mxfp4",
    )  # fmt: skip
    layers = llm.engine.runner.model.model.layers
    assert all(isinstance(layer.mlp.experts, MXFP4Experts) for layer in layers)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params), strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]), max_new_tokens=12, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref
