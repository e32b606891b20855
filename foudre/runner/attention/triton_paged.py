"""The GPU backend: a Triton paged-attention kernel for decode rows, SDPA for longer chunks.

Decode rows (one new token each, most rows of most steps) are computed by ``_paged_decode``, a
FlashAttention-style kernel that reads K/V straight from the paged cache: one program per
(row, KV head) holds the query heads that share that KV head (GQA/MQA) and walks the row's block
table one block at a time, with an online softmax (running max ``m``, running sum ``l`` and a
rescaled accumulator), so nothing is gathered, padded or materialised beyond one block::

    for each block b of the row (ceil(seq_len / block_size) of them):
        s   = q · K_b^T * scale             (masked past seq_len)
        m'  = max(m, max(s));  p = exp(s - m')
        l   = l * exp(m - m') + sum(p)
        acc = acc * exp(m - m') + p · V_b;  m = m'
    out = acc / l

Rows with several new tokens (prefill chunks, speculative verification) go through the same
SDPA groups as the CPU backend. The decode path has fixed shapes for a given number of rows and
reads every length and block id from device tensors, so a whole decode step can be captured in a
CUDA graph (``foudre.runner.cuda_graphs``). With ``TRITON_INTERPRET=1`` the kernel also runs on
CPU tensors, which is how the tests check it without a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foudre.runner.attention.paged import PagedDecodeBackend, PagedMetadata

__all__ = ["PagedMetadata", "TritonPagedBackend", "paged_decode"]


@triton.jit
def _paged_decode(
    q_ptr, k_ptr, v_ptr, o_ptr, tok_ptr, bt_ptr, len_ptr, scale,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    PER_KV: tl.constexpr, PER_KV_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    kvh = tl.program_id(1)
    tok = tl.load(tok_ptr + row).to(tl.int64)
    seq_len = tl.load(len_ptr + row)
    g = tl.arange(0, PER_KV_P2)
    d = tl.arange(0, HEAD_DIM_P2)
    qmask = (g[:, None] < PER_KV) & (d[None, :] < HEAD_DIM)
    heads = kvh * PER_KV + g
    q = tl.load(
        q_ptr + tok * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0
    )
    q = q.to(tl.float32) * scale
    m = tl.full([PER_KV_P2], float("-inf"), tl.float32)
    l = tl.zeros([PER_KV_P2], tl.float32)  # noqa: E741
    acc = tl.zeros([PER_KV_P2, HEAD_DIM_P2], tl.float32)
    offs = tl.arange(0, BLOCK_SIZE)
    for b in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        blk = tl.load(bt_ptr + row * stride_bt + b).to(tl.int64)
        valid = b * BLOCK_SIZE + offs < seq_len
        at = blk * stride_kb + offs[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_SIZE, D]
        v = tl.load(v_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [PER_KV, BLOCK_SIZE]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    out = acc / l[:, None]
    o_at = o_ptr + tok * stride_ot + heads[:, None] * stride_oh + d[None, :]
    tl.store(o_at, out.to(o_ptr.dtype.element_ty), mask=qmask)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    token_idx: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> None:
    """Attention of the decode rows: row ``i`` is token ``token_idx[i]`` of ``q [T, H, D]``,
    seeing the first ``seq_lens[i]`` positions of its blocks ``block_tables[i]`` in the cache
    (``[num_blocks, block_size, kv_heads, D]``); the result goes to ``out[token_idx[i]]``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert q.stride(2) == 1 and out.stride(2) == 1
    grid = (token_idx.shape[0], num_kv_heads)
    _paged_decode[grid](
        q, k_cache, v_cache, out, token_idx, block_tables, seq_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0),
        PER_KV=per_kv, PER_KV_P2=max(2, triton.next_power_of_2(per_kv)), HEAD_DIM=head_dim,
        HEAD_DIM_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
    )  # fmt: skip


class TritonPagedBackend(PagedDecodeBackend):
    name = "triton"

    decode = staticmethod(paged_decode)
