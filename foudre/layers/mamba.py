"""The Mamba-2 mixer (state space duality, SSD) over a flat batch of rows, its per-request state
passed in as explicit tensors.

One mixer turns ``x [T, hidden]`` (the new tokens of R rows, flattened as the attention backends
take them: row ``r`` owns tokens ``cu[r]:cu[r+1]``) into ``[T, hidden]``::

    in_proj ─▶ z | xBC | dt
    xBC ─▶ causal depthwise conv1d (window d_conv, continuing the row's conv state) ─▶ silu
        ─▶ x [heads, head_dim] | B [groups, d_state] | C [groups, d_state]
    dt ─▶ softplus(dt + dt_bias) (clamped to time_step_limit)
    SSD: h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T      y_t = h_t C_t + D x_t
    y ─▶ gated RMSNorm (y * silu(z), normalised per group) ─▶ out_proj

Each row continues from its state and leaves its state updated in place, so a prompt may come in
chunks (chunked prefill) and decode is the same call with one token per row. Prefill runs the
scan kernel (``ssm_ops.ssd_scan``: token by token in C++ or Triton), or where none runs the
chunked scan in torch (quadratic within a chunk of ``chunk_size`` tokens, a recurrence across
chunks: no Python loop over tokens); a step where every row has one token runs the one-step
recurrence (on the CPU: ``ssm_ops.mamba_decode``, one call between the projections).

Per request and per Mamba layer the state is (``RecurrentStateSpec``):

- conv state ``[d_conv - 1, conv_dim]``: the last ``d_conv - 1`` inputs of the convolution
  (``conv_dim = heads * head_dim + 2 * groups * d_state``), in the model dtype;
- SSM state ``[heads, head_dim, d_state]``, float32 (it accumulates over the whole sequence).

A fresh request starts from zeros in both. The states of all requests live in pools
``[slots, ...]`` (``RecurrentStates``); a step names each row's slot (``RecurrentBatch``).

The engine holds the pools and hands the slots out (``engine/state_slots.py``, ``docs/
architecture.md`` section 14): a slot per request, copied for forks; the prefix cache's
snapshots are slots too, which a step fills with the state after a chosen token of a row
(``RecurrentBatch.snapshots``: the scan reports the state at those offsets).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from foudre.attention.cache_spec import RecurrentCache, RecurrentStateSpec
from foudre.layers.linear import Linear
from foudre.layers.ssm_ops import (
    MambaDecodeParams,
    causal_conv1d_update,
    has_kernels,
    mamba_decode,
    selective_state_update,
    ssd_scan,
)

# The scan's chunk: its work per token grows with the chunk (the quadratic form within it), its
# Python loop with the number of chunks. The config's chunk_size tunes GPU kernels; the result
# does not depend on it (exact arithmetic), so the scan takes at most this many tokens a chunk.
SCAN_CHUNK = 64
# the most elements of the scan's [rows, chunks, chunk, chunk, heads] products at a time
SCAN_ELEMENTS = 1 << 22
GATE_NORMS = ("after_gate", "before_gate", "none")


@dataclass(frozen=True, slots=True)
class Mamba2Shape:
    """The sizes of one Mamba-2 mixer."""

    hidden_size: int
    num_heads: int
    head_dim: int
    state_size: int  # d_state
    n_groups: int  # B and C are shared by num_heads // n_groups heads each
    conv_kernel: int  # d_conv
    chunk_size: int
    conv_bias: bool = True
    proj_bias: bool = False
    eps: float = 1e-5  # of the gated RMSNorm
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    out_proj_bias: bool | None = None  # None: as proj_bias (Falcon-H1 sets its own)
    # where the output's RMSNorm stands against its gate silu(z): "after_gate" norm(y * silu(z))
    # (Mamba-2), "before_gate" norm(y) * silu(z), "none" y * silu(z) (Falcon-H1's options)
    gate_norm: str = "after_gate"

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Mamba-2 {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.n_groups:
            raise ValueError(
                f"Mamba-2 n_groups={self.n_groups} must divide num_heads={self.num_heads}"
            )
        if self.chunk_size <= 0:
            raise ValueError(f"Mamba-2 chunk_size must be positive, got {self.chunk_size}")
        if self.gate_norm not in GATE_NORMS:
            raise ValueError(
                f"Mamba-2 gate_norm must be one of {GATE_NORMS}, got {self.gate_norm!r}"
            )

    @property
    def intermediate_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate_size + 2 * self.n_groups * self.state_size

    @property
    def projection_size(self) -> int:
        """in_proj's outputs: z, xBC, dt."""
        return self.intermediate_size + self.conv_dim + self.num_heads

    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(
            self.conv_kernel - 1, self.conv_dim, self.num_heads, self.head_dim, self.state_size
        )


@dataclass(slots=True)
class RecurrentBatch:
    """One step's rows as the Mamba layers see them: row ``r`` owns the flat tokens
    ``cu_seqlens[r]:cu_seqlens[r+1]`` and continues the state in pool slot ``slots[r]``.
    The index tensors every layer uses are built once here: rows of one token (decode) take
    the one-step recurrence, the others (prefill chunks) the chunked scan, padded to the
    longest of them only."""

    cu_seqlens: list[int]
    slots: torch.Tensor  # [R] int64, on the states' device
    # (row, offset, slot): also leave the state after the row's new token ``offset`` in pool
    # slot ``slot`` (the prefix cache's snapshots at block ends)
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    lengths: list[int] = field(init=False)
    max_len: int = field(init=False)
    token_row: torch.Tensor = field(init=False)  # [T] the row of each flat token
    token_pos: torch.Tensor = field(init=False)  # [T] its index within its row
    one_tokens: torch.Tensor = field(init=False)  # the flat tokens of one-token rows
    one_slots: torch.Tensor = field(init=False)  # their rows' slots
    scan_tokens: torch.Tensor = field(init=False)  # the flat tokens of the longer rows
    scan_slots: torch.Tensor = field(init=False)  # [R'] their rows' slots
    scan_row: torch.Tensor = field(init=False)  # per scan token, its row among the R'
    scan_len: int = field(init=False)  # the longest of them
    scan_index: torch.Tensor = field(init=False)  # [R] a row's index among the R' (-1: none)
    snap_row: torch.Tensor = field(init=False)  # [K] the snapshots' rows
    snap_pos: torch.Tensor = field(init=False)  # [K] their offsets within their rows
    snap_slots: torch.Tensor = field(init=False)  # [K] the slots they fill
    _scan_layout: tuple[list[int], list[tuple[int, int, int]]] | None = field(
        init=False, default=None
    )

    def __post_init__(self) -> None:
        cu = self.cu_seqlens
        self.lengths = [b - a for a, b in itertools.pairwise(cu)]
        if len(self.lengths) != self.slots.numel() or any(n <= 0 for n in self.lengths):
            raise ValueError("RecurrentBatch: one slot per row, every row at least one token")
        self.max_len = max(self.lengths)
        device = self.slots.device
        lengths = torch.tensor(self.lengths, device=device)
        rows = torch.arange(len(self.lengths), device=device)
        self.token_row = rows.repeat_interleave(lengths)
        starts = torch.tensor(cu[:-1], device=device).repeat_interleave(lengths)
        self.token_pos = torch.arange(cu[-1] - cu[0], device=device) + cu[0] - starts
        one = lengths == 1
        self.one_slots = self.slots[one]
        one_token = one[self.token_row]
        self.one_tokens = one_token.nonzero().flatten()
        self.scan_tokens = (~one_token).nonzero().flatten()
        self.scan_slots = self.slots[~one]
        renumber = torch.cumsum((~one).long(), 0) - 1  # a longer row's index among them
        self.scan_row = renumber[self.token_row[self.scan_tokens]]
        self.scan_len = max((n for n in self.lengths if n > 1), default=0)
        self.scan_index = torch.where(~one, renumber, -1)
        for row, offset, _ in self.snapshots:
            if not 0 <= offset < self.lengths[row]:
                raise ValueError(f"RecurrentBatch: snapshot at {offset} outside row {row}")
        snaps = list(zip(*self.snapshots, strict=True)) or [(), (), ()]
        self.snap_row, self.snap_pos, self.snap_slots = (
            torch.tensor(v, dtype=torch.int64, device=device) for v in snaps
        )

    @property
    def is_decode(self) -> bool:
        return self.max_len == 1

    def scan_layout(self) -> tuple[list[int], list[tuple[int, int, int]]]:
        """The rows of more than one token as the scan kernels take them (their tokens
        ``scan_tokens``, in order): their ``cu_seqlens`` from 0, and the snapshots that fall
        in them, each ``(row among them, offset, slot)`` (built once a step, for every layer)."""
        if self._scan_layout is not None:
            return self._scan_layout
        cu, index = [0], {}
        for r, n in enumerate(self.lengths):
            if n > 1:
                index[r] = len(cu) - 1
                cu.append(cu[-1] + n)
        snaps = [(index[r], o, slot) for r, o, slot in self.snapshots if r in index]
        self._scan_layout = (cu, snaps)
        return cu, snaps

    @classmethod
    def of_lengths(
        cls,
        lengths: list[int],
        slots: list[int],
        device: torch.device,
        snapshots: list[tuple[int, int, int]] | None = None,
    ) -> RecurrentBatch:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        return cls(cu, torch.tensor(slots, dtype=torch.int64, device=device), snapshots or [])


class RecurrentStates:
    """Recurrent state pools for drivers outside the engine (the model oracles): per recurrent
    layer a ``RecurrentCache`` of ``num_slots`` slots, with a free list. The engine keeps its
    own (``runner/model_runner.py``; slots handed out by ``engine/kv_cache.py``)."""

    def __init__(
        self,
        specs: list[RecurrentStateSpec],
        num_slots: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.specs = specs
        self.caches = [s.allocate(num_slots, dtype, torch.device(device)) for s in specs]
        self.free_slots = list(range(num_slots))[::-1]

    @classmethod
    def of_model(
        cls, model: Any, num_slots: int, device: torch.device | str = "cpu"
    ) -> RecurrentStates:
        """Pools for the recurrent layers of ``model`` (its ``kv_cache_specs``), the conv
        windows in its weights' dtype."""
        specs = [s for s in model.kv_cache_specs() if isinstance(s, RecurrentStateSpec)]
        dtype = next(model.parameters()).dtype
        return cls(specs, num_slots, dtype, device)

    def allocate(self) -> int:
        """A free slot, zeroed (a fresh request's state)."""
        if not self.free_slots:
            raise RuntimeError("no free recurrent state slot")
        slot = self.free_slots.pop()
        for cache in self.caches:
            cache.conv[slot].zero_()
            cache.ssm[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)

    def fork(self, slot: int) -> int:
        """A new slot holding a copy of ``slot``'s state (``n`` > 1, beam search)."""
        child = self.allocate()
        for cache in self.caches:
            cache.conv[child].copy_(cache.conv[slot])
            cache.ssm[child].copy_(cache.ssm[slot])
        return child


class GatedRMSNorm(nn.Module):
    """``weight * norm(y * silu(z))`` (``before_gate``: ``weight * norm(y) * silu(z)``), the RMS
    taken over each of ``groups`` equal slices of the last dimension, in float32."""

    def __init__(self, size: int, groups: int, eps: float, before_gate: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.groups = groups
        self.eps = eps
        self.before_gate = before_gate

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = y.dtype
        h = y.float() if self.before_gate else y.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], self.groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.before_gate:
            return (self.weight * g.view(h.shape) * F.silu(z.float())).to(dtype)
        return self.weight * g.view(h.shape).to(dtype)


class Mamba2Mixer(nn.Module):
    """The Mamba-2 mixer; parameter names are Hugging Face's (``in_proj``, ``conv1d``,
    ``dt_bias``, ``A_log``, ``D``, ``norm``, ``out_proj``)."""

    def __init__(self, shape: Mamba2Shape) -> None:
        super().__init__()
        self.shape = s = shape
        self.in_proj = Linear(s.hidden_size, s.projection_size, bias=s.proj_bias)
        # depthwise: one filter of d_conv taps per channel (HF's nn.Conv1d weight [C, 1, K])
        self.conv1d = nn.Conv1d(
            s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=s.conv_bias
        )
        self.dt_bias = nn.Parameter(torch.zeros(s.num_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_heads))
        self.D = nn.Parameter(torch.ones(s.num_heads))
        self.norm: GatedRMSNorm | None = None  # (gate_norm "none": the gate alone)
        if s.gate_norm != "none":
            before = s.gate_norm == "before_gate"
            self.norm = GatedRMSNorm(s.intermediate_size, s.n_groups, s.eps, before)
        out_bias = s.proj_bias if s.out_proj_bias is None else s.out_proj_bias
        self.out_proj = Linear(s.intermediate_size, s.hidden_size, bias=out_bias)
        self._decode: tuple[tuple[tuple[int, int], ...], MambaDecodeParams] | None = None

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """in_proj's ``z | xBC | dt`` of ``x`` (a family may scale them: Falcon-H1)."""
        return self.in_proj(x)

    def _decode_params(self) -> MambaDecodeParams:
        """The small parameters as ``ssm_ops.mamba_decode`` reads them, kept while the
        parameters stay where and as they are."""
        s = self.shape
        small = [self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D]
        small.append(None if self.norm is None else self.norm.weight)
        key = tuple((p.data_ptr(), p._version) for p in small if p is not None)
        if self._decode is not None and self._decode[0] == key:
            return self._decode[1]
        modes = {"after_gate": 0, "before_gate": 1, "none": 2}
        bias = self.conv1d.bias
        params = MambaDecodeParams(
            s.num_heads,
            s.head_dim,
            s.state_size,
            s.n_groups,
            self.conv1d.weight[:, 0, :].float().t().contiguous(),
            None if bias is None else bias.float().contiguous(),
            self.dt_bias.float().contiguous(),
            -torch.exp(self.A_log.float()),
            self.D.float().contiguous(),
            s.time_step_limit[0],
            s.time_step_limit[1],
            None if self.norm is None else self.norm.weight.float().contiguous(),
            s.n_groups,
            s.eps,
            modes[s.gate_norm],
        )
        self._decode = (key, params)
        return params

    def forward(
        self, x: torch.Tensor, cache: RecurrentCache, batch: RecurrentBatch
    ) -> torch.Tensor:
        """``[T, hidden]`` out for the batch's tokens ``x [T, hidden]``; the rows' states in the
        pools ``cache.conv [slots, d_conv - 1, conv_dim]`` and ``cache.ssm [slots, heads,
        head_dim, d_state]`` are read at ``batch.slots`` and updated in place (and copied into
        the snapshot slots the batch names)."""
        s = self.shape
        t = x.shape[0]
        proj = self.project(x)
        if batch.is_decode:  # one C++ call between the projections
            y = mamba_decode(cache.conv, cache.ssm, batch.slots, proj, self._decode_params())
            if y is not None:
                if batch.snapshots:  # a decode row's: its state after the step
                    rows = batch.slots[batch.snap_row]
                    cache.conv[batch.snap_slots] = cache.conv[rows]
                    cache.ssm[batch.snap_slots] = cache.ssm[rows]
                return self.out_proj(y)
        z, xbc, dt = proj.split([s.intermediate_size, s.conv_dim, s.num_heads], -1)
        xbc = F.silu(self._conv(xbc, cache.conv, batch))
        bc = s.n_groups * s.state_size
        xs, b, c = xbc.split([s.intermediate_size, bc, bc], -1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if s.time_step_limit != (0.0, float("inf")):
            dt = dt.clamp(*s.time_step_limit)
        a = -torch.exp(self.A_log.float())
        xs = xs.reshape(t, s.num_heads, s.head_dim).float()
        b = b.reshape(t, s.n_groups, s.state_size).float()
        c = c.reshape(t, s.n_groups, s.state_size).float()
        ssm = cache.ssm
        if batch.is_decode:
            y = _ssd_step(xs, dt, a, b, c, ssm, batch.slots)
        else:
            y = torch.empty_like(xs)
            if batch.one_tokens.numel():
                i = batch.one_tokens
                y[i] = _ssd_step(xs[i], dt[i], a, b[i], c[i], ssm, batch.one_slots)
            i = batch.scan_tokens
            y[i] = _ssd_rows(xs[i], dt[i], a, b[i], c[i], ssm, batch, s.chunk_size)
        if batch.snapshots:
            snapshot_one_token_rows(ssm, batch)
        y = y + xs * self.D.float()[:, None]
        y = y.reshape(t, s.intermediate_size).to(x.dtype)
        y = y * F.silu(z) if self.norm is None else self.norm(y, z)
        return self.out_proj(y)

    def _conv(
        self, xbc: torch.Tensor, conv_state: torch.Tensor, batch: RecurrentBatch
    ) -> torch.Tensor:
        return causal_conv(xbc, self.conv1d.weight[:, 0, :], self.conv1d.bias, conv_state, batch)


def causal_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    batch: RecurrentBatch,
) -> torch.Tensor:
    """The causal depthwise convolution (``weight [C, K]``) of each row's tokens ``x [T, C]``,
    its window starting with the row's conv state ``conv_state[slot] [K - 1, C]``; the state
    becomes the row's last ``K - 1`` inputs (a snapshot slot's, the ``K - 1`` inputs up to its
    token). Mamba-2's and gated DeltaNet's."""
    if batch.is_decode:  # one token a row: the window updated in place in each slot
        out = causal_conv1d_update(conv_state, x, weight, bias, batch.slots)
        if batch.snapshots:  # (at offset 0: the window after the row's token)
            conv_state[batch.snap_slots] = conv_state[batch.slots[batch.snap_row]]
        return out
    kernel = weight.shape[1]
    w = kernel - 1
    device = x.device
    rows = len(batch.lengths)
    taps = torch.arange(kernel, device=device)
    # per row: its state's w inputs then its tokens, the rows one after the other
    cu = torch.tensor(batch.cu_seqlens, device=device)
    first = cu[:-1] - cu[0] + torch.arange(rows, device=device) * w  # each row's first input
    inputs = x.new_empty(x.shape[0] + rows * w, x.shape[1])
    state_at = (first[:, None] + taps[:w]).reshape(-1)
    inputs[state_at] = conv_state[batch.slots].reshape(rows * w, -1).to(x.dtype)
    window_start = first[batch.token_row] + batch.token_pos
    inputs[window_start + w] = x
    windows = inputs[window_start[:, None] + taps]  # [T, K, C]
    out = (windows * weight.t()).sum(1)
    if bias is not None:
        out = out + bias
    lengths = cu[1:] - cu[:-1]
    conv_state[batch.slots] = inputs[(first + lengths)[:, None] + taps[:w]].to(conv_state.dtype)
    if batch.snapshots:  # the w inputs that end with the snapshot's token
        ends = first[batch.snap_row] + batch.snap_pos + 1
        conv_state[batch.snap_slots] = inputs[ends[:, None] + taps[:w]].to(conv_state.dtype)
    return out


def snapshot_one_token_rows(ssm_state: torch.Tensor, batch: RecurrentBatch) -> None:
    """The snapshots of one-token rows: the row's state after the step (the scan's rows
    leave theirs in ``_ssd_rows``)."""
    one = batch.scan_index[batch.snap_row] < 0
    if bool(one.any()):
        ssm_state[batch.snap_slots[one]] = ssm_state[batch.slots[batch.snap_row[one]]]


def _ssd_step(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token per row: ``h = exp(dt A) h + dt x B^T``, ``y = h C`` (without D), each row's
    state updated in place in its slot (``ssm_ops``: the C++ or Triton kernel where it runs)."""
    return selective_state_update(ssm_state, x, dt, a, b, c, slots)


def _ssd_rows(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    ssm_state: torch.Tensor,
    batch: RecurrentBatch,
    chunk_size: int,
) -> torch.Tensor:
    """The scan over the batch's rows of more than one token (``x`` etc. hold their tokens,
    ``batch.scan_tokens``): the kernels' token by token where they run; else the chunked scan,
    the rows laid out padded to ``[R', L]`` (a padded token has ``dt = 0``: it leaves the state
    as it is), scanned together from their states, and their outputs gathered back."""
    rows, length = batch.scan_slots.numel(), batch.scan_len
    q = min(chunk_size, SCAN_CHUNK, length)
    padded_len = -(-length // q) * q
    flat = batch.scan_row * padded_len + batch.token_pos[batch.scan_tokens]

    def pad(v: torch.Tensor) -> torch.Tensor:
        out = v.new_zeros(rows * padded_len, *v.shape[1:])
        out[flat] = v
        return out.view(rows, padded_len, *v.shape[1:])

    slots = batch.scan_slots
    if has_kernels(ssm_state):  # token by token, each head's state held in cache
        cu, snapshots = batch.scan_layout()
        return ssd_scan(ssm_state, x, dt, a, b, c, cu, slots, snapshots=snapshots)
    snap = batch.scan_index[batch.snap_row] if batch.snapshots else batch.snap_row
    mid = snap >= 0
    at = (snap[mid], batch.snap_pos[mid]) if bool(mid.any()) else None
    y, final, states_at = ssd_chunked(
        pad(x), pad(dt), a, pad(b), pad(c), ssm_state[slots].float(), q, at
    )
    ssm_state[slots] = final.to(ssm_state.dtype)
    if states_at is not None:
        ssm_state[batch.snap_slots[mid]] = states_at.to(ssm_state.dtype)
    return y.reshape(rows * padded_len, *y.shape[2:])[flat]


def _within_chunks(
    c: torch.Tensor, b: torch.Tensor, xdt: torch.Tensor, acum: torch.Tensor, causal: torch.Tensor
) -> torch.Tensor:
    """Each chunk's output from its own tokens: ``y_i = sum_{j<=i} (C_i . B_j) exp(acum_i -
    acum_j) dt_j x_j``."""
    diff = acum[:, :, :, None, :] - acum[:, :, None, :, :]  # [R, C, Qi, Qj, H]
    decay = torch.exp(diff.masked_fill(~causal[None, None, :, :, None], float("-inf")))
    scores = torch.einsum("rcihn,rcjhn->rcijh", c, b) * decay
    return torch.einsum("rcijh,rcjhp->rcihp", scores, xdt)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
    at: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The SSD scan of ``R`` rows of ``L`` tokens (``L`` a multiple of ``chunk``), float32:
    ``x [R, L, H, P]``, ``dt [R, L, H]`` (after softplus), ``a [H]`` (negative), ``b``, ``c``
    ``[R, L, G, N]``, ``state [R, H, P, N]`` the state before the first token. Returns ``y [R,
    L, H, P]`` (without the D skip), the state after the last token, and (``at``: rows and
    token indices ``[K]`` each) the states ``[K, H, P, N]`` after those tokens.

    Within a chunk the output is the masked quadratic form ``y_i = sum_{j<=i} (C_i . B_j)
    exp(sum_{j<k<=i} dt_k A) dt_j x_j``; across chunks the state is carried by the recurrence
    ``h_{c+1} = exp(sum_c dt A) h_c + S_c`` (a loop over chunks, not tokens)."""
    r, length, heads, p = x.shape
    n_chunks = length // chunk
    per_group = heads // b.shape[2]
    b = b.repeat_interleave(per_group, 2).view(r, n_chunks, chunk, heads, -1)
    c = c.repeat_interleave(per_group, 2).view(r, n_chunks, chunk, heads, -1)
    xdt = (x * dt[..., None]).view(r, n_chunks, chunk, heads, p)
    acum = torch.cumsum((dt * a).view(r, n_chunks, chunk, heads), dim=2)  # [R, C, Q, H]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=x.device).tril()
    y = torch.empty_like(xdt)
    # the [R, C, Q, Q, H] products of a few chunks at a time: bounded memory at any length
    step = max(1, SCAN_ELEMENTS // (r * chunk * chunk * heads))
    for lo in range(0, n_chunks, step):
        part = slice(lo, lo + step)
        y[:, part] = _within_chunks(c[:, part], b[:, part], xdt[:, part], acum[:, part], causal)
    # each chunk's own contribution to the state at its end
    to_end = torch.exp(acum[:, :, -1:, :] - acum)  # [R, C, Q, H]
    chunk_states = torch.einsum("rcjhn,rcjh,rcjhp->rchpn", b, to_end, xdt)
    chunk_decay = torch.exp(acum[:, :, -1, :])  # [R, C, H]
    entering = []
    h = state
    for i in range(n_chunks):
        entering.append(h)
        h = h * chunk_decay[:, i, :, None, None] + chunk_states[:, i]
    h_in = torch.stack(entering, dim=1)  # [R, C, H, P, N]
    y = y + torch.einsum("rcihn,rchpn->rcihp", c, h_in) * torch.exp(acum)[..., None]
    states_at = None
    if at is not None:  # from the state entering the token's chunk, over the chunk up to it
        rows, pos = at
        ci, j = pos // chunk, pos % chunk
        acum_k = acum[rows, ci]  # [K, Q, H]
        acum_j = acum_k.gather(1, j[:, None, None].expand(-1, 1, heads))  # [K, 1, H]
        upto = torch.arange(chunk, device=x.device)[None, :] <= j[:, None]  # [K, Q]
        weight = torch.exp(acum_j - acum_k).masked_fill(~upto[..., None], 0.0)
        own = torch.einsum("kjh,kjhn,kjhp->khpn", weight, b[rows, ci], xdt[rows, ci])
        states_at = h_in[rows, ci] * torch.exp(acum_j[:, 0])[:, :, None, None] + own
    return y.reshape(r, length, heads, p), h, states_at
