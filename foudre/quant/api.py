"""``quantize_(model, config)``: replace the model's linears by weight-only ``QuantLinear``s.

One config dataclass per scheme. ``config`` may also be a mapping ``pattern -> config | None``
(first matching pattern wins; ``None`` keeps the module in float). Patterns are ``fnmatch`` globs
matched against the module name (``model.layers.3.mlp.down_proj``) or any dotted suffix of it,
so ``"lm_head"``, ``"down_proj"``, ``"model.layers.0.*"`` all work.

``lm_head`` and the routers of mixture-of-experts layers (``mlp.gate``, ``shared_expert_gate``)
stay in float by default (``skip=None`` means ``SKIP``): the head is the most sensitive layer
(and when it is tied to ``embed_tokens`` quantizing it adds a copy rather than saving memory), a
router's rounding changes which experts a token reaches, and routers are small. Pass ``skip=()``
to quantize them; a tied head then becomes its own ``QuantLinear`` and the embedding keeps its
float weight, so embedding lookups are unchanged.

The routed experts of a mixture-of-experts layer (``layers/moe.Experts``, and gpt-oss's
``ClampedSwiGLUExperts`` with their biases and activation, matched by their module name
``model.layers.3.mlp.experts``) become ``QuantExperts``: every expert's projections
quantized round-to-nearest with the scheme's bits and groups (int8 and int4 only; the
calibration schemes refuse them), or become ``MXFP4Experts`` with ``MXFP4`` (method ``mxfp4``:
the experts alone, the other linears in float).

Calibration-based schemes (GPTQ, AWQ, MixedBits) take token id lists; the inputs of every
target linear are captured in one pass of the float model (not layer by layer).

``Fp8`` swaps linears for ``Fp8Linear`` instead (e4m3 weights, a scale per output channel; FP8
tensor-core products through ``torch._scaled_mm`` on Hopper, see ``foudre.quant.fp8``). It is
applied in memory at load only: quantized checkpoints hold ``QuantLinear``s.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

import foudre.quant.awq as awq_mod
from foudre.layers.moe import ClampedSwiGLUExperts, Experts
from foudre.layers.norm import RMSNorm
from foudre.models.llama import LlamaForCausalLM
from foudre.quant.calib import capture_inputs, default_calibration
from foudre.quant.experts import QuantExperts
from foudre.quant.fp8 import Fp8Linear
from foudre.quant.gptq import gptq_quantize, hessian
from foudre.quant.mxfp4 import MXFP4Experts, stacked_experts
from foudre.quant.packing import INT4_GROUP_SIZES, INT6_BLOCK, padded_k
from foudre.quant.qlinear import QuantLinear, uses_native_kernels

Calibration = Sequence[Sequence[int]]


def _check_group(bits: int, group_size: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    if bits == 4 and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")


@dataclass(frozen=True)
class Int8WeightOnly:
    """8-bit, one symmetric scale per output channel, round to nearest."""

    bits: int = 8


@dataclass(frozen=True)
class Int4WeightOnly:
    """4-bit, asymmetric scale and zero point per group of ``group_size`` input channels."""

    group_size: int = 128
    bits: int = 4

    def __post_init__(self) -> None:
        _check_group(4, self.group_size)


@dataclass(frozen=True)
class Int6WeightOnly:
    """6-bit in GGUF Q6_K's form (``packing.quantize_int6``): codes around 32, an int8 sub-scale
    per 16 input channels and a float scale per 256 (input features padded to a multiple of
    256). What ``int4`` takes its head to where our CPU kernels run it."""

    group_size: int = 16
    bits: int = 6

    def __post_init__(self) -> None:
        if (self.bits, self.group_size) != (6, 16):
            raise ValueError(
                f"Int6WeightOnly is 6 bits in groups of 16 (Q6_K's), got bits={self.bits}, "
                f"group_size={self.group_size}"
            )


@dataclass(frozen=True)
class GPTQ:
    """GPTQ error-corrected rounding. 4 bits: groups as ``Int4WeightOnly``; 8 bits: per channel
    (``group_size`` ignored). ``damp`` is the fraction of ``mean(diag H)`` added to ``H``."""

    bits: int = 4
    group_size: int = 128
    damp: float = 0.01
    block_size: int = 128
    calibration: Calibration | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_group(self.bits, self.group_size)


@dataclass(frozen=True)
class AWQ:
    """Activation-aware scaling searched on calibration inputs, then round to nearest."""

    bits: int = 4
    group_size: int = 128
    grid: int = 20
    calibration: Calibration | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_group(self.bits, self.group_size)


@dataclass(frozen=True)
class MixedBits:
    """4 or 8 bits per linear, allocated by measured sensitivity under a parameter-weighted
    ``average_bits`` budget (4.0 to 8.0, nominal bits, group scales not counted).

    Each linear's relative output error on calibration inputs is measured at 4 and 8 bits; 8 bits
    go first to the layers that gain the most error reduction per parameter, while the budget
    allows. ``algorithm`` is how each layer is then rounded: "rtn" or "gptq".
    """

    average_bits: float = 4.5
    group_size: int = 128
    algorithm: str = "rtn"
    calibration: Calibration | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_group(4, self.group_size)
        if not 4.0 <= self.average_bits <= 8.0:
            raise ValueError(f"average_bits must be within [4, 8], got {self.average_bits}")
        if self.algorithm not in ("rtn", "gptq"):
            raise ValueError(f"algorithm must be rtn or gptq, got {self.algorithm!r}")


@dataclass(frozen=True)
class Fp8:
    """float8 e4m3 weights, one scale per output channel (``Fp8Linear``)."""

    bits: int = 8


@dataclass(frozen=True)
class MXFP4:
    """MXFP4 (OCP FP4: E2M1 codes, a power-of-two scale per 32 inputs) for the routed experts
    of mixture-of-experts layers (``quant.mxfp4.MXFP4Experts``, gpt-oss's format); linears it
    is chosen for stay in float (``{"*experts": MXFP4(), "*": Int8WeightOnly()}`` quantizes
    both). Applied in memory at load, as ``Fp8``."""

    bits: int = 4


QuantConfig = (
    Int8WeightOnly | Int4WeightOnly | Int6WeightOnly | GPTQ | AWQ | MixedBits | Fp8 | MXFP4
)
METHODS = ("int8", "int4", "gptq", "awq", "mixed", "fp8", "mxfp4")
# kept in float unless ``skip`` says otherwise: the head, and the routers of MoE layers
SKIP = ("lm_head", "mlp.gate", "shared_expert_gate")


def config_for_method(
    method: str, calibration: Calibration | None = None, group_size: int = 128
) -> QuantConfig:
    """The config behind an engine / CLI method name (one of ``METHODS``)."""
    if method == "int8":
        return Int8WeightOnly()
    if method == "int4":
        return Int4WeightOnly(group_size=group_size)
    if method == "gptq":
        return GPTQ(group_size=group_size, calibration=calibration)
    if method == "awq":
        return AWQ(group_size=group_size, calibration=calibration)
    if method == "mixed":
        return MixedBits(group_size=group_size, calibration=calibration)
    if method == "fp8":
        return Fp8()
    if method == "mxfp4":
        return MXFP4()
    raise ValueError(f"unknown quantization method {method!r}; choose one of {', '.join(METHODS)}")


def quantize_model(
    model: LlamaForCausalLM, method: str, calibration: list[list[int]] | None = None
) -> None:
    """Quantize ``model`` in place with ``method`` (``int8``, ``int4`` (g128), ``gptq``, ``awq``,
    ``mixed``, ``fp8``, ``mxfp4`` (the routed experts only); 4-bit group 128). ``int8`` and
    ``int4`` quantize ``lm_head`` too, at higher precision as llama.cpp keeps its output layer
    (Q8_0 in Q8_0 files, Q6_K in Q4_0 ones): ``int8`` to int8 per channel, ``int4`` to 6 bits in
    Q6_K's form where our CPU kernels run it and it is smaller than int8 (``six_bit_head``),
    else int8 per channel. In a 0.5B
    model with a 32k vocabulary the head is a fifth of the weights a decode step reads. The
    other methods keep it in float. The calibration schemes use ``calibration`` token ids, or
    deterministic random ids when it is None. Raises ``ValueError`` naming the choices for an
    unknown method."""
    config = config_for_method(method, calibration)
    if method in ("int8", "int4"):
        head_config: QuantConfig = Int8WeightOnly()
        if method == "int4" and six_bit_head(model.lm_head):
            head_config = Int6WeightOnly()
        head: dict[str, QuantConfig | None] = {"lm_head": head_config, "*": config}
        quantize_(model, head, skip=[p for p in SKIP if p != "lm_head"])
    else:
        quantize_(model, config)


def six_bit_head(head: nn.Module) -> bool:
    """Whether ``int4`` takes ``head`` to 6 bits: a float linear on the CPU whose products run
    on our kernels (``uses_native_kernels``; elsewhere 6 bits dequantize at every call), and
    at least 5% fewer bytes than int8 (13/16 of a byte per input feature padded to 256, against
    one). Decided as the model is quantized: a model moved afterwards to CUDA, or run with
    ``FOUDRE_NATIVE_QMATMUL=0``, dequantizes its 6-bit head at every call (with a warning)."""
    if not isinstance(head, nn.Linear) or head.weight.device.type != "cpu":
        return False
    k = head.in_features
    smaller = 20 * 13 * padded_k(k, INT6_BLOCK) <= 19 * 16 * k
    return smaller and uses_native_kernels(head.weight.dtype)


def matches(name: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, "*." + pattern)


def _plan(
    model: nn.Module,
    config: QuantConfig | Mapping[str, QuantConfig | None],
    skip: Iterable[str] | None,
) -> dict[str, QuantConfig]:
    skip = SKIP if skip is None else tuple(skip)
    plan: dict[str, QuantConfig] = {}
    for name, mod in model.named_modules():
        targeted = isinstance(mod, nn.Linear | Experts) or stacked_experts(mod)
        if not targeted or any(matches(name, p) for p in skip):
            continue
        if isinstance(config, Mapping):
            chosen = next((c for p, c in config.items() if matches(name, p)), None)
            if chosen is None:
                continue
            plan[name] = chosen
        else:
            plan[name] = config
    return plan


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def _relative_error(x: torch.Tensor, w: torch.Tensor, wq: torch.Tensor) -> float:
    x = x.to(w.device)  # calibration inputs are kept on the CPU
    ref = x @ w.t()
    return ((x @ wq.t() - ref).pow(2).sum() / ref.pow(2).sum().clamp(min=1e-20)).item()


@torch.no_grad()
def quantize_(
    model: LlamaForCausalLM,
    config: QuantConfig | Mapping[str, QuantConfig | None],
    skip: Iterable[str] | None = None,
) -> dict[str, dict[str, int | None]]:
    """Replace each target ``nn.Linear`` of ``model`` by a ``QuantLinear`` (``Fp8Linear``
    for ``Fp8``) in place.

    Returns the per-module scheme ``{name: {"bits", "group_size"}}`` that was applied (what
    checkpoints record). The model's float weights other than the targets are kept, except the
    RMSNorm / v / up weights AWQ folds its scales into (the float function is unchanged).
    """
    plan = _plan(model, config, skip)
    applied = _quantize_experts(model, plan)
    needs_calib = [n for n, c in plan.items() if isinstance(c, GPTQ | AWQ | MixedBits)]
    inputs: dict[str, torch.Tensor] = {}
    if needs_calib:
        calib: Calibration | None = next(
            (c.calibration for c in plan.values() if getattr(c, "calibration", None) is not None),  # type: ignore[union-attr]
            None,
        )
        if calib is None:
            calib = default_calibration(model.config.vocab_size)
        inputs = capture_inputs(model, needs_calib, calib, max_tokens=2048)

    modules = dict(model.named_modules())
    # AWQ: search and fold scales while every weight is still float. o_proj/down_proj first,
    # since their scales fold into qkv_proj/gate_up_proj rows, which are searched afterwards.
    input_scales: dict[str, torch.Tensor] = {}
    awq_names = [n for n, c in plan.items() if isinstance(c, AWQ)]
    order = {"o_proj": 0, "down_proj": 0, "qkv_proj": 1, "gate_up_proj": 1}
    for name in sorted(awq_names, key=lambda n: order.get(n.rsplit(".", 1)[-1], 2)):
        cfg = plan[name]
        assert isinstance(cfg, AWQ)
        _apply_awq(model, modules, name, cfg, inputs[name], input_scales)

    mixed_bits = _allocate_bits(model, plan, inputs)
    for name, cfg in plan.items():
        lin = modules[name]
        assert isinstance(lin, nn.Linear)
        w = lin.weight.detach().float()
        bias = lin.bias.detach() if lin.bias is not None else None
        if isinstance(cfg, Fp8):
            fp8 = Fp8Linear.from_float(w, bias).to(dtype=lin.weight.dtype)
            _set_module(model, name, fp8.to(device=lin.weight.device))
            applied[name] = {"bits": 8, "group_size": None}
            continue
        bits = (
            mixed_bits.get(name, cfg.bits) if not isinstance(cfg, MixedBits) else mixed_bits[name]
        )
        group = getattr(cfg, "group_size", None) if bits in (4, 6) else None
        use_gptq = isinstance(cfg, GPTQ) or (isinstance(cfg, MixedBits) and cfg.algorithm == "gptq")
        if use_gptq:
            damp = cfg.damp if isinstance(cfg, GPTQ) else 0.01
            block = cfg.block_size if isinstance(cfg, GPTQ) else 128
            q, s, z = gptq_quantize(w, hessian(inputs[name]), bits, group, damp, block)
            new = QuantLinear.from_codes(
                q, s, z, bias, bits, group, lin.in_features, dtype=lin.weight.dtype
            )
        else:
            iscale = input_scales.get(name)
            new = QuantLinear.from_float(w, bias, bits, group, input_scale=iscale)
            new = new.to(dtype=lin.weight.dtype) if lin.weight.dtype.is_floating_point else new
        new = new.to(device=lin.weight.device)
        _set_module(model, name, new)
        applied[name] = {"bits": bits, "group_size": group}
    return applied


def _quantize_experts(
    model: nn.Module, plan: dict[str, QuantConfig]
) -> dict[str, dict[str, int | None]]:
    """The routed experts of ``plan`` quantized (``QuantExperts`` for int8 / int4,
    ``MXFP4Experts`` for ``MXFP4``, which also takes experts of ``Experts``' layout with biases
    and an activation of their own; both take gpt-oss's ``ClampedSwiGLUExperts``) and taken out
    of it, with the linears ``MXFP4`` was chosen for (they stay in float); what was applied.
    ``ValueError`` for another scheme on experts, or for ``MXFP4`` on a model without experts."""
    modules = dict(model.named_modules())
    applied: dict[str, dict[str, int | None]] = {}
    chosen_mxfp4 = any(isinstance(c, MXFP4) for c in plan.values())
    for name in [n for n in plan if not isinstance(modules[n], nn.Linear)]:
        cfg = plan.pop(name)
        experts = modules[name]
        if isinstance(cfg, MXFP4):  # Experts, or experts of their layout with their activation
            _set_module(model, name, MXFP4Experts.from_experts(experts))
            applied[name] = {"bits": 4, "group_size": 32}
            continue
        if not isinstance(experts, Experts | ClampedSwiGLUExperts):  # (kept in float)
            continue
        if not isinstance(cfg, Int8WeightOnly | Int4WeightOnly):
            if isinstance(experts, ClampedSwiGLUExperts):
                continue  # (gpt-oss's experts kept in float under other schemes)
            raise ValueError(
                f"{name}: mixture-of-experts experts can be quantized with int8, int4 or mxfp4 "
                f"only, not {type(cfg).__name__}"
            )
        group = getattr(cfg, "group_size", None) if cfg.bits == 4 else None
        _set_module(model, name, QuantExperts.from_experts(experts, cfg.bits, group))
        applied[name] = {"bits": cfg.bits, "group_size": group}
    for name in [n for n, c in plan.items() if isinstance(c, MXFP4)]:
        del plan[name]
    if chosen_mxfp4 and not any(isinstance(m, MXFP4Experts) for m in model.modules()):
        raise ValueError(
            "mxfp4 quantizes the routed experts of mixture-of-experts layers: this model has none "
            "(int8 or int4 quantize its linears)"
        )
    return applied


def _apply_awq(
    model: LlamaForCausalLM,
    modules: dict[str, nn.Module],
    name: str,
    cfg: AWQ,
    x: torch.Tensor,
    input_scales: dict[str, torch.Tensor],
) -> None:
    lin = modules[name]
    assert isinstance(lin, nn.Linear)
    group = cfg.group_size if cfg.bits == 4 else None
    prefix, _, leaf = name.rpartition(".")
    block = prefix.rpartition(".")[0]  # model.layers.i
    mcfg = model.config
    x_mean = None
    if leaf == "o_proj" and isinstance(modules.get(prefix + ".qkv_proj"), nn.Linear):
        x_mean = awq_mod.shared_kv_stat(
            x.abs().mean(0), mcfg.num_attention_heads, mcfg.num_key_value_heads
        )
    s = awq_mod.search_scale(lin.weight, x, cfg.bits, group, x_mean, cfg.grid)
    lin.weight.mul_(s.to(lin.weight.dtype)[None, :])
    inv = (1.0 / s).to(lin.weight.dtype)
    norm = "input_layernorm" if leaf == "qkv_proj" else "post_attention_layernorm"
    # the norm before q|k|v or gate|up, when it is Llama's (Gemma's norms around its sublayers
    # multiply by 1 + weight, and its MLP's input norm is another: no fold there)
    if leaf in ("qkv_proj", "gate_up_proj") and type(modules.get(f"{block}.{norm}")) is RMSNorm:
        norm_weight = modules[f"{block}.{norm}"].weight
        assert isinstance(norm_weight, torch.Tensor)
        norm_weight.mul_(inv)
    elif leaf == "o_proj" and x_mean is not None:
        qkv = modules[prefix + ".qkv_proj"]
        assert isinstance(qkv, nn.Linear)
        group_heads = mcfg.num_attention_heads // mcfg.num_key_value_heads
        s_kv = inv.view(mcfg.num_key_value_heads, group_heads, mcfg.head_dim)[:, 0].reshape(-1)
        start = mcfg.q_size + mcfg.kv_size
        qkv.weight[start:].mul_(s_kv[:, None])
        if qkv.bias is not None:
            qkv.bias[start:].mul_(s_kv)
    elif leaf == "down_proj" and isinstance(modules.get(prefix + ".gate_up_proj"), nn.Linear):
        gate_up = modules[prefix + ".gate_up_proj"]
        assert isinstance(gate_up, nn.Linear)
        gate_up.weight[mcfg.intermediate_size :].mul_(inv[:, None])
    else:
        # no foldable producer: the weight keeps W*s and the module multiplies its input by 1/s
        input_scales[name] = (1.0 / s).float()


def _allocate_bits(
    model: LlamaForCausalLM, plan: dict[str, QuantConfig], inputs: dict[str, torch.Tensor]
) -> dict[str, int]:
    """Bits per MixedBits-planned module: 8 to the most sensitive (per parameter) first,
    keeping the parameter-weighted average within the budget."""
    names = [n for n, c in plan.items() if isinstance(c, MixedBits)]
    if not names:
        return {}
    cfg = plan[names[0]]
    assert isinstance(cfg, MixedBits)
    modules = dict(model.named_modules())
    gains: list[tuple[float, str]] = []
    sizes: dict[str, int] = {}
    for name in names:
        lin = modules[name]
        assert isinstance(lin, nn.Linear)
        w, x = lin.weight.detach().float(), inputs[name][:512]
        e4 = _relative_error(x, w, awq_mod.fake_quantize(w, 4, cfg.group_size))
        e8 = _relative_error(x, w, awq_mod.fake_quantize(w, 8, None))
        sizes[name] = w.numel()
        gains.append(((e4 - e8) / w.numel(), name))
    total = sum(sizes.values())
    budget = cfg.average_bits * total
    used = 4.0 * total
    bits = dict.fromkeys(names, 4)
    for _, name in sorted(gains, reverse=True):
        extra = 4.0 * sizes[name]
        if used + extra <= budget + 1e-6:
            bits[name] = 8
            used += extra
    return bits
