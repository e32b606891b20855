"""The recurrent layers' decode kernels on CUDA, in Triton (``layers/ssm_ops.py`` dispatches to
them and holds their torch references): each reads a row's state in its pool slot, updates it
in place and writes the row's output; nothing is gathered into a batch or scattered back.

- ``_ssm_update``: one program per (row, head, block of head_dim): the state tile ``[BLOCK_P,
  d_state]`` ``h = exp(dt a) h + (dt x) B^T``, then ``y = h C (+ D x)``;
- ``_ssm_scan``: the same programs over each row's tokens of a prefill, the tile kept in
  registers between tokens (the state written back once, and after each token that the
  prefix cache snapshots);
- ``_conv_update``: one program per (row, block of channels): the window's taps and the new
  input against the weight, then the window shifts by one (each channel is its program's);
- ``_delta_update``: one program per (row, value head, block of dv): the columns ``[dk,
  BLOCK_V]`` of the state, which the gated delta rule updates independently of the others
  (``S^T k`` and ``S^T q`` are sums over dk); ``_delta_scan`` the same over a prefill's rows,
  token after token.

All arithmetic is float32. Imported lazily, only where Triton imports; with
``TRITON_INTERPRET=1`` the kernels run on CPU tensors, which is how the tests check them without
a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _ssm_update(
    state_ptr, slots_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr,
    slot_stride, x_stride, dt_stride, b_stride, c_stride, heads, per_group,
    HEAD_DIM: tl.constexpr, D_STATE: tl.constexpr, BLOCK_P: tl.constexpr,
    N_P2: tl.constexpr, HAS_D: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, N_P2)
    slot = tl.load(slots_ptr + r)
    grp = h // per_group
    pm, nm = p < HEAD_DIM, n < D_STATE
    ptrs = state_ptr + slot * slot_stride + h * (HEAD_DIM * D_STATE) + p[:, None] * D_STATE
    ptrs += n[None, :]
    mask = pm[:, None] & nm[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0)
    dt = tl.load(dt_ptr + r * dt_stride + h)
    decay = tl.exp(dt * tl.load(a_ptr + h))
    x = tl.load(x_ptr + r * x_stride + h * HEAD_DIM + p, mask=pm, other=0.0)
    b = tl.load(b_ptr + r * b_stride + grp * D_STATE + n, mask=nm, other=0.0)
    c = tl.load(c_ptr + r * c_stride + grp * D_STATE + n, mask=nm, other=0.0)
    s = s * decay + (dt * x)[:, None] * b[None, :]
    tl.store(ptrs, s, mask=mask)
    y = tl.sum(s * c[None, :], axis=1)
    if HAS_D:
        y += x * tl.load(d_ptr + h)
    tl.store(y_ptr + (r * heads + h) * HEAD_DIM + p, y, mask=pm)


def ssm_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    slots: torch.Tensor,
    d: torch.Tensor | None,
) -> torch.Tensor:
    """``ssm_ops.selective_state_update`` (float32 inputs, each row contiguous)."""
    rows, heads, head_dim = x.shape
    groups, d_state = b.shape[1], b.shape[2]
    y = torch.empty(rows, heads, head_dim, dtype=torch.float32, device=x.device)
    n_p2 = triton.next_power_of_2(d_state)
    block_p = min(triton.next_power_of_2(head_dim), max(1, 4096 // n_p2))
    grid = (rows, heads, triton.cdiv(head_dim, block_p))
    _ssm_update[grid](
        state, slots, x, dt, a, b, c, a if d is None else d, y,
        state.stride(0), x.stride(0), dt.stride(0), b.stride(0), c.stride(0), heads,
        heads // groups, HEAD_DIM=head_dim, D_STATE=d_state, BLOCK_P=block_p, N_P2=n_p2,
        HAS_D=d is not None,
    )  # fmt: skip
    return y


@triton.jit
def _ssm_scan(
    state_ptr, slots_ptr, cu_ptr, snap_ptr, x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_ptr, y_ptr,
    slot_stride, x_stride, dt_stride, b_stride, c_stride, heads, per_group,
    HEAD_DIM: tl.constexpr, D_STATE: tl.constexpr, BLOCK_P: tl.constexpr,
    N_P2: tl.constexpr, HAS_D: tl.constexpr, SNAPS: tl.constexpr,
):  # fmt: skip
    """``_ssm_update`` over a row's tokens, the state tile kept in registers between them."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, N_P2)
    grp = h // per_group
    pm, nm = p < HEAD_DIM, n < D_STATE
    mask = pm[:, None] & nm[None, :]
    tile = h * (HEAD_DIM * D_STATE) + p[:, None] * D_STATE + n[None, :]
    ptrs = state_ptr + tl.load(slots_ptr + r) * slot_stride + tile
    s = tl.load(ptrs, mask=mask, other=0.0)
    a = tl.load(a_ptr + h)
    for t in range(tl.load(cu_ptr + r), tl.load(cu_ptr + r + 1)):
        dt = tl.load(dt_ptr + t * dt_stride + h)
        x = tl.load(x_ptr + t * x_stride + h * HEAD_DIM + p, mask=pm, other=0.0)
        b = tl.load(b_ptr + t * b_stride + grp * D_STATE + n, mask=nm, other=0.0)
        c = tl.load(c_ptr + t * c_stride + grp * D_STATE + n, mask=nm, other=0.0)
        s = s * tl.exp(dt * a) + (dt * x)[:, None] * b[None, :]
        y = tl.sum(s * c[None, :], axis=1)
        if HAS_D:
            y += x * tl.load(d_ptr + h)
        tl.store(y_ptr + (t * heads + h) * HEAD_DIM + p, y, mask=pm)
        if SNAPS:
            snap = tl.load(snap_ptr + t)
            if snap >= 0:
                tl.store(state_ptr + snap * slot_stride + tile, s, mask=mask)
    tl.store(ptrs, s, mask=mask)


def ssm_scan(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
    d: torch.Tensor | None,
    snap: torch.Tensor | None,
) -> torch.Tensor:
    """``ssm_ops.ssd_scan`` (float32 inputs, each token's row contiguous; ``cu [R + 1]`` from 0,
    ``snap [T]``: the slot to copy the state into after each token, -1 none)."""
    t, heads, head_dim = x.shape
    groups, d_state = b.shape[1], b.shape[2]
    y = torch.empty(t, heads, head_dim, dtype=torch.float32, device=x.device)
    n_p2 = triton.next_power_of_2(d_state)
    block_p = min(triton.next_power_of_2(head_dim), max(1, 4096 // n_p2))
    grid = (slots.shape[0], heads, triton.cdiv(head_dim, block_p))
    _ssm_scan[grid](
        state, slots, cu, cu if snap is None else snap, x, dt, a, b, c, a if d is None else d,
        y, state.stride(0), x.stride(0), dt.stride(0), b.stride(0), c.stride(0), heads,
        heads // groups, HEAD_DIM=head_dim, D_STATE=d_state, BLOCK_P=block_p, N_P2=n_p2,
        HAS_D=d is not None, SNAPS=snap is not None,
    )  # fmt: skip
    return y


@triton.jit
def _conv_update(
    state_ptr, slots_ptr, x_ptr, w_ptr, bias_ptr, out_ptr,
    slot_stride, x_stride, w_stride_c, w_stride_k, channels,
    WINDOW: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    ch = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = ch < channels
    base = state_ptr + tl.load(slots_ptr + r) * slot_stride + ch
    x = tl.load(x_ptr + r * x_stride + ch, mask=cm, other=0.0)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for k in tl.static_range(WINDOW):
        tap = tl.load(base + k * channels, mask=cm, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ch * w_stride_c + k * w_stride_k, mask=cm, other=0.0)
        acc += tap * w.to(tl.float32)
    w = tl.load(w_ptr + ch * w_stride_c + WINDOW * w_stride_k, mask=cm, other=0.0)
    acc += x.to(tl.float32) * w.to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + ch, mask=cm, other=0.0).to(tl.float32)
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    for k in tl.static_range(WINDOW - 1):  # the window drops its oldest input
        tl.store(base + k * channels, tl.load(base + (k + 1) * channels, mask=cm), mask=cm)
    if WINDOW > 0:
        tl.store(base + (WINDOW - 1) * channels, x, mask=cm)
    tl.store(out_ptr + r * channels + ch, acc.to(out_ptr.dtype.element_ty), mask=cm)


def conv_update(
    state: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    silu: bool,
) -> torch.Tensor:
    """``ssm_ops.causal_conv1d_update`` (``x``, ``weight`` and ``bias`` in the state's dtype;
    ``out`` too)."""
    rows, channels = x.shape
    out = torch.empty(rows, channels, dtype=state.dtype, device=x.device)
    block_c = min(triton.next_power_of_2(channels), 256)
    grid = (rows, triton.cdiv(channels, block_c))
    _conv_update[grid](
        state, slots, x, weight, weight if bias is None else bias, out,
        state.stride(0), x.stride(0), weight.stride(0), weight.stride(1), channels,
        WINDOW=state.shape[1], BLOCK_C=block_c, HAS_BIAS=bias is not None, SILU=silu,
    )  # fmt: skip
    return out


@triton.jit
def _delta_update(
    state_ptr, slots_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    slot_stride, q_stride, k_stride, v_stride, g_stride, beta_stride, v_heads, per_k, scale,
    DK: tl.constexpr, DV: tl.constexpr, DK_P2: tl.constexpr, BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    i = tl.arange(0, DK_P2)
    im, jm = i < DK, j < DV
    hk = h // per_k
    q = tl.load(q_ptr + r * q_stride + hk * DK + i, mask=im, other=0.0)
    k = tl.load(k_ptr + r * k_stride + hk * DK + i, mask=im, other=0.0)
    if L2NORM:
        q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
        k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    q = q * scale
    ptrs = state_ptr + tl.load(slots_ptr + r) * slot_stride + h * (DK * DV)
    ptrs += i[:, None] * DV + j[None, :]
    mask = im[:, None] & jm[None, :]
    s = tl.load(ptrs, mask=mask, other=0.0)
    s = s * tl.exp(tl.load(g_ptr + r * g_stride + h))
    kv = tl.sum(s * k[:, None], axis=0)
    v = tl.load(v_ptr + r * v_stride + h * DV + j, mask=jm, other=0.0)
    delta = (v - kv) * tl.load(beta_ptr + r * beta_stride + h)
    s = s + k[:, None] * delta[None, :]
    tl.store(ptrs, s, mask=mask)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(o_ptr + (r * v_heads + h) * DV + j, o, mask=jm)


def gated_delta_update(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    l2norm: bool,
) -> torch.Tensor:
    """``ssm_ops.gated_delta_rule_update`` (float32 inputs, each row contiguous)."""
    rows, k_heads, dk = k.shape
    v_heads, dv = v.shape[1], v.shape[2]
    o = torch.empty(rows, v_heads, dv, dtype=torch.float32, device=v.device)
    dk_p2 = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), max(16, 8192 // dk_p2))
    grid = (rows, v_heads, triton.cdiv(dv, block_v))
    _delta_update[grid](
        state, slots, q, k, v, g, beta, o,
        state.stride(0), q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
        v_heads, v_heads // k_heads, scale,
        DK=dk, DV=dv, DK_P2=dk_p2, BLOCK_V=block_v, L2NORM=l2norm,
    )  # fmt: skip
    return o


@triton.jit
def _delta_scan(
    state_ptr, slots_ptr, cu_ptr, snap_ptr, q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, o_ptr,
    slot_stride, q_stride, k_stride, v_stride, g_stride, beta_stride, v_heads, per_k, scale,
    DK: tl.constexpr, DV: tl.constexpr, DK_P2: tl.constexpr, BLOCK_V: tl.constexpr,
    L2NORM: tl.constexpr, SNAPS: tl.constexpr,
):  # fmt: skip
    """``_delta_update`` over a row's tokens, the state's columns kept in registers."""
    r = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    i = tl.arange(0, DK_P2)
    im, jm = i < DK, j < DV
    hk = h // per_k
    tile = h * (DK * DV) + i[:, None] * DV + j[None, :]
    mask = im[:, None] & jm[None, :]
    ptrs = state_ptr + tl.load(slots_ptr + r) * slot_stride + tile
    s = tl.load(ptrs, mask=mask, other=0.0)
    for t in range(tl.load(cu_ptr + r), tl.load(cu_ptr + r + 1)):
        q = tl.load(q_ptr + t * q_stride + hk * DK + i, mask=im, other=0.0)
        k = tl.load(k_ptr + t * k_stride + hk * DK + i, mask=im, other=0.0)
        if L2NORM:
            q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6)
            k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q * scale
        s = s * tl.exp(tl.load(g_ptr + t * g_stride + h))
        kv = tl.sum(s * k[:, None], axis=0)
        v = tl.load(v_ptr + t * v_stride + h * DV + j, mask=jm, other=0.0)
        delta = (v - kv) * tl.load(beta_ptr + t * beta_stride + h)
        s = s + k[:, None] * delta[None, :]
        tl.store(o_ptr + (t * v_heads + h) * DV + j, tl.sum(s * q[:, None], axis=0), mask=jm)
        if SNAPS:
            snap = tl.load(snap_ptr + t)
            if snap >= 0:
                tl.store(state_ptr + snap * slot_stride + tile, s, mask=mask)
    tl.store(ptrs, s, mask=mask)


def gated_delta_scan(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu: torch.Tensor,
    slots: torch.Tensor,
    scale: float,
    l2norm: bool,
    snap: torch.Tensor | None,
) -> torch.Tensor:
    """``ssm_ops.gated_delta_rule_scan`` (float32 inputs, each token's row contiguous; ``cu``
    and ``snap`` as ``ssm_scan``'s)."""
    t, k_heads, dk = k.shape
    v_heads, dv = v.shape[1], v.shape[2]
    o = torch.empty(t, v_heads, dv, dtype=torch.float32, device=v.device)
    dk_p2 = triton.next_power_of_2(dk)
    block_v = min(triton.next_power_of_2(dv), max(16, 8192 // dk_p2))
    grid = (slots.shape[0], v_heads, triton.cdiv(dv, block_v))
    _delta_scan[grid](
        state, slots, cu, cu if snap is None else snap, q, k, v, g, beta, o,
        state.stride(0), q.stride(0), k.stride(0), v.stride(0), g.stride(0), beta.stride(0),
        v_heads, v_heads // k_heads, scale,
        DK=dk, DV=dv, DK_P2=dk_p2, BLOCK_V=block_v, L2NORM=l2norm, SNAPS=snap is not None,
    )  # fmt: skip
    return o
