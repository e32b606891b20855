"""Fused CPU versions of the layers' elementwise chains (``cpu_ops.cpp``): RMSNorm, SiLU(gate) *
up and RoPE, for float32 and bfloat16 tensors on an AVX-512 or AVX2 CPU; ``linear``, the
decode-sized matrix product that ``layers/linear.py`` routes to; ``gemm_unchecked``, the AVX2
build's bfloat16 GEMM for a prefill's rows where the CPU has no bfloat16 arithmetic; and
``moe_experts``, the routed experts of a mixture-of-experts layer at decode sizes
(``layers/moe.py``).

Each replaces several torch ops (RMSNorm alone is eight, each a pass over memory and a dispatch)
and rounds where those ops round (RoPE bit for bit, the others within a few float32 ulps before
the final rounding: a sum in another order, a reciprocal for a division). In a bf16 decode step
of the 500M benchmark model at 64 rows, the torch chains took about 0.4 ms per layer and the
fused ops 0.15; the 64-request throughput run gains about 3.5%. ``enabled(x)`` says whether a
tensor takes the fused path: on the CPU, float32 or bfloat16, the library built, not switched
off with ``FOUDRE_FUSED_CPU_OPS=0``, and no autograd recording. The torch code stays beside each
call as the reference and the fallback.
"""

from __future__ import annotations

import ctypes
import os
from functools import lru_cache
from typing import Any

import torch

from foudre.native import build as native

SOURCE = native.SOURCES / "cpu_ops.cpp"
_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}
_P, _I64, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "foudre_rms_norm": [_P, _P, _P, _I64, _I64, _I64, _F],
    "foudre_silu_mul": [_P, _P, _I64, _I64, _I64],
    "foudre_offset_rms_norm": [_P, _P, _P, _I64, _I64, _I64, _F],
    "foudre_gelu_mul": [_P, _P, _I64, _I64, _I64],
    "foudre_rope": [_P, _P, _P, _P, _I64, _I64, _I64, _I64],
    "foudre_linear": [_P, _I64, _P, _P, _P, _I64, _I64, _I64],
    # x, rows, hidden, inter, ids, weights, top_k, gate_up, down, experts, out
    "foudre_moe_experts": [_P, *[_I64] * 3, _P, _P, _I64, _P, _P, _I64, _P],
    # logits, rows, experts, top_k, renormalize, ids, weights
    "foudre_route": [_P, _I64, _I64, _I64, ctypes.c_int, _P, _P],
    # x, rows, hidden, inter, router, experts, top_k, renormalize, gate_up, down, counts,
    # counted, out
    "foudre_moe_block": [_P, *[_I64] * 3, _P, _I64, _I64, ctypes.c_int, _P, _P, _P, _I64, _P],
    # DeepSeek-V3 (native/decode_mla.h): q, q_stride, q_head, kv_b, out, rows, heads, nope, v,
    # rank (and o, o_stride, o_head, ... for the unabsorbed values); moe_block's arguments, then
    # bias, n_group, topk_group, scaling
    "foudre_latent_absorb": [_P, _I64, _I64, _P, _P, *[_I64] * 5],
    "foudre_latent_unabsorb": [_P, _I64, _I64, _P, _P, *[_I64] * 5],
    "foudre_grouped_moe_block": [
        *[_P, *[_I64] * 3, _P, _I64, _I64, ctypes.c_int, _P, _P, _P, _I64, _P],
        *[_P, _I64, _I64, _F],
    ],
    # x, rows, hidden, router, experts, bias, top_k, n_group, topk_group, renormalize,
    # scaling, ids, weights
    "foudre_route_grouped": [_P, _I64, _I64, _P, _I64, _P, *[_I64] * 3, ctypes.c_int, _F, _P, _P],
    # out, rows, layers, num_layers, hidden, heads, kv_heads, head_dim, intermediate, eps;
    # cos, sin, rot, max_positions, positions, slots, num_slots;
    # attention, tokens, tables, lens, table_width, block_size, groups, scale;
    # mamba (a MambaStep), state_slots, num_state_slots, state_copies, num_copies; counted;
    # embed, embed_scale, vocab, ids, final_norm, final_offset (Gemma's norm); head (a QuantSlot
    # descriptor, or 0), head_n, logits
    # x, gate, out, rows, n, gate_cols (Qwen3-Next's sigmoid gates)
    "foudre_sigmoid_gate": [_P, _P, _P, _I64, _I64, _I64],
    "foudre_decode_layers": [
        *[_P, _I64, _P, *[_I64] * 6, _F],
        *[_P, _P, _I64, _I64, _P, _P, _I64],
        *[*[_P] * 4, _I64, _I64, _I64, _F],
        *[_P, _P, _I64, _P, _I64],
        _I64,
        *[_P, _F, _I64, _P, _P, _I64],
        *[_P, _I64, _P],
    ],
}


_RETURNS_INT = (
    "foudre_decode_layers", "foudre_moe_experts", "foudre_moe_block", "foudre_grouped_moe_block",
)  # fmt: skip
# x, x_stride, w, bias, y, rows, n, k (bfloat16 only; -1 where the build has none)
_GEMM_BF16: list[Any] = [_P, _I64, _P, _P, _P, _I64, _I64, _I64]


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if os.environ.get("FOUDRE_FUSED_CPU_OPS", "1") == "0":
        return None
    dll = native.load(SOURCE)
    if dll is None or not dll.foudre_cpu_ops_available():
        return None  # no compiler, or a CPU with neither AVX-512 nor AVX2
    for name, argtypes in _SIGNATURES.items():
        for dtype, suffix in _SUFFIX.items():
            fn = getattr(dll, f"{name}_{suffix}")
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int if name in _RETURNS_INT else None
            _FNS[name, dtype] = fn
    dll.foudre_gemm_bf16.argtypes = _GEMM_BF16
    dll.foudre_gemm_bf16.restype = ctypes.c_int
    _FNS["foudre_gemm", torch.bfloat16] = dll.foudre_gemm_bf16
    return dll


# (name, dtype) -> the library's function, filled when it loads: one dict lookup per call, as
# these run between the weight reads of a decode step, when little of Python's state is cached
_FNS: dict[tuple[str, torch.dtype], Any] = {}


def enabled(x: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether ``x`` (and the ``others`` it is combined with, CPU tensors of its dtype; None
    entries are skipped) take the fused path: never where autograd records (training and
    distillation run the torch ops)."""
    if not x.is_cpu or x.dtype not in _SUFFIX:
        return False
    for o in others:
        if o is not None and (o.dtype != x.dtype or not o.is_cpu):
            return False
    return not records_grad(x, *others) and _library() is not None


def records_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd records an op on ``tensors`` (None entries skipped): then only torch's
    ops, which it can differentiate, may run them."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _fn(name: str, dtype: torch.dtype) -> Any:
    assert _library() is not None, "the fused CPU ops are not available"
    return _FNS[name, dtype]


def decode_layers_fn(dtype: torch.dtype) -> Any:
    """``foudre_decode_layers`` for ``dtype`` (``runner/cpu_decode.py`` calls it), or None."""
    return None if _library() is None else _FNS.get(("foudre_decode_layers", dtype))


def decode_layer_pointers() -> int:
    """The entries of one layer in ``foudre_decode_layers``' table (``LayerPointer``)."""
    dll = _library()
    assert dll is not None, "the fused CPU ops are not available"
    return int(dll.foudre_decode_layer_pointers())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension."""
    return _norm("foudre_rms_norm", x, weight, eps)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``((1 + weight) * x * rsqrt(mean(x^2) + eps)).to(x.dtype)`` over the last dimension, in
    float32 (Gemma's ``OffsetRMSNorm``)."""
    return _norm("foudre_offset_rms_norm", x, weight, eps)


def _norm(name: str, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype)
    _fn(name, x.dtype)(
        rows.data_ptr(), w.data_ptr(), out.data_ptr(), rows.shape[0], n, rows.stride(0), eps
    )
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` (a ``[T, 2n]`` matrix)."""
    return _gated("foudre_silu_mul", gate_up)


def gelu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(gate) * up`` for ``gate_up = [gate | up]`` (GeGLU; a ``[T, 2n]`` matrix)."""
    return _gated("foudre_gelu_mul", gate_up)


def _gated(name: str, gate_up: torch.Tensor) -> torch.Tensor:
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=gate_up.dtype)
    _fn(name, gate_up.dtype)(gate_up.data_ptr(), out.data_ptr(), rows, n, gate_up.stride(0))
    return out


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> None:
    """Rotates ``x [T, heads, head_dim]`` in place ("rotate half" convention) at ``positions``,
    with float32 tables ``cos``/``sin`` of ``[max_positions, head_dim]``. The caller checks that
    the positions lie in the tables (``RotaryEmbedding`` does, once per positions tensor)."""
    t, heads, head_dim = x.shape
    assert x.stride(2) == 1 and x.stride(1) == head_dim, "heads must be contiguous rows"
    assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous()
    pos = positions if positions.dtype == torch.int64 else positions.to(torch.int64)
    pos = pos.contiguous()
    _fn("foudre_rope", x.dtype)(
        x.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        pos.data_ptr(),
        t,
        heads,
        head_dim,
        x.stride(0),
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a 2-D ``x`` (``[rows, k]``) of a decode-sized batch,
    reading each weight row once for all the rows; float32 sums, one rounding to the dtype at the
    end. ``x``, ``weight`` and ``bias`` must share a dtype and be CPU tensors (``enabled(x,
    weight, bias)`` says so)."""
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"linear: x of shape {tuple(x.shape)} for a weight of [{n}, {k}]")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"linear: bias of shape {tuple(bias.shape)} for {n} outputs")
    tensors = (x, weight) if bias is None else (x, weight, bias)
    if any(t.dtype != x.dtype or t.device.type != "cpu" for t in tensors):
        raise ValueError("linear: x, weight and bias must be CPU tensors of one dtype")
    return linear_unchecked(
        x if x.stride(-1) == 1 else x.contiguous(),
        weight.contiguous(),
        None if bias is None else bias.contiguous(),
    )


def linear_unchecked(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``linear`` without its checks, for callers that made them (``Linear.forward``): ``x``
    ``[rows, k]`` with unit column stride, ``weight`` ``[n, k]`` and ``bias`` ``[n]`` contiguous,
    all CPU tensors of one dtype that ``enabled`` accepts. Anything else reads out of bounds."""
    return _product("foudre_linear", x, weight, bias)[0]


def _product(
    name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, int]:
    """y = the library's product ``name`` (``foudre_linear``'s arguments) of ``x``, ``weight``
    and ``bias`` into a new tensor, and the status it returned (0 where it returns none or there
    are no rows)."""
    rows, n = x.shape[0], weight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype)
    status = None
    if rows:
        status = _FNS[name, x.dtype](
            x.data_ptr(),
            x.stride(0),
            weight.data_ptr(),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            rows,
            n,
            weight.shape[1],
        )
    return y, status or 0


@lru_cache(maxsize=1)
def has_gemm() -> bool:
    """Whether this build has the bfloat16 GEMM of a prefill (``gemm_unchecked``): the AVX2
    build, for CPUs without bfloat16 arithmetic (asked once: a call with no rows)."""
    if _library() is None:
        return False
    return _FNS["foudre_gemm", torch.bfloat16](None, 0, None, None, None, 0, 0, 0) == 0


def gemm_unchecked(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for many rows of bfloat16 (a prefill's) where ``has_gemm``:
    float32 products and sums, one rounding. ``x`` ``[rows, k]`` with unit column stride,
    ``weight`` ``[n, k]`` and ``bias`` ``[n]`` contiguous, bfloat16 CPU tensors that ``enabled``
    accepts; anything else reads out of bounds."""
    y, status = _product("foudre_gemm", x, weight, bias)
    if status == -2:
        raise MemoryError(f"gemm: no memory for x's {x.shape[0]} x {x.shape[1]} float32 copy")
    if status:
        raise RuntimeError("gemm: this build has no bfloat16 GEMM (has_gemm() is False)")
    return y


def moe_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """``sum_j weights[t, j] * down[e](silu(gate) * up)`` over the experts ``e = ids[t, j]`` of
    each row ``t`` of ``x`` ``[rows, hidden]`` (``gate | up = x @ gate_up[e].T``), reading only
    the chosen experts' weights; the bits of ``layers/moe.py``'s grouped path when every expert
    gets at most ``linear.MAX_ROWS`` rows. ``gate_up`` ``[E, 2I, hidden]``, ``down`` ``[E, hidden,
    I]`` and ``x`` share a dtype that ``enabled`` accepts; ``weights`` is float32 ``[rows, k]``,
    ``ids`` int64 ``[rows, k]``. Raises ``IndexError`` for an id outside ``0..E``."""
    experts, two_inter, hidden = gate_up.shape
    if x.dim() != 2 or x.shape[1] != hidden or down.shape != (experts, hidden, two_inter // 2):
        raise ValueError(
            f"moe_experts: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, "
            f"down {tuple(down.shape)}"
        )
    if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise ValueError(f"moe_experts: ids {tuple(ids.shape)}, weights {tuple(weights.shape)}")
    x, gate_up, down = x.contiguous(), gate_up.contiguous(), down.contiguous()
    ids = ids.to(torch.int64).contiguous()
    weights = weights.to(torch.float32).contiguous()
    out = torch.empty_like(x)
    failed = _fn("foudre_moe_experts", x.dtype)(
        x.data_ptr(),
        x.shape[0],
        hidden,
        two_inter // 2,
        ids.data_ptr(),
        weights.data_ptr(),
        ids.shape[1],
        gate_up.data_ptr(),
        down.data_ptr(),
        experts,
        out.data_ptr(),
    )
    if failed:
        raise IndexError(f"moe_experts: an expert id outside 0..{experts}")
    return out


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``layers/moe.route`` for a 2-D ``logits`` ``[rows, experts]`` that ``enabled`` accepts:
    softmax in float32, the ``top_k`` most probable experts (the lower index first among equal
    probabilities), renormalised when ``renormalize``. Float32 weights, int64 ids."""
    rows, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"route: top_k={top_k} for {experts} experts")
    logits = logits.contiguous()
    ids = torch.empty(rows, top_k, dtype=torch.int64)
    weights = torch.empty(rows, top_k, dtype=torch.float32)
    _fn("foudre_route", logits.dtype)(
        logits.data_ptr(), rows, experts, top_k, int(renormalize), ids.data_ptr(),
        weights.data_ptr(),
    )  # fmt: skip
    return weights, ids


def moe_block_unchecked(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    top_k: int,
    renormalize: bool,
    counts: torch.Tensor,
    counted: int,
) -> torch.Tensor:
    """A mixture-of-experts block at decode sizes in one call: ``linear(x, router)``,
    ``route``, ``counts[e] += 1`` for each expert chosen by the first ``counted`` rows (the
    others pad the batch), then ``moe_experts``; the bits of that sequence of calls. Unchecked
    (``SparseMoeBlock`` checks): ``x`` ``[rows, hidden]``, ``router`` ``[E, hidden]``,
    ``gate_up`` ``[E, 2I, hidden]``, ``down`` ``[E, hidden, I]``, all contiguous CPU tensors of
    one dtype that ``enabled`` accepts, ``1 <= top_k <= E``, ``counts`` a contiguous int64
    ``[E]``."""
    out = torch.empty_like(x)
    _FNS["foudre_moe_block", x.dtype](
        x.data_ptr(), x.shape[0], x.shape[1], down.shape[2], router.data_ptr(), router.shape[0],
        top_k, int(renormalize), gate_up.data_ptr(), down.data_ptr(), counts.data_ptr(),
        max(counted, 0), out.data_ptr(),
    )  # fmt: skip
    return out


def sigmoid_gate(x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``x * torch.sigmoid(gate)`` rounded as torch rounds it (the sigmoid in the dtype, then the
    product), for ``x [rows, n]`` and ``gate [rows, n]`` (a gate a channel) or ``[rows, 1]`` (a
    gate a row): Qwen3-Next's gated attention and gated shared expert, which the native decode
    step computes by the same C++ (``decode_qwen3_next.h``). ``enabled(x, gate)`` must hold."""
    rows, n = x.shape
    cols = gate.shape[-1]
    if gate.shape != (rows, cols) or cols not in (1, n):
        raise ValueError(f"sigmoid_gate: gate of shape {tuple(gate.shape)} for x {tuple(x.shape)}")
    if gate.dtype != x.dtype or gate.device != x.device:
        raise ValueError(f"sigmoid_gate: gate in {gate.dtype} on {gate.device} for x in {x.dtype}")
    x, gate = x.contiguous(), gate.contiguous()
    out = torch.empty_like(x)
    _fn("foudre_sigmoid_gate", x.dtype)(
        x.data_ptr(), gate.data_ptr(), out.data_ptr(), rows, n, cols
    )
    return out


def _same_cpu_dtype(name: str, x: torch.Tensor, w: torch.Tensor) -> None:
    """``ValueError`` unless ``x`` and ``w`` are CPU tensors of one dtype (what the C++ reads)."""
    if x.dtype != w.dtype or x.device.type != "cpu" or w.device.type != "cpu":
        raise ValueError(f"{name}: {x.dtype} on {x.device} with a weight {w.dtype} on {w.device}")


def latent_absorb(q_nope: torch.Tensor, kv_b: torch.Tensor, v: int) -> torch.Tensor:
    """DeepSeek-V3's absorbed queries ``[T, H, rank]``: ``q_nope[t, h] @ W_UK[h]`` with ``W_UK``
    the first ``nope`` rows of each head of ``kv_b`` (``kv_b_proj``'s weight ``[H * (nope + v),
    rank]``), float32 sums in order, one rounding; what ``torch.bmm`` computes, within float32
    rounding. ``q_nope`` ``[T, H, nope]`` (unit stride along nope) and ``kv_b`` (contiguous)
    share a dtype that ``enabled`` accepts."""
    t, heads, nope = q_nope.shape
    rank = kv_b.shape[1]
    if kv_b.shape[0] != heads * (nope + v) or q_nope.stride(2) != 1 or not kv_b.is_contiguous():
        raise ValueError(f"latent_absorb: q_nope {tuple(q_nope.shape)}, kv_b {tuple(kv_b.shape)}")
    _same_cpu_dtype("latent_absorb", q_nope, kv_b)
    out = torch.empty(t, heads, rank, dtype=q_nope.dtype)
    if t:
        _fn("foudre_latent_absorb", q_nope.dtype)(
            q_nope.data_ptr(), q_nope.stride(0), q_nope.stride(1), kv_b.data_ptr(),
            out.data_ptr(), t, heads, nope, v, rank,
        )  # fmt: skip
    return out


def latent_unabsorb(o: torch.Tensor, kv_b: torch.Tensor, nope: int) -> torch.Tensor:
    """DeepSeek-V3's values out of the latent ``[T, H, v]``: ``W_UV[h] @ o[t, h, :rank]`` with
    ``W_UV`` the last ``v`` rows of each head of ``kv_b`` (``[H * (nope + v), rank]``), float32
    dot products, one rounding. ``o`` ``[T, H, >= rank]`` (unit stride along its last axis)."""
    t, heads = o.shape[:2]
    rank = kv_b.shape[1]
    v = kv_b.shape[0] // heads - nope
    if o.shape[2] < rank or o.stride(2) != 1 or not kv_b.is_contiguous() or v <= 0:
        raise ValueError(f"latent_unabsorb: o {tuple(o.shape)}, kv_b {tuple(kv_b.shape)}")
    _same_cpu_dtype("latent_unabsorb", o, kv_b)
    out = torch.empty(t, heads, v, dtype=o.dtype)
    if t:
        _fn("foudre_latent_unabsorb", o.dtype)(
            o.data_ptr(), o.stride(0), o.stride(1), kv_b.data_ptr(), out.data_ptr(), t, heads,
            nope, v, rank,
        )  # fmt: skip
    return out


def grouped_moe_block_unchecked(
    x: torch.Tensor,
    router: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    routing: tuple[int, bool, torch.Tensor, int, int, float],
    counts: torch.Tensor,
    counted: int,
) -> torch.Tensor:
    """DeepSeek-V3's routed experts at decode sizes in one call: ``x``'s float32 router logits,
    the sigmoid group-limited routing of ``layers/moe.route_grouped`` (``routing``: top_k,
    renormalize, the float32 correction bias ``[E]``, n_group, topk_group, the scaling factor),
    the counts of the first ``counted`` rows, then ``moe_experts``. Unchecked, as
    ``moe_block_unchecked`` (``SparseMoeBlock`` checks)."""
    top_k, renormalize, bias, n_group, topk_group, scaling = routing
    out = torch.empty_like(x)
    _FNS["foudre_grouped_moe_block", x.dtype](
        x.data_ptr(), x.shape[0], x.shape[1], down.shape[2], router.data_ptr(), router.shape[0],
        top_k, int(renormalize), gate_up.data_ptr(), down.data_ptr(), counts.data_ptr(),
        max(counted, 0), out.data_ptr(), bias.data_ptr(), n_group, topk_group, scaling,
    )  # fmt: skip
    return out


def route_grouped_unchecked(
    x: torch.Tensor, router: torch.Tensor, routing: tuple[int, bool, torch.Tensor, int, int, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)`` ``[rows, top_k]``: ``grouped_moe_block_unchecked``'s routing alone
    (float32 router logits of ``x`` ``[rows, hidden]`` by ``router`` ``[E, hidden]``, then
    ``layers/moe.route_grouped``'s choice within float32 rounding), for the quantized experts'
    path. Unchecked as that one."""
    top_k, renormalize, bias, n_group, topk_group, scaling = routing
    rows = x.shape[0]
    ids = torch.empty(rows, top_k, dtype=torch.int64)
    weights = torch.empty(rows, top_k, dtype=torch.float32)
    _FNS["foudre_route_grouped", x.dtype](
        x.data_ptr(), rows, x.shape[1], router.data_ptr(), router.shape[0], bias.data_ptr(),
        top_k, n_group, topk_group, int(renormalize), scaling, ids.data_ptr(), weights.data_ptr(),
    )  # fmt: skip
    return weights, ids
