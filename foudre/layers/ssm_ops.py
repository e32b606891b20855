"""The recurrent layers' decode kernels: one token per row, each row's state read and updated in
place in its pool slot (``slots[r]``), batched over rows.

- ``selective_state_update``: Mamba-2's step ``h = exp(dt A) h + dt x B^T``, ``y = h C (+ D x)``
  over a pool ``[slots, heads, head_dim, d_state]`` float32;
- ``ssd_scan``: the same recurrence token after token over the rows of a prefill (states at
  chosen tokens copied out: the prefix cache's snapshots);
- ``causal_conv1d_update``: the depthwise causal convolution of a row's new input after its
  window state ``[slots, window, channels]`` (float32 or bfloat16), which then shifts by one;
- ``gated_delta_rule_update`` (and ``gated_delta_rule_scan``, token after token over a
  prefill's rows): the gated DeltaNet step (Qwen3-Next) ``S = S exp(g)``,
  ``S += k (beta (v - S^T k))^T``, ``o = S^T q`` over a pool ``[slots, v_heads, dk, dv]``
  float32.

Each runs where it can: the C++ kernels (``native/cpu_ssm.cpp``: AVX-512, AVX2 or portable
loops, OpenMP over rows x heads) for CPU tensors, the Triton kernels (``ssm_triton``) for CUDA
ones, and the torch references here (``*_reference``, which define the results) elsewhere or
where autograd records. ``backend`` forces one ("native", "triton", "torch"; the tests run
Triton's on CPU tensors in its interpreter). The kernels leave the pools' other slots
untouched; rows must name distinct slots. ``FOUDRE_SSM_NATIVE=0`` turns the C++ kernels off.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from foudre.native import build as native

if TYPE_CHECKING:
    from foudre.attention.cache_spec import RecurrentCache

SOURCE = native.SOURCES / "cpu_ssm.cpp"
# the paths that foudre_ssm_isa() names
ISA = {0: "portable", 1: "avx2", 2: "avx512"}
_CONV_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES: dict[str, list[Any]] = {
    # state, slot_stride, slots, rows, heads, head_dim, d_state, groups, x, x_stride, dt,
    # dt_stride, a, b, b_stride, c, c_stride, d, y
    "foudre_ssm_update": [_P, _I64, _P, *[_I64] * 5, *[_P, _I64] * 2, _P, *[_P, _I64] * 2, _P, _P],
    # state, slot_stride, slots, cu, rows, heads, head_dim, d_state, groups, x, x_stride, dt,
    # dt_stride, a, b, b_stride, c, c_stride, d, snap_slot, y
    "foudre_ssm_scan": [_P, _I64, _P, _P, *[_I64] * 5, *[_P, _I64] * 2, _P, *[_P, _I64] * 2]
    + [_P] * 3,
    # state, slot_stride, slots, rows, channels, window, x, x_stride, weight, w_stride_c,
    # w_stride_k, bias, silu, out
    "foudre_conv_update_f32": [_P, _I64, _P, *[_I64] * 3, _P, _I64, _P, _I64, _I64, _P, _INT, _P],
    # state, slot_stride, slots, rows, k_heads, v_heads, dk, dv, q, q_stride, k, k_stride, v,
    # v_stride, g, g_stride, beta, beta_stride, scale, l2norm, o
    "foudre_gated_delta_update": [_P, _I64, _P, *[_I64] * 5, *[_P, _I64] * 5, _F, _INT, _P],
    # state, slot_stride, slots, cu, rows, k_heads, v_heads, dk, dv, q, q_stride, k, k_stride,
    # v, v_stride, g, g_stride, beta, beta_stride, scale, l2norm, snap_slot, o
    "foudre_gated_delta_scan": [
        _P,
        _I64,
        _P,
        _P,
        *[_I64] * 5,
        *[_P, _I64] * 5,
        _F,
        _INT,
        *[_P] * 2,
    ],
}
_SIGNATURES["foudre_conv_update_bf16"] = _SIGNATURES["foudre_conv_update_f32"]
# conv, conv_stride, state, state_stride, slots, rows, heads, head_dim, d_state, groups, window,
# conv_w, conv_b, dt_bias, a, d, dt_min, dt_max, norm_w, norm_groups, eps, norm_mode, proj,
# proj_stride, y
_SIGNATURES["foudre_mamba_decode_f32"] = [_P, _I64, _P, _I64, _P, *[_I64] * 6, *[_P] * 5]
_SIGNATURES["foudre_mamba_decode_f32"] += [_F, _F, _P, _I64, _F, _INT, _P, _I64, _P]
_SIGNATURES["foudre_mamba_decode_bf16"] = _SIGNATURES["foudre_mamba_decode_f32"]
# layer (a DeltaSlot descriptor), slots, rows, copies, num_copies, qkvz, ba, y
_SIGNATURES["foudre_deltanet_step_f32"] = [_P, _P, _I64, _P, _I64, _P, _P, _P]
_SIGNATURES["foudre_deltanet_step_bf16"] = _SIGNATURES["foudre_deltanet_step_f32"]


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The C++ kernels (built on first use), or None where they do not build or are off."""
    if os.environ.get("FOUDRE_SSM_NATIVE", "1") == "0":
        return None
    dll = native.load(SOURCE)
    if dll is None:
        return None
    for name, argtypes in _SIGNATURES.items():
        getattr(dll, name).argtypes = argtypes
        getattr(dll, name).restype = None
    dll.foudre_ssm_isa.restype = ctypes.c_int
    return dll


def native_isa() -> str | None:
    """The path the C++ kernels take on this machine ("avx512", "avx2", "portable"), or None."""
    dll = library()
    return None if dll is None else ISA[dll.foudre_ssm_isa()]


def _backend(
    backend: str,
    state: torch.Tensor,
    dtypes: tuple[torch.dtype, ...],
    *tensors: torch.Tensor | None,
) -> str:
    """The backend that runs: ``backend`` itself unless "auto"; the kernels take a pool of one
    of ``dtypes``."""
    if backend != "auto":
        if backend not in ("native", "triton", "torch"):
            raise ValueError(f"unknown backend {backend!r}")
        if backend != "torch" and state.dtype not in dtypes:
            raise ValueError(f"the {backend} kernel takes a state of {dtypes}, not {state.dtype}")
        return backend
    if state.dtype not in dtypes:
        return "torch"
    device = state.device
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return "torch"
    if device.type == "cpu":
        return "native" if library() is not None else "torch"
    if device.type == "cuda" and _triton() is not None:
        return "triton"
    return "torch"


def has_kernels(state: torch.Tensor) -> bool:
    """Whether the C++ (CPU) or Triton (CUDA) kernels run on a float32 pool like ``state``,
    where the mixers take the kernels' token-by-token scans over their chunked torch forms."""
    return _backend("auto", state, (torch.float32,)) != "torch"


@lru_cache(maxsize=1)
def _triton() -> Any:
    try:
        from foudre.layers import ssm_triton
    except ImportError:
        return None
    return ssm_triton


def _rows(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` in ``dtype`` with each row (its first index) contiguous, the rows at any stride: a
    view of the same tensor where it already is so (a split of a wider projection)."""
    if t.dtype == dtype and (t.shape[0] == 0 or t[0].is_contiguous()):
        return t
    return t.to(dtype).contiguous()


def _check_pool(state: torch.Tensor, slots: torch.Tensor, rows: int) -> None:
    if slots.shape != (rows,) or slots.dtype != torch.int64:
        raise ValueError(f"slots must be int64 [{rows}], got {slots.dtype} {tuple(slots.shape)}")
    if not state[0].is_contiguous():
        raise ValueError("each slot of the state pool must be contiguous")


# ---------------------------------------------------------------- selective state update


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    slots: torch.Tensor,
    d: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Mamba-2's one-token step for R rows: per row ``r`` and head ``h`` (group ``g = h //
    (heads // groups)``), in float32, ``state[slots[r], h] = exp(dt[r, h] a[h]) state[slots[r],
    h] + (dt[r, h] x[r, h]) b[r, g]^T`` in place, and ``y[r, h] = state[slots[r], h] c[r, g]
    (+ d[h] x[r, h])``.

    ``state [S, heads, head_dim, d_state]`` float32 (each slot contiguous), ``x [R, heads,
    head_dim]``, ``dt [R, heads]`` (after softplus and clamping), ``a [heads]`` (negative),
    ``b``, ``c [R, groups, d_state]``, ``slots [R]`` int64 and distinct, ``d [heads]`` or None.
    Returns ``y [R, heads, head_dim]`` float32."""
    rows, heads, head_dim = x.shape
    groups, d_state = b.shape[1], b.shape[2]
    if state.shape[1:] != (heads, head_dim, d_state) or heads % groups:
        raise ValueError(f"state {tuple(state.shape)} does not fit x {tuple(x.shape)}, b")
    _check_pool(state, slots, rows)
    which = _backend(backend, state, (torch.float32,), x, dt, b, c, d)
    if which == "torch" or rows == 0:
        return selective_state_update_reference(state, x, dt, a, b, c, slots, d)
    f32 = torch.float32
    x, dt, b, c = (_rows(t, f32) for t in (x, dt, b, c))
    a = a.to(f32).contiguous()
    d = None if d is None else d.to(f32).contiguous()
    if which == "triton":
        return _triton().ssm_update(state, x, dt, a, b, c, slots, d)
    dll = library()
    if dll is None:
        raise RuntimeError("the native SSM kernels are not available")
    y = torch.empty(rows, heads, head_dim, dtype=f32)
    dll.foudre_ssm_update(
        state.data_ptr(), state.stride(0), slots.data_ptr(), rows, heads, head_dim, d_state,
        groups, x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0), a.data_ptr(),
        b.data_ptr(), b.stride(0), c.data_ptr(), c.stride(0), 0 if d is None else d.data_ptr(),
        y.data_ptr(),
    )  # fmt: skip
    return y


def selective_state_update_reference(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    slots: torch.Tensor,
    d: torch.Tensor | None = None,
) -> torch.Tensor:
    """``selective_state_update`` in torch ops (the states gathered, updated and scattered)."""
    per_group = x.shape[1] // b.shape[1]
    x, dt = x.float(), dt.float()
    b = b.float().repeat_interleave(per_group, 1)  # [R, H, N]
    c = c.float().repeat_interleave(per_group, 1)
    decay = torch.exp(dt * a.float())[:, :, None, None]
    h = state[slots].float() * decay + (dt[:, :, None] * x)[..., None] * b[:, :, None, :]
    state[slots] = h.to(state.dtype)
    y = torch.einsum("rhpn,rhn->rhp", h, c)
    return y if d is None else y + x * d.float()[:, None]


# ---------------------------------------------------------------- selective scan (prefill)


def ssd_scan(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    cu_seqlens: list[int],
    slots: torch.Tensor,
    d: torch.Tensor | None = None,
    snapshots: list[tuple[int, int, int]] | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Mamba-2's recurrence over the rows of a prefill step, exactly ``selective_state_update``
    token after token: row ``r`` owns the flat tokens ``cu_seqlens[r]:cu_seqlens[r+1]`` of
    ``x [T, heads, head_dim]``, ``dt [T, heads]``, ``b``, ``c [T, groups, d_state]`` and
    continues the state at ``slots[r]`` (left there after its last token, in place); each
    ``snapshots`` entry ``(row, offset, slot)`` also leaves the state after the row's token
    ``offset`` in pool slot ``slot``. Returns ``y [T, heads, head_dim]`` float32 (``+ d x``
    where ``d`` is given). (The native and Triton kernels keep a head's state in cache or
    registers across the row's tokens: no chunked quadratic form.)"""
    t, heads, head_dim = x.shape
    groups, d_state = b.shape[1], b.shape[2]
    rows = len(cu_seqlens) - 1
    if state.shape[1:] != (heads, head_dim, d_state) or heads % groups:
        raise ValueError(f"state {tuple(state.shape)} does not fit x {tuple(x.shape)}, b")
    if cu_seqlens[-1] - cu_seqlens[0] != t:
        raise ValueError(f"cu_seqlens {cu_seqlens} does not cover the {t} tokens")
    _check_pool(state, slots, rows)
    snapshots = snapshots or []
    which = _backend(backend, state, (torch.float32,), x, dt, b, c, d)
    if which == "torch" or t == 0:
        return ssd_scan_reference(state, x, dt, a, b, c, cu_seqlens, slots, d, snapshots)
    f32 = torch.float32
    x, dt, b, c = (_rows(v, f32) for v in (x, dt, b, c))
    a = a.to(f32).contiguous()
    d = None if d is None else d.to(f32).contiguous()
    cu_t, snap = _scan_tables(cu_seqlens, snapshots, x.device)
    if which == "triton":
        return _triton().ssm_scan(state, x, dt, a, b, c, cu_t, slots, d, snap)
    dll = library()
    if dll is None:
        raise RuntimeError("the native SSM kernels are not available")
    y = torch.empty(t, heads, head_dim, dtype=f32)
    dll.foudre_ssm_scan(
        state.data_ptr(), state.stride(0), slots.data_ptr(), cu_t.data_ptr(), rows, heads,
        head_dim, d_state, groups, x.data_ptr(), x.stride(0), dt.data_ptr(), dt.stride(0),
        a.data_ptr(), b.data_ptr(), b.stride(0), c.data_ptr(), c.stride(0),
        0 if d is None else d.data_ptr(), 0 if snap is None else snap.data_ptr(), y.data_ptr(),
    )  # fmt: skip
    return y


def _scan_tables(
    cu_seqlens: list[int], snapshots: list[tuple[int, int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The scan kernels' ``cu [R + 1]`` (from 0) and, where there are snapshots, ``snap [T]``:
    the slot to copy the state into after each token (-1: none)."""
    cu = [n - cu_seqlens[0] for n in cu_seqlens]
    snap = None
    if snapshots:
        snap = torch.full((cu[-1],), -1, dtype=torch.int64)
        for row, offset, slot in snapshots:
            if not 0 <= offset < cu[row + 1] - cu[row]:
                raise ValueError(f"snapshot at {offset} outside row {row}")
            snap[cu[row] + offset] = slot
        snap = snap.to(device)
    return torch.tensor(cu, dtype=torch.int64, device=device), snap


def _by_position(
    cu_seqlens: list[int], slots: torch.Tensor
) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """For each position of the longest row: the position, the flat tokens of the rows that
    have one there, and those rows' slots (the references' loop)."""
    cu = [n - cu_seqlens[0] for n in cu_seqlens]
    lengths = [hi - lo for lo, hi in itertools.pairwise(cu)]
    for pos in range(max(lengths, default=0)):
        rows = [r for r, n in enumerate(lengths) if n > pos]
        tok = torch.tensor([cu[r] + pos for r in rows], device=slots.device)
        yield pos, tok, slots[torch.tensor(rows, device=slots.device)]


def ssd_scan_reference(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    cu_seqlens: list[int],
    slots: torch.Tensor,
    d: torch.Tensor | None = None,
    snapshots: list[tuple[int, int, int]] | None = None,
) -> torch.Tensor:
    """``ssd_scan`` in torch ops: ``selective_state_update_reference`` at each position, over
    the rows that have a token there."""
    y = x.new_empty(x.shape, dtype=torch.float32)
    for pos, tok, at in _by_position(cu_seqlens, slots):
        y[tok] = selective_state_update_reference(state, x[tok], dt[tok], a, b[tok], c[tok], at, d)
        for row, offset, slot in snapshots or []:
            if offset == pos:
                state[slot] = state[slots[row]]
    return y


# ---------------------------------------------------------------- causal conv1d update


def causal_conv1d_update(
    state: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    silu: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """The depthwise causal convolution of one new input per row: with ``win`` the row's window
    state ``state[slots[r]]`` (its last ``window`` inputs, oldest first) followed by ``x[r]``,
    ``out[r, ch] = sum_k weight[ch, k] win[k, ch] + bias[ch]`` (summed in float32, SiLU'd
    where ``silu``); then the window drops its oldest input and ends with ``x[r]``, in place.

    ``state [S, window, channels]`` (each slot contiguous; float32 or bfloat16 natively),
    ``x [R, channels]``, ``weight [channels, window + 1]`` (or nn.Conv1d's ``[channels, 1,
    window + 1]``), ``bias [channels]`` or None, ``slots [R]`` int64 and distinct. Returns ``out
    [R, channels]`` in x's dtype."""
    if weight.dim() == 3:
        weight = weight[:, 0, :]
    rows, channels = x.shape
    window = state.shape[1]
    if state.shape[2] != channels or weight.shape != (channels, window + 1):
        raise ValueError(f"conv state {tuple(state.shape)}, weight {tuple(weight.shape)}, x")
    _check_pool(state, slots, rows)
    which = _backend(backend, state, tuple(_CONV_SUFFIX), x, weight, bias)
    if which == "torch" or rows == 0:
        return causal_conv1d_update_reference(state, x, weight, bias, slots, silu)
    dtype = state.dtype
    xs = _rows(x, dtype)
    w = weight if weight.dtype == dtype else weight.to(dtype)
    bias = None if bias is None else bias.to(dtype).contiguous()
    if which == "triton":
        return _triton().conv_update(state, xs, w, bias, slots, silu).to(x.dtype)
    dll = library()
    if dll is None or dtype not in _CONV_SUFFIX:
        raise RuntimeError(f"no native conv1d update for a {dtype} state")
    out = torch.empty(rows, channels, dtype=dtype)
    getattr(dll, f"foudre_conv_update_{_CONV_SUFFIX[dtype]}")(
        state.data_ptr(), state.stride(0), slots.data_ptr(), rows, channels, window,
        xs.data_ptr(), xs.stride(0), w.data_ptr(), w.stride(0), w.stride(1),
        0 if bias is None else bias.data_ptr(), int(silu), out.data_ptr(),
    )  # fmt: skip
    return out.to(x.dtype)


def causal_conv1d_update_reference(
    state: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    slots: torch.Tensor,
    silu: bool = False,
) -> torch.Tensor:
    """``causal_conv1d_update`` in torch ops, in float32."""
    if weight.dim() == 3:
        weight = weight[:, 0, :]
    window = torch.cat([state[slots].float(), x.float()[:, None, :]], 1)  # [R, window + 1, C]
    out = (window * weight.float().t()).sum(1)
    if bias is not None:
        out = out + bias.float()
    if silu:
        out = F.silu(out)
    state[slots] = window[:, 1:].to(state.dtype)
    return out.to(x.dtype)


# ---------------------------------------------------------------- a Mamba-2 decode token


def decode_library(conv: torch.Tensor, state: torch.Tensor, dtype: torch.dtype) -> Any | None:
    """The kernels' library where a fused decode token (``mamba_decode``, ``deltanet_decode``)
    runs on these pools for inputs of ``dtype``: CPU pools, the conv window in ``dtype``
    (float32 or bfloat16), the state in float32, nothing autograd records; else None."""
    if (
        state.device.type != "cpu"
        or conv.dtype not in _CONV_SUFFIX
        or dtype != conv.dtype
        or state.dtype != torch.float32
        or torch.is_grad_enabled()
    ):
        return None
    return library()


def mamba_decode(
    conv: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    proj: torch.Tensor,
    params: MambaDecodeParams,
) -> torch.Tensor | None:
    """A Mamba-2 mixer's decode token per row between its two projections, in one C++ call:
    from in_proj's ``proj [R, z | xBC | dt]`` through the conv window (``conv [S, window,
    conv_dim]``, SiLU), ``dt`` (softplus, clamped), each head's state update (``state [S,
    heads, head_dim, d_state]`` float32, D included) and the gated RMSNorm, to ``y [R, heads *
    head_dim]`` in ``proj``'s dtype, the rows' slots updated in place. Computed in float32 from
    the conv's output on (the op-by-op path rounds each op to the model's dtype). None where the
    C++ kernels do not run this (not a CPU float32 / bfloat16 pool)."""
    dtype = conv.dtype
    dll = decode_library(conv, state, proj.dtype)
    if dll is None:
        return None
    p = params
    rows = proj.shape[0]
    _check_pool(state, slots, rows)
    proj = _rows(proj, dtype)
    y = torch.empty(rows, p.heads * p.head_dim, dtype=dtype)
    getattr(dll, f"foudre_mamba_decode_{_CONV_SUFFIX[dtype]}")(
        conv.data_ptr(), conv.stride(0), state.data_ptr(), state.stride(0), slots.data_ptr(),
        rows, p.heads, p.head_dim, p.d_state, p.groups, conv.shape[1], p.conv_w.data_ptr(),
        0 if p.conv_b is None else p.conv_b.data_ptr(), p.dt_bias.data_ptr(), p.a.data_ptr(),
        p.d.data_ptr(), p.dt_min, p.dt_max, 0 if p.norm_w is None else p.norm_w.data_ptr(),
        p.norm_groups, p.eps, p.norm_mode, proj.data_ptr(), proj.stride(0), y.data_ptr(),
    )  # fmt: skip
    return y


def mamba_step_fn(dtype: torch.dtype) -> int | None:
    """The address of ``foudre_mamba_step`` for ``dtype`` pools (float32, bfloat16): a Mamba-2
    layer's decode step for the native decoder layers (``runner/cpu_decode.py``), which call it
    with ``params.descriptor``; None where the C++ kernels do not build or are off."""
    dll = library()
    if dll is None or dtype not in _CONV_SUFFIX:
        return None
    fn = getattr(dll, f"foudre_mamba_step_{_CONV_SUFFIX[dtype]}")
    return ctypes.cast(fn, ctypes.c_void_p).value


def float_bits(x: float) -> int:
    """``x``'s float32 bits, as the C++ reads a float among int64 entries."""
    return int.from_bytes(struct.pack("<f", x), "little")


@dataclass(frozen=True, slots=True)
class MambaDecodeParams:
    """A Mamba-2 mixer's sizes and its small parameters in float32, as ``mamba_decode`` reads
    them: ``conv_w [window + 1, conv_dim]``, ``a = -exp(A_log)``; ``norm_mode`` 0 for
    ``norm(y silu(z)) w``, 1 for ``norm(y) w silu(z)``, 2 for ``y silu(z)`` (no norm)."""

    heads: int
    head_dim: int
    d_state: int
    groups: int
    conv_w: torch.Tensor
    conv_b: torch.Tensor | None
    dt_bias: torch.Tensor
    a: torch.Tensor
    d: torch.Tensor
    dt_min: float
    dt_max: float
    norm_w: torch.Tensor | None
    norm_groups: int
    eps: float
    norm_mode: int

    def descriptor(self, cache: RecurrentCache) -> list[int]:
        """The layer as ``foudre_mamba_step`` reads it (``MambaSlot`` in ``native/cpu_ssm.cpp``):
        the pools of ``cache`` at their slot strides, the sizes, the parameters' addresses and
        the floats as their float32 bits."""
        conv, ssm = cache.conv, cache.ssm
        entries = [
            conv.data_ptr(), conv.stride(0), ssm.data_ptr(), ssm.stride(0), self.heads,
            self.head_dim, self.d_state, self.groups, conv.shape[1], self.conv_w.data_ptr(),
            0 if self.conv_b is None else self.conv_b.data_ptr(), self.dt_bias.data_ptr(),
            self.a.data_ptr(), self.d.data_ptr(), float_bits(self.dt_min),
            float_bits(self.dt_max), 0 if self.norm_w is None else self.norm_w.data_ptr(),
            self.norm_groups, float_bits(self.eps), self.norm_mode,
        ]  # fmt: skip
        dll = library()
        assert dll is None or len(entries) == dll.foudre_mamba_slots(), "MambaSlot drifted"
        return entries


# ---------------------------------------------------------------- gated delta rule


def gated_delta_rule_update(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    l2norm: bool = False,
    backend: str = "auto",
) -> torch.Tensor:
    """The gated delta rule's one-token step (gated DeltaNet, as Qwen3-Next's decode): per row
    ``r`` and value head ``h`` (key head ``h // (v_heads // k_heads)``), in float32, with
    ``S = state[slots[r], h]`` ``[dk, dv]``, ``q`` and ``k`` L2-normalized first where
    ``l2norm`` (``x / sqrt(sum x^2 + 1e-6)``) and ``q`` times ``scale`` (default
    ``dk ** -0.5``)::

        S = S * exp(g[r, h])
        S = S + k (beta[r, h] (v[r, h] - S^T k))^T        (in place)
        o[r, h] = S^T q

    ``state [S, v_heads, dk, dv]`` float32 (each slot contiguous), ``q``, ``k [R, k_heads,
    dk]``, ``v [R, v_heads, dv]``, ``g [R, v_heads]`` (the log decay, <= 0), ``beta [R,
    v_heads]`` (after sigmoid), ``slots [R]`` int64 and distinct. Returns ``o [R, v_heads,
    dv]`` float32."""
    rows, k_heads, dk = k.shape
    v_heads, dv = v.shape[1], v.shape[2]
    if state.shape[1:] != (v_heads, dk, dv) or v_heads % k_heads or q.shape != k.shape:
        raise ValueError(f"state {tuple(state.shape)} does not fit q/k {tuple(k.shape)}, v")
    _check_pool(state, slots, rows)
    scale = dk**-0.5 if scale is None else scale
    which = _backend(backend, state, (torch.float32,), q, k, v, g, beta)
    if which == "torch" or rows == 0:
        return gated_delta_rule_update_reference(state, q, k, v, g, beta, slots, scale, l2norm)
    q, k, v, g, beta = (_rows(t, torch.float32) for t in (q, k, v, g, beta))
    if which == "triton":
        return _triton().gated_delta_update(state, q, k, v, g, beta, slots, scale, l2norm)
    dll = library()
    if dll is None:
        raise RuntimeError("the native SSM kernels are not available")
    o = torch.empty(rows, v_heads, dv, dtype=torch.float32)
    dll.foudre_gated_delta_update(
        state.data_ptr(), state.stride(0), slots.data_ptr(), rows, k_heads, v_heads, dk, dv,
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        g.data_ptr(), g.stride(0), beta.data_ptr(), beta.stride(0), scale, int(l2norm),
        o.data_ptr(),
    )  # fmt: skip
    return o


def gated_delta_rule_update_reference(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    l2norm: bool = False,
) -> torch.Tensor:
    """``gated_delta_rule_update`` in torch ops (the states gathered, updated and scattered)."""
    per_k = v.shape[1] // k.shape[1]
    q = q.float().repeat_interleave(per_k, 1)  # [R, HV, dk]
    k = k.float().repeat_interleave(per_k, 1)
    if l2norm:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    s = state[slots].float() * torch.exp(g.float())[:, :, None, None]  # [R, HV, dk, dv]
    kv = (s * k[..., None]).sum(-2)  # S^T k: [R, HV, dv]
    delta = (v.float() - kv) * beta.float()[..., None]
    s = s + k[..., None] * delta[:, :, None, :]
    state[slots] = s.to(state.dtype)
    return (s * q[..., None]).sum(-2)


def gated_delta_rule_scan(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: list[int],
    slots: torch.Tensor,
    scale: float | None = None,
    l2norm: bool = False,
    snapshots: list[tuple[int, int, int]] | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The gated delta rule over the rows of a prefill step, exactly ``gated_delta_rule_update``
    token after token: row ``r`` owns the flat tokens ``cu_seqlens[r]:cu_seqlens[r+1]`` of
    ``q``, ``k [T, k_heads, dk]``, ``v [T, v_heads, dv]``, ``g``, ``beta [T, v_heads]`` and
    continues the state at ``slots[r]`` (left there after its last token, in place); each
    ``snapshots`` entry ``(row, offset, slot)`` also leaves the state after the row's token
    ``offset`` in pool slot ``slot``. Returns ``o [T, v_heads, dv]`` float32. (Token by token:
    the work of the chunked form's ``dk x dv`` per token and head, without its matmuls; the
    state stays in cache or registers across a row.)"""
    t, k_heads, dk = k.shape
    v_heads, dv = v.shape[1], v.shape[2]
    rows = len(cu_seqlens) - 1
    if state.shape[1:] != (v_heads, dk, dv) or v_heads % k_heads or q.shape != k.shape:
        raise ValueError(f"state {tuple(state.shape)} does not fit q/k {tuple(k.shape)}, v")
    if cu_seqlens[-1] - cu_seqlens[0] != t:
        raise ValueError(f"cu_seqlens {cu_seqlens} does not cover the {t} tokens")
    _check_pool(state, slots, rows)
    scale = dk**-0.5 if scale is None else scale
    snapshots = snapshots or []
    which = _backend(backend, state, (torch.float32,), q, k, v, g, beta)
    if which == "torch" or t == 0:
        return gated_delta_rule_scan_reference(
            state, q, k, v, g, beta, cu_seqlens, slots, scale, l2norm, snapshots
        )
    q, k, v, g, beta = (_rows(x, torch.float32) for x in (q, k, v, g, beta))
    cu, snap = _scan_tables(cu_seqlens, snapshots, v.device)
    if which == "triton":
        return _triton().gated_delta_scan(state, q, k, v, g, beta, cu, slots, scale, l2norm, snap)
    dll = library()
    if dll is None:
        raise RuntimeError("the native SSM kernels are not available")
    o = torch.empty(t, v_heads, dv, dtype=torch.float32)
    dll.foudre_gated_delta_scan(
        state.data_ptr(), state.stride(0), slots.data_ptr(), cu.data_ptr(), rows, k_heads,
        v_heads, dk, dv, q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(),
        v.stride(0), g.data_ptr(), g.stride(0), beta.data_ptr(), beta.stride(0), scale,
        int(l2norm), 0 if snap is None else snap.data_ptr(), o.data_ptr(),
    )  # fmt: skip
    return o


def gated_delta_rule_scan_reference(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: list[int],
    slots: torch.Tensor,
    scale: float | None = None,
    l2norm: bool = False,
    snapshots: list[tuple[int, int, int]] | None = None,
) -> torch.Tensor:
    """``gated_delta_rule_scan`` in torch ops: ``gated_delta_rule_update_reference`` at each
    position, over the rows that have a token there."""
    o = v.new_empty(v.shape, dtype=torch.float32)
    for pos, tok, at in _by_position(cu_seqlens, slots):
        o[tok] = gated_delta_rule_update_reference(
            state, q[tok], k[tok], v[tok], g[tok], beta[tok], at, scale, l2norm
        )
        for row, offset, slot in snapshots or []:
            if offset == pos:
                state[slot] = state[slots[row]]
    return o


# ---------------------------------------------------------------- gated DeltaNet decode step


def deltanet_step_fn(dtype: torch.dtype) -> int | None:
    """The address of ``foudre_deltanet_step`` for ``dtype`` pools (float32, bfloat16): a gated
    DeltaNet layer's decode token for the native decoder layers (``runner/cpu_decode.py``),
    which call it with ``params.descriptor``; None where the C++ kernels do not build or are
    off."""
    dll = library()
    if dll is None or dtype not in _CONV_SUFFIX:
        return None
    fn = getattr(dll, f"foudre_deltanet_step_{_CONV_SUFFIX[dtype]}")
    return ctypes.cast(fn, ctypes.c_void_p).value


@dataclass(frozen=True, slots=True)
class DeltaNetDecodeParams:
    """A gated DeltaNet mixer's sizes and small parameters as ``deltanet_step`` reads them:
    float32 ``conv_w [window + 1, conv_dim]``, ``a = -exp(A_log)`` and ``dt_bias``; the gated
    norm's ``norm_w`` in the model's dtype (its own parameter) and ``eps``; ``scale``: q's
    (``key_head_dim ** -0.5``)."""

    k_heads: int
    v_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_w: torch.Tensor
    a: torch.Tensor
    dt_bias: torch.Tensor
    norm_w: torch.Tensor
    eps: float
    scale: float

    def descriptor(self, cache: RecurrentCache) -> list[int]:
        """The layer as ``foudre_deltanet_step`` reads it (``DeltaSlot`` in
        ``native/cpu_ssm.cpp``): the pools of ``cache`` at their slot strides, the sizes, the
        parameters' addresses and the floats as their float32 bits."""
        conv, ssm = cache.conv, cache.ssm
        entries = [
            conv.data_ptr(), conv.stride(0), ssm.data_ptr(), ssm.stride(0), self.k_heads,
            self.v_heads, self.key_head_dim, self.value_head_dim, conv.shape[1],
            self.conv_w.data_ptr(), self.a.data_ptr(), self.dt_bias.data_ptr(),
            self.norm_w.data_ptr(), float_bits(self.eps), float_bits(self.scale),
        ]  # fmt: skip
        dll = library()
        assert dll is None or len(entries) == dll.foudre_deltanet_slots(), "DeltaSlot drifted"
        return entries


def deltanet_decode(
    cache: RecurrentCache,
    slots: torch.Tensor,
    qkvz: torch.Tensor,
    ba: torch.Tensor,
    params: DeltaNetDecodeParams,
) -> torch.Tensor | None:
    """A gated DeltaNet mixer's decode token per row between its projections, in one C++ call
    (``foudre_deltanet_step``): from ``qkvz [R, k_heads * (2 dk + 2 r dv)]`` and ``ba [R, 2
    v_heads]`` (the projections' per-key-head groups) through the conv window (``cache.conv
    [S, window, conv_dim]``, rounded to the model's dtype, then SiLU, rounded), the gates, the
    delta rule on ``cache.ssm [S, v_heads, dk, dv]`` float32 (q and k L2-normalised, q scaled)
    and the gated RMSNorm, to ``y [R, v_heads * dv]`` in the model's dtype, the rows' slots
    (distinct) updated in place. It rounds where the op-by-op path does. None where the C++
    kernels do not run this (not a CPU float32 / bfloat16 pool of that dtype, autograd)."""
    conv, state = cache.conv, cache.ssm
    dtype = conv.dtype
    dll = decode_library(conv, state, qkvz.dtype)
    if dll is None or ba.dtype != dtype or params.norm_w.dtype != dtype:
        return None
    rows = qkvz.shape[0]
    _check_pool(state, slots, rows)
    if not conv[0].is_contiguous():
        raise ValueError("each slot of the conv pool must be contiguous")
    qkvz, ba, slots = qkvz.contiguous(), ba.contiguous(), slots.contiguous()
    layer = torch.tensor(params.descriptor(cache), dtype=torch.int64)
    y = torch.empty(rows, params.v_heads * params.value_head_dim, dtype=dtype)
    getattr(dll, f"foudre_deltanet_step_{_CONV_SUFFIX[dtype]}")(
        layer.data_ptr(), slots.data_ptr(), rows, 0, 0, qkvz.data_ptr(), ba.data_ptr(),
        y.data_ptr(),
    )  # fmt: skip
    return y
