"""The fused CPU ops (``foudre/native/cpu_ops.cpp``) against the torch chains they replace."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from foudre.bench.roofline import measure_bandwidth
from foudre.layers import fused
from foudre.layers.linear import FP32_CHUNK, FP32_CHUNK_ROWS, MAX_ROWS, Linear
from foudre.layers.norm import RMSNorm
from foudre.layers.rotary import RotaryEmbedding, _rotate_half
from tests.engine.march import run_built_for

pytestmark = pytest.mark.skipif(
    fused._library() is None,
    reason="no C++ compiler, or neither AVX-512 nor AVX2: the torch ops run instead",
)
DTYPES = [torch.float32, torch.bfloat16]


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in units of the last place of ``a``'s dtype."""
    eps = torch.finfo(a.dtype).eps
    scale = torch.maximum(a.float().abs(), b.float().abs()).clamp_min(1e-30)
    return (a.float() - b.float()).abs() / (scale * eps)


def _inputs(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g) * 3
    x.view(-1)[:6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 1e-20, -90.0])  # edges of exp
    return x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (70, 96), (3, 40), (3, 45)])  # masked tails
def test_rms_norm(dtype: torch.dtype, rows: int, n: int) -> None:
    x, w = _inputs((rows, n), dtype), _inputs((n,), dtype).flip(0)
    h = x.float()
    ref = w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
    out = fused.rms_norm(x, w, 1e-5)
    # the float32 sum runs in another order: a last-place difference before the final rounding
    assert (_ulps_apart(out, ref) <= 4).all()
    if dtype == torch.bfloat16:  # and that difference rarely survives rounding to bf16
        assert (out == ref).float().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 1536), (70, 96), (3, 40), (3, 45)])
def test_offset_rms_norm(dtype: torch.dtype, rows: int, n: int) -> None:
    """Gemma's norm: ``(1 + weight) * x / rms(x)`` in float32, one rounding at the end."""
    x, w = _inputs((rows, n), dtype), _inputs((n,), dtype).flip(0) * 0.1
    h = x.float()
    ref = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).to(dtype)
    out = fused.offset_rms_norm(x, w, 1e-6)
    assert (_ulps_apart(out, ref) <= 4).all()
    if dtype == torch.bfloat16:
        assert (out == ref).float().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 4096), (33, 50), (2, 7)])
def test_gelu_mul(dtype: torch.dtype, rows: int, n: int) -> None:
    """GeGLU: ``T(gelu_tanh(gate)) * up``, against gelu in float64 as ``x / (1 + e^(-2u))``,
    the same function as ``0.5 x (1 + tanh(u))`` without its cancellation where tanh nears -1
    (which costs torch's float32 form, and even a float64 one, most of their digits there),
    within 16 ulps, or by a negligible amount where gelu is tiny."""
    gu = _inputs((rows, 2 * n), dtype)
    gate, up = gu.double().split(n, dim=-1)
    inner = (2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate**3)
    ref = ((gate / (1 + torch.exp(-2 * inner))).to(dtype).double() * up).to(dtype)
    out = fused.gelu_mul(gu)
    assert out.shape == ref.shape
    # (where gelu is below 1e-12, the float32 rounding of u, scaled by e^-2u, and the kernel's
    # exp stopping at e^88 move it by less than that: nothing beside activations of order 1)
    assert ((_ulps_apart(out, ref) <= 16) | ((out.double() - ref.double()).abs() < 1e-12)).all()
    if dtype == torch.bfloat16:
        assert (out == ref)[ref.abs() > 1e-12].float().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,n", [(1, 4096), (33, 50), (2, 7)])
def test_silu_mul(dtype: torch.dtype, rows: int, n: int) -> None:
    gu = _inputs((rows, 2 * n), dtype)
    gate, up = gu.split(n, dim=-1)
    ref = F.silu(gate) * up
    out = fused.silu_mul(gu)
    assert out.shape == ref.shape
    assert (_ulps_apart(out, ref) <= 4).all()
    if dtype == torch.bfloat16:
        assert (out == ref).float().mean() > 0.9


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("adjacent", [True, False])
def test_rope_in_place_equals_torch(dtype: torch.dtype, adjacent: bool) -> None:
    """Bit for bit: the kernel rounds each product and sum where torch's chain does."""
    rot = RotaryEmbedding(64, 300, 10000.0, {"rope_type": "llama3", "factor": 8.0})
    t, heads, kv, d = 5, 6, 2, 64
    positions = torch.tensor([0, 7, 299, 100, 3])
    qkv = _inputs((t, (heads + 2 * kv) * d), dtype)
    if adjacent:  # views of one q|k|v row, as the attention layer passes them
        q = qkv[:, : heads * d].view(t, heads, d)
        k = qkv[:, heads * d : (heads + kv) * d].view(t, kv, d)
    else:
        q = qkv[:, : heads * d].reshape(t, heads, d).clone()
        k = qkv[:, heads * d : (heads + kv) * d].reshape(t, kv, d).clone()
    cos = rot.cos[positions].unsqueeze(1).to(dtype)
    sin = rot.sin[positions].unsqueeze(1).to(dtype)
    ref_q, ref_k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    v_before = qkv[:, (heads + kv) * d :].clone()
    with torch.inference_mode():
        out_q, out_k = rot(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr()  # rotated in place
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(qkv[:, (heads + kv) * d :], v_before)  # v untouched
    with torch.inference_mode(), pytest.raises(IndexError, match="RoPE position"):
        rot(torch.tensor([0, 1, 2, 3, 300]), q, k)


def test_autograd_takes_the_torch_path() -> None:
    """Training (distillation, pruning) needs gradients: the fused path must stay out of it."""
    norm = RMSNorm(32)
    x = torch.randn(4, 32, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and norm.weight.grad is not None
    with torch.inference_mode():
        assert fused.enabled(x.detach(), norm.weight)
        assert torch.allclose(norm(x.detach()), fused.rms_norm(x.detach(), norm.weight, norm.eps))
    assert not fused.enabled(x, norm.weight)
    assert not fused.enabled(torch.zeros(2, dtype=torch.float16))  # no half-precision kernels


def check_linear() -> None:
    """``fused.linear`` against float64 products: the one-pass row counts (1-3), four at a time
    up to both dtypes' ``MAX_ROWS`` (16, 64) and past it, output widths that leave a partial
    group of weight rows, inner sizes with a masked tail (57: a bf16 tail past 16 lanes), with
    and without bias (one at a stride), and x rows at a stride (a view of a wider tensor)."""
    g = torch.Generator().manual_seed(1)
    shapes = [(37, 1000, True), (64, 1536, False), (3, 40, True), (17, 7, False), (13, 57, True)]
    for dtype in DTYPES:
        for rows in (1, 2, 3, 4, 5, 9, 16, 17, 64):
            for n, k, bias in shapes if rows <= 17 else shapes[:1]:
                wide = torch.randn(rows, k + 5, generator=g).to(dtype)
                x = wide[:, 2 : k + 2]  # row stride k + 5
                w = torch.randn(n, k, generator=g).to(dtype)
                b = torch.randn(2 * n, generator=g).to(dtype)[::2] if bias else None
                out = fused.linear(x, w, b)
                assert out.shape == (rows, n) and out.dtype == dtype
                ref = x.double() @ w.double().T + (0 if b is None else b.double())
                # float32 sums in another order (bounded by k ulps of the sum of |products|),
                # then one rounding to the dtype
                scale = x.double().abs() @ w.double().abs().T
                unit = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-24
                bound = k * 2.0**-24 * scale + unit * ref.abs() + 1e-30
                assert ((out.double() - ref).abs() <= bound).all(), (dtype, rows, n, k)
                # each row's result does not depend on the rows beside it (batch invariance)
                for i in (0, rows - 1):
                    assert torch.equal(out[i], fused.linear(x[i : i + 1], w, b)[0])


def test_linear_matches_float64() -> None:
    check_linear()


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_does_not_depend_on_the_threads(dtype: torch.dtype) -> None:
    """The tasks are handed out guided (any thread may take any rows): the result is the same
    bits on 1, 2 and 3 threads, for 1, 3 and 9 rows (one pass, and tiles of four)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 96, generator=g).to(dtype)
    b = torch.randn(200, generator=g).to(dtype)
    threads = torch.get_num_threads()
    try:
        for rows in (1, 3, 9):
            x = torch.randn(rows, 96, generator=g).to(dtype)
            results = []
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                results.append(fused.linear(x, w, b))
            assert all(torch.equal(r, results[0]) for r in results), rows
    finally:
        torch.set_num_threads(threads)


def test_linear_rejects_what_the_kernel_cannot_read() -> None:
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(ValueError, match="one dtype"):
        fused.linear(x, w.bfloat16())
    with pytest.raises(ValueError, match="bias of shape"):
        fused.linear(x, w, torch.randn(3))
    with pytest.raises(ValueError, match="x of shape"):
        fused.linear(torch.randn(2, 9), w)
    assert not fused.enabled(x, w.bfloat16()) and fused.enabled(x, w, None)


def check_gemm() -> None:
    """The AVX2 build's bfloat16 GEMM (``fused.gemm_unchecked``) against float64: x rows in
    tiles of three and the one or two left, weight rows in tiles and one at a time, columns past
    the last 16 (a plain loop), a strided x, with and without bias; each row's result the same
    bits computed alone (its sums do not depend on the tile it falls in), on 1 and 2 threads,
    and as the decode kernel's (``fused.linear``)."""
    g = torch.Generator().manual_seed(11)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        for rows, n, k in [(17, 50, 96), (22, 7, 33), (31, 97, 100), (64, 200, 7), (19, 1, 16)]:
            wide = torch.randn(rows, k + 5, generator=g).bfloat16()
            x = wide[:, 2 : 2 + k]  # rows k + 5 apart
            w = torch.randn(n, k, generator=g).bfloat16()
            for b in (None, torch.randn(n, generator=g).bfloat16()):
                out = fused.gemm_unchecked(x, w, b)
                assert out.shape == (rows, n) and out.dtype == torch.bfloat16
                ref = x.double() @ w.double().T + (0 if b is None else b.double())
                scale = x.double().abs() @ w.double().abs().T
                bound = k * 2.0**-24 * scale + 2.0**-8 * ref.abs() + 1e-30
                assert ((out.double() - ref).abs() <= bound).all(), (rows, n, k)
                torch.set_num_threads(1)
                assert torch.equal(fused.gemm_unchecked(x, w, b), out)
                torch.set_num_threads(2)
                for i in (0, 1, rows - 2, rows - 1):
                    assert torch.equal(fused.gemm_unchecked(x[i : i + 1], w, b)[0], out[i])
                # the decode kernel's sums in the same order: the same bits either side of
                # MAX_ROWS
                assert torch.equal(fused.linear(x, w, b), out)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.skipif(not fused.has_gemm(), reason="this build has no bfloat16 GEMM (AVX2 only)")
def test_gemm_matches_float64() -> None:
    check_gemm()


def check_ops() -> None:
    """Every op's test above, the linear kernel's and the bfloat16 GEMM's, through this
    build."""
    for dtype in DTYPES:
        for rows, n in [(1, 1536), (70, 96), (3, 40), (3, 45)]:
            test_rms_norm(dtype, rows, n)
            test_offset_rms_norm(dtype, rows, n)
        for rows, n in [(1, 4096), (33, 50), (2, 7)]:
            test_silu_mul(dtype, rows, n)
            test_gelu_mul(dtype, rows, n)
        for adjacent in (True, False):
            test_rope_in_place_equals_torch(dtype, adjacent)
    check_linear()
    check_gemm()


def test_linear_without_avx512_bf16(march_cache: Callable[[str], Path]) -> None:
    """The bfloat16 path that widens to float32 FMAs, built for a CPU without AVX512-BF16."""
    run_built_for(
        "skylake-avx512",
        "tests.engine.test_cpu_ops:check_linear",
        "cpu_ops",
        march_cache,
    )


def test_ops_built_for_avx2(march_cache: Callable[[str], Path]) -> None:
    """The AVX2 build (8 float32 lanes; a CPU without AVX-512): every op and the linear kernel,
    partial last vectors included."""
    run_built_for("haswell", "tests.engine.test_cpu_ops:check_ops", "cpu_ops", march_cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_layer_routes_by_rows(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel takes up to ``MAX_ROWS`` rows, torch's GEMM the rest and anything that needs
    gradients; both give the same layer."""
    layer = Linear(48, 20, bias=True).to(dtype)
    calls: list[int] = []
    kernel = fused.linear_unchecked
    monkeypatch.setattr(
        fused, "linear_unchecked", lambda x, *a: calls.append(x.shape[0]) or kernel(x, *a)
    )
    limit = MAX_ROWS[dtype]
    with torch.inference_mode():
        for rows in (1, limit, limit + 1):
            x = torch.randn(rows, 48).to(dtype)
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(
                layer(x), F.linear(x, layer.weight, layer.bias), atol=tol, rtol=tol
            )
    assert calls == [1, limit]
    x = torch.randn(2, 48, dtype=dtype, requires_grad=True)
    layer(x).sum().backward()  # autograd: the torch path, gradients flow
    assert x.grad is not None and layer.weight.grad is not None and calls == [1, limit]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(torch.randn(2, 48, dtype=dtype))  # autocast's dtype rules: torch's path
    assert out.dtype == torch.bfloat16 and calls == [1, limit]


@pytest.mark.parametrize("bias", [False, True])
def test_linear_layer_chunks_wide_float32_weights(bias: bool) -> None:
    """Past ``MAX_ROWS`` and up to ``FP32_CHUNK_ROWS`` rows, a float32 weight wider than
    ``FP32_CHUNK`` is multiplied a chunk of output features at a time, into one output: the
    same layer as ``F.linear`` (a partial last chunk included); gradients take ``F.linear``."""
    n = 2 * FP32_CHUNK + 37
    layer = Linear(40, n, bias=bias)
    x = torch.randn(MAX_ROWS[torch.float32] + 9, 40)
    with torch.inference_mode():
        out = layer(x)
        assert out.shape == (x.shape[0], n) and out.is_contiguous()
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias))
        wide = torch.randn(FP32_CHUNK_ROWS + 1, 40)  # past the rows that chunk: F.linear
        torch.testing.assert_close(layer(wide), F.linear(wide, layer.weight, layer.bias))
    xg = x.clone().requires_grad_()
    layer(xg).sum().backward()
    assert xg.grad is not None and layer.weight.grad is not None


def test_roofline_counts_the_fastest_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """The bandwidth is the fastest of a plain read (a sum), torch.mv and the kernel: slowing
    the first two leaves the kernel's."""
    fast = measure_bandwidth(mib=64, repeats=2)
    assert fast > 0

    def slowed(real):  # type: ignore[no-untyped-def]
        def slow(*args: torch.Tensor) -> torch.Tensor:
            for _ in range(20):
                real(*args)
            return real(*args)

        return slow

    monkeypatch.setattr(torch, "mv", slowed(torch.mv))
    monkeypatch.setattr(torch.Tensor, "sum", slowed(torch.Tensor.sum))
    assert measure_bandwidth(mib=64, repeats=2) > fast / 5
