"""The routed experts of ``layers/moe.py`` on CUDA: a fused mixture-of-experts in Triton.

The ``T * k`` (token, expert) pairs are sorted by expert and each expert's run is padded to a
multiple of ``BLOCK_M`` (``align``, torch ops on the device with no host synchronisation, so
CUDA graphs capture them), so that every ``BLOCK_M`` tile of sorted rows belongs to one expert.
Then two launches of one grouped-GEMM kernel (``_expert_gemm``), one program per (row tile,
column tile), each multiplying its rows by its expert's weights:

    gate_up[j] = x[token(j)] @ gate_up_proj[e(j)].T          [T * k, 2I], x's dtype
    act[j]     = silu(gate_up[j, :I]) * gate_up[j, I:]       torch, [T * k, I]
    y[j]       = weight(j) * act[j] @ down_proj[e(j)].T      [T * k, hidden], float32
    out[t]     = sum over t's k rows of y                    rounded to x's dtype

Tiles of padding rows load nothing and store nothing, and row tiles past the last expert's end
return at once, so a step reads each active expert's weights once per row tile and never an
idle expert's. Accumulation is float32 (IEEE products for float32 inputs). Imported lazily,
only where Triton imports; with ``TRITON_INTERPRET=1`` the kernel runs on CPU tensors, which is
how the tests check it without a GPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _expert_gemm(
    a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, total_ptr,
    N, K, num_rows, a_div, stride_am, stride_be, stride_bn, stride_cm,
    MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """``c[r] = (w[r] *) a[r // a_div] @ b[e].T`` for the sorted rows ``r`` of this program's
    tile (``r < num_rows``; padding entries equal ``num_rows``), ``e`` the tile's expert."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(total_ptr):
        return
    rows = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = rows < num_rows
    expert = tl.load(expert_ptr + pid_m).to(tl.int64)
    a_rows = (rows // a_div).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + rk[None, :],
            mask=valid[:, None] & (rk[None, :] < K),
            other=0.0,
        )
        b = tl.load(
            b_ptr + expert * stride_be + rn[None, :] * stride_bn + rk[:, None],
            mask=(rn[None, :] < N) & (rk[:, None] < K),
            other=0.0,
        )
        if IEEE:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + rows, mask=valid, other=0.0)[:, None]
    tl.store(
        c_ptr + rows.to(tl.int64)[:, None] * stride_cm + rn[None, :],
        acc.to(c_ptr.dtype.element_ty),
        mask=valid[:, None] & (rn[None, :] < N),
    )


def align(
    ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_rows, tile_experts, total)`` for the flat (token, slot) pairs of ``ids``
    ``[T, k]``: pair indices ``t * k + j`` sorted by expert (stable), each expert's run padded
    to a multiple of ``block_m`` with the index ``T * k``; the expert of each ``block_m`` tile;
    and the padded length (a one-element tensor). Sized for the worst case (every active
    expert padded), so no value leaves the device."""
    flat = ids.reshape(-1)
    n = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    by_expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # where each expert's pairs start in `order`
    rank = torch.arange(n, device=dev) - first[by_expert]
    dest = (ends - padded)[by_expert] + rank
    tiles = -(-(n + min(n, num_experts) * (block_m - 1)) // block_m)
    sorted_rows = torch.full((tiles * block_m,), n, dtype=torch.int32, device=dev)
    sorted_rows[dest] = order.to(torch.int32)
    starts = torch.arange(tiles, device=dev) * block_m
    experts = torch.searchsorted(ends, starts, right=True).clamp_(max=num_experts - 1)
    return sorted_rows, experts.to(torch.int32), ends[-1:]


def _gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    weights: torch.Tensor | None,
    sorted_rows: torch.Tensor,
    experts: torch.Tensor,
    total: torch.Tensor,
    a_div: int,
    block_m: int,
) -> None:
    n_out, k = b.shape[1], b.shape[2]
    block_n = 64 if n_out >= 64 else max(16, triton.next_power_of_2(n_out))
    block_k = 64 if k >= 64 else max(16, triton.next_power_of_2(k))
    grid = (experts.numel(), triton.cdiv(n_out, block_n))
    _expert_gemm[grid](
        a, b, out, weights if weights is not None else out, sorted_rows, experts, total,
        n_out, k, out.shape[0], a_div, a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        MUL_WEIGHT=weights is not None, IEEE=a.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * down[e](silu(gate) * up)``, ``gate | up = x[t] @
    gate_up[e].T``, ``e = ids[t, j]``, for ``x`` ``[T, hidden]``, ``gate_up`` ``[E, 2I,
    hidden]`` and ``down`` ``[E, hidden, I]`` (contiguous, x's dtype); x's dtype."""
    t, k = ids.shape
    num_experts, two_inter, hidden = gate_up.shape
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    block_m = 16 if t * k <= 256 else 64
    sorted_rows, experts, total = align(ids, num_experts, block_m)
    h = torch.empty(t * k, two_inter, dtype=x.dtype, device=x.device)
    _gemm(x, gate_up, h, None, sorted_rows, experts, total, k, block_m)
    act = (F.silu(h[:, : two_inter // 2]) * h[:, two_inter // 2 :]).contiguous()
    y = torch.empty(t * k, hidden, dtype=torch.float32, device=x.device)
    w = weights.reshape(-1).to(torch.float32).contiguous()
    _gemm(act, down, y, w, sorted_rows, experts, total, 1, block_m)
    return y.view(t, k, hidden).sum(dim=1).to(x.dtype)
