"""The gated DeltaNet mixer (Qwen3-Next's ``linear_attention`` layers) over a flat batch of
rows, its per-request state passed in as explicit tensors.

One mixer turns ``x [T, hidden]`` (the new tokens of R rows, flattened as the attention backends
take them: row ``r`` owns tokens ``cu[r]:cu[r+1]``) into ``[T, hidden]``::

    in_proj_qkvz ─▶ per key head: q [dk] | k [dk] | v [r * dv] | z [r * dv]   (r = Hv / Hk)
    in_proj_ba   ─▶ per key head: b [r] | a [r]
    q | k | v ─▶ causal depthwise conv1d (window K, continuing the row's conv state) ─▶ silu
    q, k ─▶ L2-normalised per head (q also times dk^-0.5), each shared by r value heads
    beta = sigmoid(b)        g = -exp(A_log) * softplus(a + dt_bias)     (per value head)
    gated delta rule, per value head, S [dk, dv]:
        S_t = exp(g_t) S_{t-1}
        S_t = S_t + beta_t k_t (v_t - S_t^T k_t)^T        o_t = S_t^T q_t
    o ─▶ RMSNorm per head, times silu(z) ─▶ out_proj

Each row continues from its state and leaves it updated in place, so a prompt may come in
chunks (chunked prefill) and decode is the same call with one token per row; one step may mix
both. Rows of one token take the one-step recurrence. The longer rows are padded to the longest
of them (a padded token has ``beta = 0`` and ``g = 0``: it leaves the state as it is) and go
through the chunked delta rule: within a chunk of 64 tokens the updates are solved at once in
the UT form (one unit lower-triangular solve), and a recurrence carries the state across chunks
(a Python loop over chunks, none over tokens).

Per request and per layer the state is (``RecurrentStateSpec``):

- conv state ``[K - 1, conv_dim]``: the last ``K - 1`` inputs of the convolution, ``conv_dim =
  2 * Hk * dk + Hv * dv`` (q | k | v channels), in the model dtype;
- delta-rule state ``[Hv, dk, dv]`` float32 (``S`` above, transformers' layout: the spec's
  ``num_heads = Hv``, ``head_dim = dk``, ``state_size = dv``).

The prefix cache's snapshots ``(row, offset, slot)`` of a ``RecurrentBatch`` get the state after
the row's token ``offset``: the conv window ending there, and the delta-rule state computed from
the state entering that token's chunk and the chunk's solved updates up to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from foudre.attention.cache_spec import RecurrentCache, RecurrentStateSpec
from foudre.layers.linear import Linear
from foudre.layers.mamba import RecurrentBatch, causal_conv, snapshot_one_token_rows
from foudre.layers.ssm_ops import (
    DeltaNetDecodeParams,
    decode_library,
    deltanet_decode,
    gated_delta_rule_scan,
    gated_delta_rule_update,
    has_kernels,
)

# tokens per chunk of the chunked delta rule (the UT solve is quadratic in it)
DELTA_CHUNK = 64
# the most elements of the [rows, chunks, heads, chunk, chunk] terms computed at a time
DELTA_ELEMENTS = 1 << 22


@dataclass(frozen=True, slots=True)
class GatedDeltaNetShape:
    """The sizes of one gated DeltaNet mixer."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads: each q/k head serves r value heads
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    eps: float = 1e-6  # of the gated RMSNorm

    def __post_init__(self) -> None:
        for name in ("num_k_heads", "num_v_heads", "key_head_dim", "value_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(
                    f"gated DeltaNet {name} must be positive, got {getattr(self, name)}"
                )
        if self.conv_kernel < 2:
            raise ValueError(f"gated DeltaNet conv kernel must be >= 2, got {self.conv_kernel}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"gated DeltaNet num_v_heads={self.num_v_heads} must be a multiple of "
                f"num_k_heads={self.num_k_heads}"
            )

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.key_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def ratio(self) -> int:
        """Value heads per key head."""
        return self.num_v_heads // self.num_k_heads

    def state_spec(self) -> RecurrentStateSpec:
        return RecurrentStateSpec(
            self.conv_kernel - 1,
            self.conv_dim,
            self.num_v_heads,
            self.key_head_dim,
            self.value_head_dim,
        )


class NormThenGate(nn.Module):
    """``(weight * norm(o)) * silu(z)`` over the last dimension: normalised in float32, cast
    back and scaled by the weight in the input dtype, then gated in float32 (transformers'
    order of roundings)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = o.dtype
        h = o.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(z.float())).to(dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """The gated DeltaNet mixer; parameter names are Hugging Face's (``in_proj_qkvz``,
    ``in_proj_ba``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``, ``out_proj``)."""

    def __init__(self, shape: GatedDeltaNetShape) -> None:
        super().__init__()
        self.shape = s = shape
        self.in_proj_qkvz = Linear(s.hidden_size, 2 * s.key_dim + 2 * s.value_dim, bias=False)
        self.in_proj_ba = Linear(s.hidden_size, 2 * s.num_v_heads, bias=False)
        # depthwise, no bias: one filter of K taps per channel (HF's nn.Conv1d weight [C, 1, K])
        self.conv1d = nn.Conv1d(
            s.conv_dim, s.conv_dim, s.conv_kernel, groups=s.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(s.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(s.num_v_heads))
        self.norm = NormThenGate(s.value_head_dim, s.eps)
        self.out_proj = Linear(s.value_dim, s.hidden_size, bias=False)
        # (key, params): _decode_params' float32 copies, and what they were made from
        self._decode: tuple[tuple[tuple[int, int], ...], DeltaNetDecodeParams] | None = None

    def _decode_params(self) -> DeltaNetDecodeParams:
        """The small parameters as ``ssm_ops.deltanet_decode`` reads them (float32 copies of
        the conv weight, ``-exp(A_log)`` and ``dt_bias``; the norm's weight itself), kept while
        the parameters stay where and as they are."""
        s = self.shape
        small = [self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight]
        key = tuple((p.data_ptr(), p._version) for p in small)
        if self._decode is not None and self._decode[0] == key:
            return self._decode[1]
        with torch.no_grad():
            params = DeltaNetDecodeParams(
                s.num_k_heads,
                s.num_v_heads,
                s.key_head_dim,
                s.value_head_dim,
                conv_w=self.conv1d.weight[:, 0, :].float().t().contiguous(),
                a=-torch.exp(self.A_log.float()),
                dt_bias=self.dt_bias.float().contiguous(),
                norm_w=self.norm.weight,
                eps=self.norm.eps,
                scale=s.key_head_dim**-0.5,
            )
        self._decode = (key, params)
        return params

    def _project(
        self, x: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q | k | v [T, conv_dim], z [T, Hv, dv], b [T, Hv], a [T, Hv])`` from the
        projections' per-key-head groups."""
        s = self.shape
        t, r = x.shape[0], s.ratio
        dk, rv = s.key_head_dim, r * s.value_head_dim
        qkvz = self.in_proj_qkvz(x).view(t, s.num_k_heads, 2 * dk + 2 * rv)
        q, k, v, z = qkvz.split([dk, dk, rv, rv], -1)
        b, a = self.in_proj_ba(x).view(t, s.num_k_heads, 2 * r).split([r, r], -1)
        mixed = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], -1)
        z = z.reshape(t, s.num_v_heads, s.value_head_dim)
        return mixed, z, b.reshape(t, s.num_v_heads), a.reshape(t, s.num_v_heads)

    def forward(
        self, x: torch.Tensor, cache: RecurrentCache, batch: RecurrentBatch
    ) -> torch.Tensor:
        """``[T, hidden]`` out for the batch's tokens ``x [T, hidden]``; the rows' states in the
        pools ``cache.conv [slots, K - 1, conv_dim]`` and ``cache.ssm [slots, Hv, dk, dv]`` are
        read at ``batch.slots`` and updated in place (and copied into the snapshot slots the
        batch names)."""
        s = self.shape
        t = x.shape[0]
        if batch.is_decode:  # one C++ call between the projections (the CPU's kernels)
            o = self._decode_step(x, cache, batch)
            if o is not None:
                return self.out_proj(o)
        mixed, z, b, a = self._project(x)
        weight = self.conv1d.weight[:, 0, :]
        mixed = F.silu(causal_conv(mixed, weight, None, cache.conv, batch))
        q, k, v = mixed.split([s.key_dim, s.key_dim, s.value_dim], -1)
        q = l2_normalize(q.reshape(t, s.num_k_heads, s.key_head_dim).float())
        q = (q * s.key_head_dim**-0.5).repeat_interleave(s.ratio, 1)
        k = l2_normalize(k.reshape(t, s.num_k_heads, s.key_head_dim).float())
        k = k.repeat_interleave(s.ratio, 1)
        v = v.reshape(t, s.num_v_heads, s.value_head_dim).float()
        beta = torch.sigmoid(b).float()
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())
        ssm = cache.ssm
        if batch.is_decode:
            o = delta_step(q, k, v, g, beta, ssm, batch.slots)
        else:
            o = torch.empty_like(v)
            if batch.one_tokens.numel():
                i = batch.one_tokens
                o[i] = delta_step(q[i], k[i], v[i], g[i], beta[i], ssm, batch.one_slots)
            i = batch.scan_tokens
            o[i] = _delta_rows(q[i], k[i], v[i], g[i], beta[i], ssm, batch)
        if batch.snapshots:
            snapshot_one_token_rows(ssm, batch)
        o = self.norm(o.to(x.dtype), z)
        return self.out_proj(o.reshape(t, s.value_dim))

    def _decode_step(
        self, x: torch.Tensor, cache: RecurrentCache, batch: RecurrentBatch
    ) -> torch.Tensor | None:
        """A decode step's mixer up to out_proj in one C++ call (``ssm_ops.deltanet_decode``:
        what the native decode step of ``runner/cpu_decode.py`` calls too, so both give the same
        bits), the decode rows' snapshots copied after it; None where it does not run."""
        if not (has_kernels(cache.ssm) and cache.ssm.is_cpu) or self.norm.weight.dtype != x.dtype:
            return None
        # what deltanet_decode refuses, known before the projections (not computed twice)
        if decode_library(cache.conv, cache.ssm, x.dtype) is None:
            return None
        o = deltanet_decode(
            cache, batch.slots, self.in_proj_qkvz(x), self.in_proj_ba(x), self._decode_params()
        )
        if o is not None and batch.snapshots:  # a decode row's: its state after the step
            rows = batch.slots[batch.snap_row]
            cache.conv[batch.snap_slots] = cache.conv[rows]
            cache.ssm[batch.snap_slots] = cache.ssm[rows]
        return o


def delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One token per row (``q, k [R, H, dk]``, ``v [R, H, dv]``, ``g, beta [R, H]``): the
    gated delta rule's step on the states at ``slots`` (updated in place); returns ``o [R, H,
    dv]``."""
    if has_kernels(ssm_state):  # (q, k already normalised, scaled and one per value head)
        return gated_delta_rule_update(ssm_state, q, k, v, g, beta, slots, scale=1.0)
    state = ssm_state[slots].float() * torch.exp(g)[..., None, None]  # [R, H, dk, dv]
    remembered = torch.einsum("rhkv,rhk->rhv", state, k)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    ssm_state[slots] = state.to(ssm_state.dtype)
    return torch.einsum("rhkv,rhk->rhv", state, q)


def _delta_rows(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm_state: torch.Tensor,
    batch: RecurrentBatch,
) -> torch.Tensor:
    """The chunked delta rule over the batch's rows of more than one token (the arguments hold
    their tokens, ``batch.scan_tokens``): laid out padded to ``[R', L]`` (padding: all zeros,
    so ``beta = 0`` and ``g = 0`` leave the state as it is), run together from their states,
    and the outputs gathered back."""
    if has_kernels(ssm_state):  # token by token, each head's state held in cache
        cu, snaps = batch.scan_layout()
        return gated_delta_rule_scan(
            ssm_state, q, k, v, g, beta, cu, batch.scan_slots, scale=1.0, snapshots=snaps
        )
    rows, length = batch.scan_slots.numel(), batch.scan_len
    chunk = min(DELTA_CHUNK, length)
    padded_len = -(-length // chunk) * chunk
    flat = batch.scan_row * padded_len + batch.token_pos[batch.scan_tokens]

    def pad(x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(rows * padded_len, *x.shape[1:])
        out[flat] = x
        return out.view(rows, padded_len, *x.shape[1:])

    slots = batch.scan_slots
    snap = batch.scan_index[batch.snap_row] if batch.snapshots else batch.snap_row
    mid = snap >= 0
    at = (snap[mid], batch.snap_pos[mid]) if bool(mid.any()) else None
    o, final, states_at = gated_delta_chunked(
        pad(q), pad(k), pad(v), pad(g), pad(beta), ssm_state[slots].float(), chunk, at
    )
    ssm_state[slots] = final.to(ssm_state.dtype)
    if states_at is not None:
        ssm_state[batch.snap_slots[mid]] = states_at.to(ssm_state.dtype)
    return o.reshape(rows * padded_len, *o.shape[2:])[flat]


def _chunk_terms(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """What each chunk needs besides the state entering it (all ``[R, N, H, C, ...]``, token
    ``i`` of a chunk, ``G_i`` the sum of its ``g`` up to ``i``):

    - ``u0``, ``w``: the chunk's updates ``u = u0 - w S`` for the entering state ``S``, the
      solution of the unit lower-triangular system ``u_i + beta_i sum_{j<i} exp(G_i - G_j)
      (k_i . k_j) u_j = beta_i (v_i - exp(G_i) S^T k_i)``;
    - ``attn``: ``exp(G_i - G_j) (q_i . k_j)`` for ``j <= i`` (0 above);
    - ``q_in``: ``exp(G_i) q_i`` (how token ``i`` reads ``S``), ``k_out``: ``exp(G_C - G_j)
      k_j`` (how update ``j`` reaches the chunk's end), ``G`` itself."""
    chunk = q.shape[3]
    cum = g.cumsum(-1)  # [R, N, H, C]
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    decay = torch.exp((cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")))
    system = (k @ k.transpose(-1, -2)) * decay * beta[..., None]
    u0 = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(
        system, k * (beta * torch.exp(cum))[..., None], upper=False, unitriangular=True
    )
    attn = (q @ k.transpose(-1, -2)) * decay
    q_in = q * torch.exp(cum)[..., None]
    k_out = k * torch.exp(cum[..., -1:] - cum)[..., None]
    return u0, w, attn, q_in, k_out, cum


def gated_delta_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
    at: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over ``R`` rows of ``L`` tokens (``L`` a multiple of ``chunk``),
    float32: ``q, k [R, L, H, dk]`` (normalised, q scaled), ``v [R, L, H, dv]``, ``g, beta
    [R, L, H]``, ``state [R, H, dk, dv]`` the state before the first token. Returns ``o [R, L,
    H, dv]``, the state after the last token, and (``at``: rows and token indices ``[K]``
    each) the states ``[K, H, dk, dv]`` after those tokens.

    The same as the token-by-token recurrence (``delta_step``) in exact arithmetic: within a
    chunk the updates come from one triangular solve (``_chunk_terms``), and the state goes from
    chunk to chunk by ``S' = exp(G_C) S + sum_j exp(G_C - G_j) k_j u_j^T``."""
    r, length, heads, dk = q.shape
    dv = v.shape[-1]
    n = length // chunk

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [R, L, H, ...] -> [R, N, H, C, ...]
        return x.view(r, n, chunk, heads, *x.shape[3:]).transpose(2, 3)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    o = v.new_empty(r, n, heads, chunk, dv)
    u = v.new_empty(r, n, heads, chunk, dv)
    cum = g.new_empty(r, n, heads, chunk)
    wanted = set() if at is None else set((at[1] // chunk).tolist())
    entering: dict[int, torch.Tensor] = {}
    s = state
    step = max(1, DELTA_ELEMENTS // (r * heads * chunk * max(chunk, dk, dv)))
    for lo in range(0, n, step):
        part = slice(lo, lo + step)
        u0, w, attn, q_in, k_out, cum_part = _chunk_terms(
            q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part]
        )
        cum[:, part] = cum_part  # (kept for the snapshots)
        for i in range(u0.shape[1]):
            c = lo + i
            if c in wanted:
                entering[c] = s
            u[:, c] = u0[:, i] - w[:, i] @ s
            o[:, c] = q_in[:, i] @ s + attn[:, i] @ u[:, c]
            s = (
                s * torch.exp(cum[:, c, :, -1])[..., None, None]
                + k_out[:, i].transpose(-1, -2) @ u[:, c]
            )
    o = o.transpose(2, 3).reshape(r, length, heads, dv)
    states_at = None
    if at is not None:  # from the state entering the token's chunk, over the chunk up to it
        rows, pos = at
        ci, j = pos // chunk, pos % chunk
        s_in = torch.stack(
            [entering[c][row] for row, c in zip(rows.tolist(), ci.tolist(), strict=True)]
        )
        cum_k = cum[rows, ci]  # [K, H, C]
        cum_j = cum_k.gather(2, j[:, None, None].expand(-1, heads, 1))  # [K, H, 1]
        upto = torch.arange(chunk, device=q.device)[None, :] <= j[:, None]  # [K, C]
        weight = torch.exp(cum_j - cum_k).masked_fill(~upto[:, None, :], 0.0)
        own = torch.einsum("khc,khcd,khce->khde", weight, k[rows, ci], u[rows, ci])
        states_at = s_in * torch.exp(cum_j)[..., None] + own
    return o, s, states_at
