"""Mixture of experts: a router sends each token to its top-k experts, so a token pays for a
fraction of the parameters.

``SparseMoeBlock`` is the whole layer behind one interface; a model only says which variant it
uses (how many experts, top-k, renormalised or not, a shared expert and its gate)::

    weights, ids = route(gate(x), top_k, renormalize)   softmax over the experts, top-k,
                                                         optionally renormalised to sum to 1
    out = experts(x, weights, ids)                       out[t] = sum over j of
                                                           weights[t, j] * expert(ids[t, j], x[t])
    out += sigmoid(shared_expert_gate(x)) * shared_expert(x)     (Qwen2-MoE)

DeepSeek-V3's variant (``scoring="sigmoid"``) routes by ``route_grouped`` instead: sigmoid
scores, a per-expert bias added for the choice only, the choice limited to the best groups of
experts, weights scaled by ``routed_scaling_factor``; its shared experts have no gate.

``Experts`` holds the routed experts' weights stacked (``gate_up_proj`` ``[E, 2I, hidden]``,
``down_proj`` ``[E, hidden, I]``, Hugging Face's fused layout) and never loops over tokens:

- on CUDA, one Triton kernel per projection over the tokens sorted by expert
  (``moe_triton.fused_experts``: a grouped GEMM, each tile of rows belonging to one expert);
- on the CPU at decode sizes (at most ``linear.MAX_ROWS`` rows), one native call for the whole
  block (``fused.moe_block_unchecked``: router, routing, counts, experts; the experts alone are
  ``fused.moe_experts``) that reads only the chosen experts' weights, so batch-1 decode costs
  the active parameters, not all of them, and pays one call's glue per layer, as a dense MLP;
- gpt-oss's experts (``ClampedSwiGLUExperts``: biases, the clamped SwiGLU) at decode sizes on
  the CPU, one native call of their own (``fused_moe.gpt_oss_experts``; their MXFP4 and int8
  forms: ``quant/mxfp4.native_experts``, ``quant/experts.QuantExperts``);
- otherwise ``grouped_experts``: tokens sorted by expert, then one gate|up and one down matmul
  per expert that got tokens (``linear``: the decode kernel for small groups, torch's GEMM for
  large ones);
- while a CUDA graph is captured without the Triton kernel (or for quantized experts),
  ``every_expert``: every expert over every row, weighted 0 where not chosen (no host sync).

The CPU paths give the same bits: the native call runs the same kernels (the router's logits
through the linear kernel, the routing through ``fused.route``, which ``route`` also uses on the
CPU) and adds each token's weighted expert outputs in float32 in the same order (experts in
increasing order), then rounds once. Routing weights stay float32 (Mixtral's reference does the
same; Qwen2-MoE's rounds them to the model dtype first, a difference of one bf16 rounding).

Each block counts the tokens routed to each of its experts since it was built
(``expert_tokens``), so load imbalance can be seen (``LLM.metrics()["moe_expert_tokens"]``).
Rows that only pad a batch (static batches, CUDA-graph buckets) are routed but not counted: one
``RoutedRows`` that every block of a model shares says how many rows of a forward are real (the
runner sets it once a step, in O(1), whatever path runs the step), and a CUDA graph's warm-up
run counts nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache, partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from foudre.layers import fused, fused_moe
from foudre.layers.linear import MAX_ROWS, Linear, linear
from foudre.layers.mlp import GatedMLP

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)``, both ``[T, top_k]``: each token's ``top_k`` experts by softmax
    probability (float32, over all experts), highest first (the lower index first among equal
    probabilities), and their probabilities, divided by their sum when ``renormalize``.
    Weights are float32, ids int64."""
    if logits.dim() == 2 and fused.enabled(logits):  # the native block's routing, bit for bit
        return fused.route(logits, top_k, renormalize)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    # the lower index first among equal probabilities, as the native routing: torch.topk breaks
    # ties as its algorithm of the moment falls (it differs by device and batch shape), and
    # bfloat16 router logits tie often
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[..., :top_k], ids[..., :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route_grouped(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)``, both ``[T, top_k]``, DeepSeek-V3's routing: scores ``sigmoid(logits)``
    (float32); each token chooses by ``scores + bias`` (``bias`` ``[E]``: the checkpoint's
    ``e_score_correction_bias``), among the experts of its best ``topk_group`` of ``n_group``
    equal groups only (a group ranked by the sum of its two best biased scores), the
    ``top_k`` best, highest first (the lower index first among equal ones); their weights are
    their unbiased scores, divided by their sum when ``renormalize``, times ``scaling``."""
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    t, e = choice.shape
    if n_group > 1 and topk_group < n_group:
        per_group = choice.view(t, n_group, e // n_group)
        group_scores = per_group.topk(2, dim=-1).values.sum(dim=-1)  # [T, n_group]
        best = torch.sort(group_scores, dim=-1, descending=True, stable=True).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, best[:, :topk_group], True)
        keep = keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
        choice = choice.masked_fill(~keep, float("-inf"))
    ids = torch.sort(choice, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


def grouped_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    expert: ExpertFn,
) -> torch.Tensor:
    """``out[t] = sum_j weights[t, j] * expert(ids[t, j], x[t])`` for ``x`` ``[T, hidden]``:
    rows sorted by expert (stable), ``expert(e, rows)`` called once per expert that got rows,
    in increasing order, and its outputs added, times their weights, into a float32 sum rounded
    once to ``x``'s dtype. The only Python loop is over experts."""
    t, k = ids.shape
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    if len(counts) > num_experts:
        raise IndexError(f"an expert id outside 0..{num_experts}")
    rows = torch.div(order, k, rounding_mode="floor")
    xs = x.index_select(0, rows)
    w = weights.reshape(-1).index_select(0, order).to(torch.float32)[:, None]
    out = torch.zeros(t, x.shape[1], dtype=torch.float32, device=x.device)
    start = 0
    for e, n in enumerate(counts):
        if n:
            end = start + n
            out.index_add_(0, rows[start:end], expert(e, xs[start:end]).float() * w[start:end])
            start = end
    return out.to(x.dtype)


def every_expert(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    expert: ExpertFn,
) -> torch.Tensor:
    """What ``grouped_experts`` returns, computed by every expert over every row with weight 0
    where a row did not choose it: no value leaves the device, so a CUDA graph can capture it
    (the fallback of CUDA paths without a fused kernel; it reads every expert)."""
    dense = torch.zeros(ids.shape[0], num_experts, dtype=torch.float32, device=x.device)
    dense.scatter_(1, ids, weights.to(torch.float32))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(num_experts):
        out += expert(e, x).float() * dense[:, e : e + 1]
    return out.to(x.dtype)


def capturing(x: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on ``x``'s device (no host synchronisation)."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[T, 2I]`` (fused on the CPU)."""
    if fused.enabled(gate_up) and gate_up.dim() == 2:
        return fused.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class Experts(nn.Module):
    """``num_experts`` gated MLPs with stacked weights: ``gate_up_proj`` ``[E, 2I, hidden]``
    (gate rows, then up rows) and ``down_proj`` ``[E, hidden, I]``. Called with the routing
    (``weights``, ``ids`` ``[T, k]``), it returns the weighted sum of each token's experts."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` over the rows ``x`` ``[n, hidden]``."""
        return linear(silu_mul(linear(x, self.gate_up_proj[e])), self.down_proj[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.gate_up_proj, self.down_proj
        if x.is_cuda and not fused.records_grad(x, gate_up, down):
            triton_experts = _triton_experts()
            if triton_experts is not None:
                return triton_experts(x, gate_up, down, weights, ids)
        if (
            x.dim() == 2
            and x.shape[0] <= MAX_ROWS.get(x.dtype, 0)
            and fused.enabled(x, gate_up, down)
            and gate_up.is_contiguous()
            and down.is_contiguous()
            and not torch.is_autocast_enabled("cpu")
        ):
            return fused.moe_experts(x, weights, ids, gate_up, down)
        if capturing(x):
            return every_expert(x, weights, ids, self.num_experts, self.expert)
        return grouped_experts(x, weights, ids, self.num_experts, self.expert)

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return f"num_experts={e}, hidden={h}, intermediate={two_i // 2}"


def clamped_swiglu(
    gate_up: torch.Tensor, alpha: float, limit: float, interleaved: bool = False
) -> torch.Tensor:
    """gpt-oss's activation ``[T, 2I] -> [T, I]``: ``(up + 1) * g * sigmoid(alpha * g)`` with
    ``g = min(gate, limit)`` and ``up`` clamped to ``[-limit, limit]``; ``gate_up`` is ``[gate |
    up]``, or with ``interleaved`` the checkpoint's order (gate in the even columns, up in the
    odd ones: MXFP4 experts keep it)."""
    if interleaved:
        gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
    else:
        gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(alpha * gate))


def swiglu_params(activation: Callable[..., Any]) -> tuple[float, float, bool] | None:
    """``(alpha, limit, interleaved)`` where ``activation`` is ``clamped_swiglu`` with those
    keywords bound (``functools.partial``, as gpt-oss's MXFP4 experts hold it), else None: what
    a native kernel needs to run it in place of the call."""
    if not isinstance(activation, partial) or activation.func is not clamped_swiglu:
        return None
    kw = activation.keywords
    if activation.args or "alpha" not in kw or "limit" not in kw:
        return None
    if not set(kw) <= {"alpha", "limit", "interleaved"}:
        return None
    return float(kw["alpha"]), float(kw["limit"]), bool(kw.get("interleaved", False))


class ClampedSwiGLUExperts(nn.Module):
    """gpt-oss's experts: ``Experts``' stacked layout with biases (``gate_up_proj_bias`` ``[E,
    2I]``, ``down_proj_bias`` ``[E, hidden]``) and a clamped SwiGLU between the projections::

        gate = min(gate, limit)    up = clamp(up, -limit, limit)
        h = (up + 1) * gate * sigmoid(alpha * gate)

    On the CPU at decode sizes (at most ``linear.MAX_ROWS`` rows) one native call
    (``fused_moe.gpt_oss_experts``: only the chosen experts' weights read, biases, activation
    and weighted sum in C++); otherwise ``grouped_experts`` (``every_expert`` while a CUDA
    graph is captured): the fused kernels of ``Experts`` know neither the biases nor this
    activation."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        alpha: float,
        limit: float,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden_size))

    def activation(self, gate_up: torch.Tensor) -> torch.Tensor:
        """The clamped SwiGLU of ``gate_up = [gate | up]`` ``[T, 2I]``."""
        return clamped_swiglu(gate_up, self.alpha, self.limit)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert ``e`` over the rows ``x`` ``[n, hidden]``."""
        h = self.activation(linear(x, self.gate_up_proj[e], self.gate_up_proj_bias[e]))
        return linear(h, self.down_proj[e], self.down_proj_bias[e])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        gate_up, gub = self.gate_up_proj, self.gate_up_proj_bias
        down, db = self.down_proj, self.down_proj_bias
        if (
            x.dim() == 2
            and x.shape[0] <= MAX_ROWS.get(x.dtype, 0)
            and fused_moe.available(x, gate_up, gub, down, db)
            and not torch.is_autocast_enabled("cpu")
        ):
            return fused_moe.gpt_oss_experts(
                x, weights, ids, gate_up, gub, down, db, self.alpha, self.limit
            )
        if capturing(x):
            return every_expert(x, weights, ids, self.num_experts, self.expert)
        return grouped_experts(x, weights, ids, self.num_experts, self.expert)

    def extra_repr(self) -> str:
        e, two_i, h = self.gate_up_proj.shape
        return (
            f"num_experts={e}, hidden={h}, intermediate={two_i // 2}, alpha={self.alpha}, "
            f"limit={self.limit}"
        )


@cache
def _triton_experts() -> Any:
    """``moe_triton.fused_experts``, or None where Triton does not import."""
    try:
        from foudre.layers import moe_triton
    except ImportError:
        return None
    return moe_triton.fused_experts


class RoutedRows:
    """Which rows of a forward the routers count in their ``expert_tokens``: the first
    ``limit`` (a 0-d int64 tensor on the counts' device, filled in place, so CUDA graphs
    replay what each step says; None: every row), and none while ``on`` is False (a CUDA
    graph's warm-up run). A model's sparse blocks share one (``LlamaForCausalLM.routed_rows``),
    so that the runner says it once a step."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.limit: torch.Tensor | None = None
        self.on = True
        self.device = device or torch.device("cpu")  # the counts' (the blocks keep it current)

    def set(self, rows: int) -> None:
        """Count only the first ``rows`` rows of the next forwards."""
        limit, device = self.limit, self.device
        if limit is None or limit.device != device:
            with torch.inference_mode(False):  # filled in and out of inference mode
                limit = self.limit = torch.zeros((), dtype=torch.int64, device=device)
        limit.fill_(rows)

    def counted(self, rows: int) -> int:
        """How many of a forward's ``rows`` count (reads ``limit`` on the host)."""
        if not self.on:
            return 0
        return rows if self.limit is None else min(rows, int(self.limit))


class SparseMoeBlock(nn.Module):
    """A mixture-of-experts MLP: the router ``gate`` (``[E, hidden]``, with a bias where
    ``router_bias``: gpt-oss), the routed ``experts`` (``Experts`` unless another module of
    its call is given: gpt-oss's ``ClampedSwiGLUExperts``), and optionally a ``shared_expert``
    every token goes through, scaled by ``sigmoid(shared_expert_gate(x))`` when
    ``shared_gate``. Parameter names are Hugging Face's (Qwen2-MoE, Qwen3-MoE, OLMoE, and
    Mixtral's once renamed).

    ``scoring``: ``"softmax"`` (``route``), or ``"sigmoid"`` for DeepSeek-V3's routing
    (``route_grouped`` with ``n_group``, ``topk_group``, ``routed_scaling_factor`` and the
    parameter ``e_score_correction_bias`` ``[E]``, which only the sigmoid variant has)."""

    expert_tokens: torch.Tensor

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        intermediate_size: int,
        renormalize: bool,
        shared_intermediate_size: int = 0,
        shared_gate: bool = False,
        scoring: str = "softmax",
        n_group: int = 1,
        topk_group: int = 1,
        routed_scaling_factor: float = 1.0,
        router_bias: bool = False,
        experts: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be within 1..num_experts={num_experts}")
        if scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"unknown expert scoring {scoring!r} (softmax, sigmoid)")
        if scoring == "sigmoid" and (
            n_group < 1 or num_experts % n_group or not 1 <= topk_group <= n_group
        ):
            raise ValueError(
                f"n_group={n_group} must divide num_experts={num_experts} and topk_group="
                f"{topk_group} be within 1..n_group"
            )
        if scoring == "sigmoid" and num_experts // n_group < 2:
            raise ValueError(f"n_group={n_group}: a group ranks by its two best experts")
        self.scoring = scoring
        self.n_group, self.topk_group = n_group, topk_group
        self.routed_scaling_factor = routed_scaling_factor
        self.e_score_correction_bias: nn.Parameter | None = None
        if scoring == "sigmoid":
            bias = torch.zeros(num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias, requires_grad=False)
        self.hidden_size = hidden_size
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Linear(hidden_size, num_experts, bias=router_bias)
        self.experts: nn.Module = (
            Experts(num_experts, hidden_size, intermediate_size) if experts is None else experts
        )
        self.shared_expert: GatedMLP | None = (
            GatedMLP(hidden_size, shared_intermediate_size) if shared_intermediate_size else None
        )
        self.shared_expert_gate: Linear | None = (
            Linear(hidden_size, 1, bias=False) if shared_intermediate_size and shared_gate else None
        )
        self.register_buffer(
            "expert_tokens", torch.zeros(num_experts, dtype=torch.int64), persistent=False
        )
        # which rows ``expert_tokens`` counts: its own until a model shares one among its blocks
        self.routed_rows = RoutedRows()

    @property
    def num_experts(self) -> int:
        return self.gate.out_features

    def _native(self, x: torch.Tensor) -> bool:
        """Whether this call can run as one native call (``fused.moe_block_unchecked``): a
        decode-sized CPU batch, the plain router and experts, nothing autograd records."""
        experts, gate = self.experts, self.gate
        return (
            (self.scoring == "softmax" or self._grouped_native())
            and x.shape[0] <= MAX_ROWS.get(x.dtype, 0)
            and type(experts) is Experts
            and type(gate) is Linear
            and gate.bias is None
            and fused.enabled(x, gate.weight, experts.gate_up_proj, experts.down_proj)
            and x.is_contiguous()
            and gate.weight.is_contiguous()
            and experts.gate_up_proj.is_contiguous()
            and experts.down_proj.is_contiguous()
            and self.expert_tokens.is_cpu
            and not torch.is_autocast_enabled("cpu")
        )

    def _grouped_native(self) -> bool:
        """Whether DeepSeek-V3's routing can run natively: its correction bias float32,
        contiguous, on the CPU."""
        bias = self.e_score_correction_bias
        return (
            bias is not None
            and bias.dtype == torch.float32
            and bias.is_cpu
            and bias.is_contiguous()
            and not fused.records_grad(bias)
        )

    def _native_routing(self, x: torch.Tensor) -> bool:
        """Whether DeepSeek-V3's routing of ``x`` runs natively (``grouped_moe_block``'s, which
        the native decode step runs): a decode-sized CPU batch, the plain router."""
        gate = self.gate
        return (
            type(gate) is Linear
            and gate.bias is None
            and x.dim() == 2
            and x.shape[0] <= MAX_ROWS.get(x.dtype, 0)
            and self._grouped_native()
            and fused.enabled(x, gate.weight)
            and x.is_contiguous()
            and gate.weight.is_contiguous()
            and not torch.is_autocast_enabled("cpu")
        )

    def routing(self) -> tuple[int, bool, torch.Tensor, int, int, float]:
        """DeepSeek-V3's routing as the native block takes it: top_k, renormalize, the
        correction bias, n_group, topk_group (the groups' limit where it limits), scaling."""
        assert self.e_score_correction_bias is not None
        groups = self.n_group if self.n_group > 1 and self.topk_group < self.n_group else 1
        return (
            self.top_k,
            self.renormalize,
            self.e_score_correction_bias,
            groups,
            self.topk_group if groups > 1 else 1,
            float(self.routed_scaling_factor),
        )

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routing ``(weights, ids)`` ``[T, top_k]`` of the rows ``x`` by this block's
        variant."""
        if self.e_score_correction_bias is None:
            return route(self.gate(x), self.top_k, self.renormalize)
        gate = self.gate
        if self._native_routing(x):  # the native block's routing (quantized experts' steps)
            return fused.route_grouped_unchecked(x, gate.weight, self.routing())
        if type(gate) is Linear:  # as DeepSeek routes: logits in float32
            logits = F.linear(x.float(), gate.weight.float())
        else:
            logits = gate(x)
        return route_grouped(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.renormalize,
            self.routed_scaling_factor,
        )

    def _apply(self, fn: Any, recurse: bool = True) -> SparseMoeBlock:
        """``nn.Module._apply`` (``to``, ``cuda``, ...), telling ``routed_rows`` where the
        counts now are, and keeping ``e_score_correction_bias`` float32 whatever the model's
        dtype: the expert choice compares biased scores finer than bfloat16 resolves a bias of
        several units (transformers keeps it float32 too)."""
        super()._apply(fn, recurse)
        self.routed_rows.device = self.expert_tokens.device
        bias = self.e_score_correction_bias
        if bias is not None and bias.dtype != torch.float32:
            bias.data = bias.data.float()
        return self

    def reset_stats(self) -> None:
        """Zero ``expert_tokens`` (also what a model built on the meta device needs, once its
        memory is allocated: ``routed_rows`` then learns where the counts are)."""
        self.expert_tokens.zero_()
        self.routed_rows.device = self.expert_tokens.device

    def _count(self, ids: torch.Tensor) -> None:
        """Add the routing ``ids`` ``[T, k]`` of the counted rows to ``expert_tokens``."""
        flat = ids.reshape(-1)
        limit = self.routed_rows.limit
        if limit is None:
            ones = torch.ones_like(flat)
        else:
            rows = torch.arange(ids.shape[0], device=ids.device)
            ones = (rows < limit).to(torch.int64)[:, None].expand(ids.shape).reshape(-1)
        self.expert_tokens.index_add_(0, flat, ones)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x = x.reshape(-1, self.hidden_size)
        if self._native(x):  # router, routing, counts and experts in one call
            experts = self.experts
            assert isinstance(experts, Experts)
            counted = self.routed_rows.counted(x.shape[0])
            if self.e_score_correction_bias is not None:  # DeepSeek-V3's routing
                out = fused.grouped_moe_block_unchecked(
                    x,
                    self.gate.weight,
                    experts.gate_up_proj,
                    experts.down_proj,
                    self.routing(),
                    self.expert_tokens,
                    counted,
                )
            else:
                out = fused.moe_block_unchecked(
                    x,
                    self.gate.weight,
                    experts.gate_up_proj,
                    experts.down_proj,
                    self.top_k,
                    self.renormalize,
                    self.expert_tokens,
                    counted,
                )
        else:
            weights, ids = self.route(x)
            if self.routed_rows.on:
                self._count(ids)
            out = self.experts(x, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                gate = self.shared_expert_gate(x)
                if fused.enabled(shared, gate):  # (the native decode step's C++: its bits)
                    shared = fused.sigmoid_gate(shared, gate)
                else:
                    shared = torch.sigmoid(gate) * shared
            out = out + shared
        return out.reshape(*lead, self.hidden_size)
