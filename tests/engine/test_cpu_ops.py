"""The fused CPU ops (``foudre/layers/cpu_ops.cpp``) against the torch chains they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foudre.layers import fused
from foudre.layers.norm import RMSNorm
from foudre.layers.rotary import RotaryEmbedding, _rotate_half

pytestmark = pytest.mark.skipif(
    fused._library() is None, reason="no C++ compiler or no AVX-512: the torch ops run instead"
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
@pytest.mark.parametrize("rows,n", [(1, 1536), (70, 96), (3, 40)])  # 40: a masked tail
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
@pytest.mark.parametrize("rows,n", [(1, 4096), (33, 50)])
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
