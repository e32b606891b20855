"""The GPU backend: Triton paged-attention kernels, for decode rows and for prefill / mixed steps.

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

A step that holds rows of several new tokens (prefill chunks, speculative verification) runs
all its rows, decode rows included, in one launch of ``_paged_prefill``, a FlashAttention-2
style varlen kernel over the block table: one program per (tile of query positions of a row,
KV head) stacks the tile's positions for every query head of the group into the rows of its
``tl.dot``s (the group shares each K/V tile), walks the keys the tile can see ``BLOCK_N`` at a
time, gathering each key's block from the table, and applies the causal limit (and the sliding
window) as tile bounds plus a mask on the edge tiles. No K/V is gathered into a tensor and no
dense mask exists. A sliding window also moves both kernels' first block: the blocks before the
window are never read. Attention sinks (gpt-oss: a logit per head in the softmax denominator)
add ``exp(sink - m)`` to ``l`` before the division, in both kernels.

A quantized KV cache (``kv_cache_dtype`` int8 / fp8) is read as stored by both kernels: the
codes are loaded (a byte each) and converted in registers (int8 by a cast; float8 e4m3fn from
its bits, by integer arithmetic that any GPU and the interpreter run), and the per-(token, KV
head) scales multiply what they multiply anyway: a key's scale its scores, a value's scale its
softmax weights, once those joined the running sum. The prefill kernel's dots take the codes
converted to the queries' dtype, which holds every int8 and e4m3 value exactly.

Both kernels have fixed shapes for a given number of rows (tiles) and read every length, block
id and tile from device tensors, so whole steps can be captured in CUDA graphs
(``foudre.runner.cuda_graphs``), over a quantized cache as over a float one. With
``TRITON_INTERPRET=1`` the kernels also run on CPU tensors, which is how the tests check them
without a GPU.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from foudre.attention.paged import PagedBackend, PagedMetadata, PrefillRows

__all__ = ["PagedMetadata", "TritonPagedBackend", "paged_decode", "paged_prefill"]

_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# the kernels' CODES: 0 a float cache, 1 int8 codes, 2 float8 e4m3fn codes (read as bytes)
_CODES = {torch.int8: 1, torch.float8_e4m3fn: 2}


@triton.jit
def _code_values(c, CODES: tl.constexpr):
    """The values of int8 codes (``CODES`` 1) or of float8 e4m3fn bits (2, uint8) in float32:
    a normal e4m3 (exponent field e > 0) moves its exponent and mantissa into a float32's with
    the bias raised from 7 to 127; a subnormal is its mantissa times 2^-9."""
    if CODES == 1:
        x = c.to(tl.float32)
    else:
        b = c.to(tl.int32)
        em = b & 0x7F
        normal = ((em << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        x = tl.where(em >= 8, normal, (b & 7).to(tl.float32) * 0.001953125)
        x = tl.where(b >= 128, -x, x)
    return x


def _codes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(CODES, K, V, K scales, V scales) as the kernels take them: e4m3 codes as bytes; the
    caches again in place of the scales of a float cache (never read)."""
    codes = _CODES.get(k_cache.dtype, 0)
    if not codes:
        assert k_cache.dtype == q.dtype and k_scale is None and v_scale is None
        return 0, k_cache, v_cache, k_cache, v_cache
    assert k_scale is not None and v_scale is not None and v_cache.dtype == k_cache.dtype
    # scales [blocks, block_size, kv_heads] laid out as the codes without head_dim
    assert k_scale.stride() == v_scale.stride() and k_scale.stride(2) == 1
    if codes == 2:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    return codes, k_cache, v_cache, k_scale, v_scale


@triton.jit
def _paged_decode(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, tok_ptr, bt_ptr, len_ptr, sinks_ptr, scale,
    window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    stride_sb, stride_ss,
    PER_KV: tl.constexpr, PER_KV_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, CODES: tl.constexpr,
    SINKS: tl.constexpr,
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
    # the first key seen (0 without a window): blocks before it are not read
    start = tl.maximum(seq_len - tl.where(window > 0, window, seq_len), 0)
    for b in range(start // BLOCK_SIZE, tl.cdiv(seq_len, BLOCK_SIZE)):
        blk = tl.load(bt_ptr + row * stride_bt + b).to(tl.int64)
        pos = b * BLOCK_SIZE + offs
        valid = (pos < seq_len) & (pos >= start)
        at = blk * stride_kb + offs[:, None] * stride_ks + kvh * stride_kh + d[None, :]
        kv_mask = valid[:, None] & (d[None, :] < HEAD_DIM)
        if CODES == 0:
            k = tl.load(k_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)  # [BLOCK_SIZE, D]
            v = tl.load(v_ptr + at, mask=kv_mask, other=0.0).to(tl.float32)
        else:
            k = _code_values(tl.load(k_ptr + at, mask=kv_mask, other=0), CODES)
            v = _code_values(tl.load(v_ptr + at, mask=kv_mask, other=0), CODES)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [PER_KV, BLOCK_SIZE]
        if CODES != 0:  # each key's scale times its scores, each value's times its weights
            s_at = blk * stride_sb + offs * stride_ss + kvh
            s = s * tl.load(ks_ptr + s_at, mask=valid, other=0.0)[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        if CODES != 0:
            p = p * tl.load(vs_ptr + s_at, mask=valid, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m = m_new
    if SINKS:  # each head's sink: one more term of its denominator, exp(sink - m)
        l = l + tl.exp(tl.load(sinks_ptr + heads, mask=g < PER_KV, other=0.0) - m)  # noqa: E741
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
    window: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
) -> None:
    """Attention of the decode rows: row ``i`` is token ``token_idx[i]`` of ``q [T, H, D]``,
    seeing the first ``seq_lens[i]`` positions of its blocks ``block_tables[i]`` in the cache
    (``[num_blocks, block_size, kv_heads, D]``), the last ``window`` of them with a sliding
    window; the result goes to ``out[token_idx[i]]``. A quantized cache: int8 / float8_e4m3fn
    codes with their scales ``k_scale`` / ``v_scale`` ``[num_blocks, block_size, kv_heads]``.
    ``sinks``: float32 ``[H]``, each head's sink logit in its softmax denominator. The rows'
    new K / V are in the cache already (``k_new`` / ``v_new``: refused, see
    ``PagedBackend.stores_new_tokens``)."""
    if k_new is not None or v_new is not None:
        raise ValueError("the Triton decode kernel reads new tokens from the cache only")
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert q.stride(2) == 1 and out.stride(2) == 1
    codes, k_cache, v_cache, ks, vs = _codes(q, k_cache, v_cache, k_scale, v_scale)
    grid = (token_idx.shape[0], num_kv_heads)
    _paged_decode[grid](
        q, k_cache, v_cache, ks, vs, out, token_idx, block_tables, seq_lens,
        q if sinks is None else sinks, scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), block_tables.stride(0), ks.stride(0), ks.stride(1),
        PER_KV=per_kv, PER_KV_P2=max(2, triton.next_power_of_2(per_kv)), HEAD_DIM=head_dim,
        HEAD_DIM_P2=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size, CODES=codes,
        SINKS=sinks is not None,
    )  # fmt: skip


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    """``tl.dot(a, b)``, in IEEE float32 (not TF32) where ``IEEE``."""
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _kv_tile(ptr, at, d, kv_mask, q_ptr, CODES: tl.constexpr):
    """The K or V rows of a tile of keys (``at``: each key's offset in the cache): as stored in a
    float cache; a quantized cache's codes converted to the queries' dtype (exact)."""
    if CODES == 0:
        x = tl.load(ptr + at[:, None] + d[None, :], mask=kv_mask, other=0.0)
    else:
        x = tl.load(ptr + at[:, None] + d[None, :], mask=kv_mask, other=0)
        x = _code_values(x, CODES).to(q_ptr.dtype.element_ty)
    return x


@triton.jit
def _key_range(first, ctx, window, POS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(k_first, k_lo, k_hi)`` of a tile whose first query is at position ``first`` of a row of
    ``ctx`` keys: the first key any query of the tile sees (0 without a window: earlier blocks
    are not read), that rounded down to ``BLOCK_N``, and the key after the tile's last query."""
    k_hi = tl.minimum(first + POS, ctx)
    k_first = tl.maximum(first - tl.where(window > 0, window, first + 1) + 1, 0)
    k_lo = k_first // BLOCK_N * BLOCK_N
    return k_first, k_lo, k_hi


@triton.jit
def _paged_prefill(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, o_ptr, tile_ptr, n_tiles, qs_ptr, ql_ptr, len_ptr,
    bt_ptr, sinks_ptr, scale, window,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_ot, stride_oh, stride_bt,
    stride_sb, stride_ss,
    PER_KV: tl.constexpr, POS: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr, UPCAST: tl.constexpr, CODES: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.load(tile_ptr + tile)  # -1: a padding tile (fixed grids of CUDA graphs)
    if row >= 0:
        q0 = tl.load(tile_ptr + n_tiles + tile)
        q_start = tl.load(qs_ptr + row).to(tl.int64)
        q_len = tl.load(ql_ptr + row)
        ctx = tl.load(len_ptr + row)
        # row m of the tile: query position q0 + m // PER_KV of the row, head m % PER_KV
        m = tl.arange(0, BLOCK_M)
        qi = q0 + m // PER_KV
        live = (m < POS * PER_KV) & (qi < q_len)
        qpos = ctx - q_len + qi
        d = tl.arange(0, HEAD_DIM_P2)
        dmask = d < HEAD_DIM
        heads = kvh * PER_KV + m % PER_KV
        q_at = q_ptr + (q_start + qi)[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :]
        q = tl.load(q_at, mask=live[:, None] & dmask[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        k_first, k_lo, k_hi = _key_range(ctx - q_len + q0, ctx, window, POS, BLOCK_N)
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: fully masked rows stay at 0
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
        n_offs = tl.arange(0, BLOCK_N)
        for start_n in range(k_lo, k_hi, BLOCK_N):
            n = start_n + n_offs
            n_ok = (n < k_hi) & (n >= k_first)
            blk = tl.load(bt_ptr + row * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0)
            at = blk.to(tl.int64) * stride_kb + (n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
            kv_mask = n_ok[:, None] & dmask[None, :]
            k = _kv_tile(k_ptr, at, d, kv_mask, q_ptr, CODES)
            v = _kv_tile(v_ptr, at, d, kv_mask, q_ptr, CODES)
            if CODES != 0:  # scales by key
                s_at = blk.to(tl.int64) * stride_sb + (n % BLOCK_SIZE) * stride_ss + kvh
                k_scale = tl.load(ks_ptr + s_at, mask=n_ok, other=0.0)
                v_scale = tl.load(vs_ptr + s_at, mask=n_ok, other=0.0)
            p_type = v.dtype
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = _dot(q, tl.trans(k), IEEE) * scale
            if CODES != 0:
                s = s * k_scale[None, :]
            seen = live[:, None] & n_ok[None, :] & (n[None, :] <= qpos[:, None])
            seen = seen & ((window <= 0) | (qpos[:, None] - n[None, :] < window))
            s = tl.where(seen, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if CODES != 0:
                p = p * v_scale[None, :]
            p = p.to(p_type)  # the weights rounded as the values are stored, as FA2 does
            if UPCAST:
                p = p.to(tl.float32)
            acc = acc * alpha[:, None] + _dot(p, v, IEEE)
            m_i = m_new
        if SINKS:  # each head's sink: one more term of its denominator, exp(sink - m)
            sink = tl.load(sinks_ptr + heads, mask=live, other=0.0)
            l_i = l_i + tl.where(live, tl.exp(sink - m_i), 0.0)
        out = acc / tl.where(live, l_i, 1.0)[:, None]
        o_at = o_ptr + (q_start + qi)[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(o_at, out.to(o_ptr.dtype.element_ty), mask=live[:, None] & dmask[None, :])


def prefill_tile(per_kv: int) -> tuple[int, int]:
    """(query positions per tile, rows of its dots): about 64 rows of query heads x positions,
    at least 16 (``tl.dot``'s minimum)."""
    block_m = max(16, 64, triton.next_power_of_2(per_kv))
    return max(1, block_m // per_kv), block_m


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    rows: PrefillRows,
    scale: float,
    window: int | None = None,
    tiles: torch.Tensor | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Attention of ``rows`` (any number of new tokens each, see ``PrefillRows``): each query
    sees its request's keys up to its own position (the last ``window`` with a sliding
    window). ``tiles`` (``[2, n]``: row, first query; row -1 for padding) defaults to the rows'
    own tiles. A quantized cache and ``sinks`` as in ``paged_decode``."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    per_kv = num_heads // num_kv_heads
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert q.stride(2) == 1 and out.stride(2) == 1
    codes, k_cache, v_cache, ks, vs = _codes(q, k_cache, v_cache, k_scale, v_scale)
    positions, block_m = prefill_tile(per_kv)
    # Triton's interpreter multiplies 16-bit floats as raw bits in tl.dot: it gets float32
    # operands holding the same (rounded) values
    if tiles is None:
        tiles = rows.query_tiles(positions)
    n_tiles = tiles.shape[1]
    head_dim_p2 = max(16, triton.next_power_of_2(head_dim))
    grid = (n_tiles, num_kv_heads)
    _paged_prefill[grid](
        q, k_cache, v_cache, ks, vs, out, tiles, n_tiles, rows.q_starts, rows.q_lens,
        rows.seq_lens, rows.block_tables, q if sinks is None else sinks, scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), rows.block_tables.stride(0), ks.stride(0), ks.stride(1),
        PER_KV=per_kv, POS=positions, BLOCK_M=block_m, HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2, BLOCK_SIZE=block_size, BLOCK_N=32,
        IEEE=q.dtype == torch.float32, UPCAST=_INTERPRETED and q.dtype != torch.float32,
        CODES=codes, SINKS=sinks is not None,
    )  # fmt: skip


class TritonPagedBackend(PagedBackend):
    name = "triton"
    mixed_in_one = True

    decode = staticmethod(paged_decode)
    prefill = staticmethod(paged_prefill)

    def tile_positions(self, num_heads: int, num_kv_heads: int) -> int | None:
        return prefill_tile(num_heads // num_kv_heads)[0]
