"""The mixture-of-experts layer (``foudre/layers/moe.py``): routing, the grouped expert path, the
native decode kernel and the Triton kernel against a per-token loop, quantized experts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from foudre.layers import fused
from foudre.layers.linear import MAX_ROWS
from foudre.layers.moe import Experts, SparseMoeBlock, every_expert, grouped_experts, route
from foudre.quant.experts import QuantExperts
from foudre.quant.qlinear import uses_native_kernels
from tests.engine.march import run_built_for
from tests.triton_check import run_triton_check

NATIVE = pytest.mark.skipif(
    fused._library() is None,
    reason="no C++ compiler, or neither AVX-512 nor AVX2: the torch ops run instead",
)


def _experts(num: int, hidden: int, inter: int, dtype: torch.dtype, seed: int = 0) -> Experts:
    g = torch.Generator().manual_seed(seed)
    ex = Experts(num, hidden, inter)
    with torch.no_grad():
        ex.gate_up_proj.copy_(torch.randn(ex.gate_up_proj.shape, generator=g) * 0.2)
        ex.down_proj.copy_(torch.randn(ex.down_proj.shape, generator=g) * 0.2)
    return ex.to(dtype)


def _routing(
    t: int, num: int, k: int, renormalize: bool = True, seed: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return route(torch.randn(t, num, generator=g) * 2, k, renormalize)


def _per_token(ex: Experts, x: torch.Tensor, w: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The definition, one token and one expert at a time in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    gu, dn = ex.gate_up_proj.double(), ex.down_proj.double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (gu[e] @ x[t].double()).chunk(2)
            out[t] += float(w[t, j]) * (dn[e] @ (F.silu(gate) * up))
    return out


def test_route_softmax_topk_and_renormalisation() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 3.0, 0.0, 0.0]])
    probs = torch.softmax(logits, -1)
    w, ids = route(logits, 2, renormalize=False)
    assert ids[0].tolist() == [1, 2] and ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.allclose(w, probs.gather(1, ids))
    w, ids = route(logits.bfloat16(), 2, renormalize=True)
    assert w.dtype == torch.float32 and torch.allclose(w.sum(-1), torch.ones(2))
    w, ids = route(logits, 1, renormalize=True)
    assert w.flatten().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("num,k,t", [(4, 1, 9), (8, 2, 33), (6, 4, 5)])
def test_grouped_experts_equal_the_per_token_definition(num: int, k: int, t: int) -> None:
    ex = _experts(num, 48, 40, torch.float32)
    x = torch.randn(t, 48, generator=torch.Generator().manual_seed(2))
    w, ids = _routing(t, num, k)
    with torch.inference_mode():
        out = grouped_experts(x, w, ids, num, ex.expert)
        via_module = ex(x, w, ids)
    ref = _per_token(ex, x, w, ids)
    assert torch.allclose(out.double(), ref, atol=1e-5)
    assert torch.allclose(via_module.double(), ref, atol=1e-5)


def test_every_expert_is_the_grouped_path_with_zero_weights() -> None:
    """The capturable path (every expert on every row) adds exact zeros where a row did not
    choose an expert: the same sums, and with our fused kernels (whose rows do not depend on the
    batch) the same bits; through torch's GEMMs, which block a batch of 9 rows otherwise than
    its subsets on some CPUs (AVX2 builds), to float32 rounding."""
    ex = _experts(6, 48, 40, torch.float32)
    x = torch.randn(9, 48, generator=torch.Generator().manual_seed(4))
    w, ids = _routing(9, 6, 2)
    with torch.inference_mode():
        every = every_expert(x, w, ids, 6, ex.expert)
        grouped = grouped_experts(x, w, ids, 6, ex.expert)
    if fused.enabled(x):
        assert torch.equal(every, grouped)
    else:
        assert torch.allclose(every, grouped, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(every, grouped_experts(x, w.flip(1), ids, 6, ex.expert), atol=1e-3)


@NATIVE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_decode_kernel_has_the_grouped_paths_bits(dtype: torch.dtype) -> None:
    check_native_kernel(dtype)


def check_native_kernel(dtype: torch.dtype | None = None) -> None:
    """``fused.moe_experts`` at decode sizes (1 row, a few, ``MAX_ROWS``; widths with masked
    tails; top-1 to top-4) equals the grouped path bit for bit, and so does each row alone
    (batch invariance)."""
    for dt in [dtype] if dtype is not None else [torch.float32, torch.bfloat16]:
        for num, k, hidden, inter in ((4, 2, 64, 48), (8, 1, 40, 72), (6, 4, 200, 37)):
            ex = _experts(num, hidden, inter, dt)
            for t in (1, 3, MAX_ROWS[dt]):
                x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(t)).to(dt)
                w, ids = _routing(t, num, k, seed=t)
                with torch.inference_mode():
                    ref = grouped_experts(x, w, ids, num, ex.expert)
                    out = fused.moe_experts(x, w, ids, ex.gate_up_proj, ex.down_proj)
                    assert torch.equal(out, ref), (dt, num, k, t)
                    assert torch.equal(ex(x, w, ids), ref)  # the module takes the kernel
                    one = fused.moe_experts(x[-1:], w[-1:], ids[-1:], ex.gate_up_proj, ex.down_proj)
                    assert torch.equal(one[0], out[-1])


def check_native_block() -> None:
    """A whole ``SparseMoeBlock`` at decode sizes is one native call; it equals the block's
    step-by-step path (router ``Linear``, ``route``, counts, grouped experts) bit for bit, and
    the native routing equals torch's softmax / top-k within float32 rounding."""
    for dtype in (torch.float32, torch.bfloat16):
        for num, k, renorm in ((8, 2, True), (6, 1, False), (16, 4, False)):
            torch.manual_seed(num + k)
            block = SparseMoeBlock(72, num, k, 40, renormalize=renorm).to(dtype)
            with torch.no_grad():
                for p in block.parameters():
                    p.normal_(0, 0.3)
            for t in (1, 5, MAX_ROWS[dtype]):
                x = torch.randn(t, 72).to(dtype)
                with torch.inference_mode():
                    assert block._native(x)
                    before = block.expert_tokens.clone()
                    out = block(x)
                    logits = block.gate(x)
                    w, ids = route(logits, k, renorm)
                    ref = grouped_experts(x, w, ids, num, block.experts.expert)
                    assert torch.equal(out, ref), (dtype, num, k, t)
                    counts = torch.bincount(ids.flatten(), minlength=num)
                    assert torch.equal(block.expert_tokens - before, counts)
                    probs = torch.softmax(logits.float(), -1)
                    tw, tids = torch.topk(probs, k, -1)
                    if renorm:
                        tw = tw / tw.sum(-1, keepdim=True)
                    assert torch.equal(ids, tids)
                    assert torch.allclose(w, tw, rtol=1e-6, atol=1e-7)


@NATIVE
def test_native_block_has_the_step_by_step_bits() -> None:
    check_native_block()


# the native kernel's checks, run by one process of another build
NATIVE_CHECKS = [
    "tests.engine.test_moe:check_native_kernel",
    "tests.engine.test_moe:check_native_block",
]


@NATIVE
def test_native_kernel_without_avx512_bf16(march_cache: Callable[[str], Path]) -> None:
    run_built_for("skylake-avx512", NATIVE_CHECKS, "cpu_ops", march_cache)


@NATIVE
def test_native_kernel_built_for_avx2(march_cache: Callable[[str], Path]) -> None:
    run_built_for("haswell", NATIVE_CHECKS, "cpu_ops", march_cache)


@NATIVE
def test_native_kernel_rejects_bad_ids_and_shapes() -> None:
    ex = _experts(4, 32, 16, torch.float32)
    x = torch.randn(2, 32)
    w, ids = _routing(2, 4, 2)
    with pytest.raises(IndexError, match="expert id"):
        fused.moe_experts(x, w, ids + 4, ex.gate_up_proj, ex.down_proj)
    with pytest.raises(ValueError, match="moe_experts"):
        fused.moe_experts(torch.randn(2, 31), w, ids, ex.gate_up_proj, ex.down_proj)
    with pytest.raises(IndexError):
        grouped_experts(x, w, ids + 4, 4, ex.expert)


@pytest.mark.parametrize("rows", [1, 5, 40])  # the native kernel (when built) and the grouped path
def test_only_the_chosen_experts_weights_are_read(rows: int) -> None:
    """An expert no token chose may hold NaNs: nothing of it reaches the output."""
    ex = _experts(8, 64, 32, torch.float32)
    x = torch.randn(rows, 64)
    logits = torch.randn(rows, 8, generator=torch.Generator().manual_seed(3))
    logits[:, 5:] = -30.0  # experts 5..7 never chosen
    w, ids = route(logits, 2, True)
    chosen = set(ids.flatten().tolist())
    with torch.inference_mode():
        ref = ex(x, w, ids)
        for e in range(8):
            if e not in chosen:
                ex.gate_up_proj[e] = float("nan")
                ex.down_proj[e] = float("nan")
        out = ex(x, w, ids)
    assert len(chosen) < 8 and torch.equal(out, ref)


_TRITON_CHECK = """
import torch
from foudre.layers import moe_triton
from foudre.layers.moe import Experts, grouped_experts, route
torch.manual_seed(0)
for num, k, t, hidden, inter in ((4, 2, 3, 32, 48), (8, 1, 40, 64, 32), (6, 4, 17, 48, 80),
                                 (16, 2, 1, 64, 96), (4, 2, 150, 32, 16)):
    ex = Experts(num, hidden, inter)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.1)
        ex.down_proj.normal_(0, 0.1)
        x = torch.randn(t, hidden)
        w, ids = route(torch.randn(t, num), k, True)
        ref = grouped_experts(x, w, ids, num, ex.expert)
        sorted_rows, experts, total = moe_triton.align(ids, num, 16)
        n = t * k
        real = sorted_rows[sorted_rows < n]
        assert sorted(real.tolist()) == list(range(n)), "every pair once"
        for tile in range(int(total) // 16):  # each tile's pairs belong to its expert
            rows = sorted_rows[tile * 16 : (tile + 1) * 16]
            rows = rows[rows < n].long()
            assert (ids.reshape(-1)[rows] == experts[tile]).all()
        got = moe_triton.fused_experts(x, ex.gate_up_proj, ex.down_proj, w, ids)
        assert got.shape == ref.shape and got.dtype == ref.dtype
        err = (got - ref).abs().max().item()
        assert err < 1e-5, (num, k, t, err)
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine tests run it for real on CUDA")
def test_triton_fused_experts_interpreted() -> None:
    run_triton_check(_TRITON_CHECK, timeout=300)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_triton_fused_experts_on_cuda() -> None:
    from foudre.layers import moe_triton

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        ex = _experts(8, 256, 192, dtype).cuda()
        for t in (1, 7, 300):
            x = torch.randn(t, 256).to(dtype).cuda()
            w, ids = _routing(t, 8, 2)
            w, ids = w.cuda(), ids.cuda()
            with torch.inference_mode():
                ref = grouped_experts(x, w, ids, 8, ex.expert)
                got = moe_triton.fused_experts(x, ex.gate_up_proj, ex.down_proj, w, ids)
            assert (got.float() - ref.float()).abs().max().item() < tol * ref.abs().max().item()


def test_sparse_moe_block_shared_expert_and_counts() -> None:
    torch.manual_seed(0)
    block = SparseMoeBlock(32, 6, 2, 24, renormalize=False, shared_intermediate_size=40,
                           shared_gate=True)  # fmt: skip
    for p in block.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    x = torch.randn(5, 32)
    with torch.inference_mode():
        out = block(x)
        w, ids = route(block.gate(x), 2, False)
        shared = torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
        expected = block.experts(x, w, ids) + shared
    assert torch.allclose(out, expected, atol=1e-6)
    counts = torch.bincount(ids.flatten(), minlength=6)
    assert block.expert_tokens.tolist() == counts.tolist() and int(counts.sum()) == 10
    block.reset_stats()
    assert block.expert_tokens.sum() == 0
    with pytest.raises(ValueError, match="top_k"):
        SparseMoeBlock(32, 4, 5, 8, renormalize=True)


@pytest.mark.parametrize("native", [False, True])
@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)])
def test_quantized_experts_match_their_dequantized_weights(
    bits: int, group: int | None, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Exact activations (aten's kernels) give the dequantized weights' output to float
    rounding; the native int8 kernel, which rounds activations to int8 per block
    (``cpu_qmatmul.activation_block``) as llama.cpp does, stays within the quantization's own
    error of the float experts."""
    monkeypatch.setenv("FOUDRE_NATIVE_QMATMUL", "1" if native else "0")
    if native and not uses_native_kernels(torch.float32):
        pytest.skip("the native quantized kernels did not build here")
    ex = _experts(4, 64, 48, torch.float32)
    q = QuantExperts.from_experts(ex, bits, group)
    deq = Experts(4, 64, 48)
    with torch.no_grad():
        deq.gate_up_proj.copy_(torch.stack([m.dequantize() for m in q.gate_up]))
        deq.down_proj.copy_(torch.stack([m.dequantize() for m in q.down]))
    x = torch.randn(7, 64)
    w, ids = _routing(7, 4, 2)
    with torch.inference_mode():
        got, ref, exact = q(x, w, ids), grouped_experts(x, w, ids, 4, deq.expert), ex(x, w, ids)
    if native:  # int8 activations (each within 1/254 of its block's largest), in two matmuls
        assert (got - ref).norm() / ref.norm() < 0.03
    else:
        assert torch.allclose(got, ref, atol=1e-4, rtol=1e-3)
    rel = (got - exact).norm() / exact.norm()
    assert rel < (0.02 if bits == 8 else 0.2)


@pytest.mark.parametrize("native", [True, False])
def test_route_breaks_ties_by_the_lower_index(
    native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Equal probabilities (bfloat16 router logits tie often) go to the lower expert index, on
    the native routing and on torch's (CUDA, no AVX-512) alike, whatever the batch: torch.topk
    alone breaks ties as its algorithm falls ([42, 43, 44, 41] for 64 zeros)."""
    if native and fused._library() is None:
        pytest.skip("no native kernels")
    if not native:
        monkeypatch.setattr(fused, "enabled", lambda *a: False)
    logits = torch.zeros(3, 64)
    logits[1, [7, 9, 30]] = 1.0  # a three-way tie for two places after expert 5
    logits[1, 5] = 2.0
    logits[2, :] = torch.arange(64) % 4  # sixteen experts tie for first
    for dtype in (torch.float32, torch.bfloat16):
        w, ids = route(logits.to(dtype), 3, True)
        assert ids.tolist() == [[0, 1, 2], [5, 7, 9], [3, 7, 11]]
        assert torch.equal(w[0], torch.full((3,), 1 / 3))
        for t in range(3):  # a row alone routes as in the batch
            assert torch.equal(route(logits[t : t + 1].to(dtype), 3, True)[1], ids[t : t + 1])


@pytest.mark.parametrize("rows", [5, 40])  # the native block (when built), then route + grouped
def test_padding_rows_are_not_counted(rows: int) -> None:
    """With ``routed_rows`` set to 3 only the first rows count (the others pad a batch), and
    nothing counts while it is off; the outputs do not change."""
    torch.manual_seed(0)
    block = SparseMoeBlock(32, 6, 2, 24, renormalize=True)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0, 0.3)
    x = torch.randn(rows, 32)
    with torch.inference_mode():
        ref = block(x)
        _, ids = route(block.gate(x), 2, True)
        block.reset_stats()
        block.routed_rows.set(3)
        assert torch.equal(block(x), ref)
        assert (
            block.expert_tokens.tolist() == torch.bincount(ids[:3].flatten(), minlength=6).tolist()
        )
        block.routed_rows.on = False
        assert torch.equal(block(x), ref)
        assert int(block.expert_tokens.sum()) == 6


@pytest.mark.parametrize(
    ("experts", "n_group", "topk_group"), [(8, 3, 1), (8, 2, 3), (8, 2, 0), (4, 4, 1)]
)
def test_grouped_routing_refuses_groups_it_cannot_rank(
    experts: int, n_group: int, topk_group: int
) -> None:
    """DeepSeek's routing (sigmoid scores, groups ranked by their two best experts): groups
    that do not divide the experts, a topk_group outside 1..n_group, or groups of one expert
    are refused where the block is built, naming n_group."""
    with pytest.raises(ValueError, match="n_group"):
        SparseMoeBlock(
            16, experts, 2, 8, True, scoring="sigmoid", n_group=n_group, topk_group=topk_group
        )
    SparseMoeBlock(16, 8, 2, 8, True, scoring="sigmoid", n_group=4, topk_group=2)  # (fine)
