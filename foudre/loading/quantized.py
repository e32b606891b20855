"""Quantized checkpoints: write ours, read ours and Hugging Face GPTQ / AWQ ones.

Ours is a Hugging Face directory whose ``config.json`` carries::

    "quantization_config": {"quant_method": "foudre", "format_version": 1, "scheme": "gptq",
                            "bits": 4, "group_size": 128,
                            "modules": {"model.layers.0.self_attn.qkv_proj":
                                        {"bits": 4, "group_size": 128, "bias": false,
                                         "input_scale": false, "perm": false}, ...}}

and whose ``model.safetensors`` holds foudre's own (fused) names: ``...qkv_proj.qweight``,
``.scales``, ``.zeros``, ``.bias``, ``.input_scale``, ``.perm`` for quantized modules, and the
float tensors of everything else (norms as AWQ left them). Loading rebuilds the modules from the
recorded layout and copies the tensors: no quantization is recomputed.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

from foudre.layers.rotary import init_rotary_tables
from foudre.loading.hf import SliceSelector, iter_safetensors_weights, load_hf_config
from foudre.loading.memory import releasing
from foudre.loading.writer import copy_tokenizer, float_dtype, hf_config_dict, write_configs
from foudre.models.llama import LlamaForCausalLM
from foudre.models.registry import build_model
from foudre.quant.hf_import import Int4Codes, awq_codes, gptq_codes
from foudre.quant.packing import INT4_GROUP_SIZES
from foudre.quant.qlinear import QuantLinear

# what a shard does to the float weights before they are loaded (pad its vocabulary rows)
WeightsFilter = Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]]


def read_quantization_config(model_dir: str | Path) -> dict[str, Any] | None:
    """``quantization_config`` of ``model_dir/config.json``, or None (also for a file path)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    qc = json.loads(path.read_text()).get("quantization_config")
    return qc if isinstance(qc, dict) else None


def is_quantized_checkpoint(model_dir: str | Path) -> bool:
    """True when ``load_quantized`` must load ``model_dir`` instead of ``load_weights``."""
    qc = read_quantization_config(model_dir)
    return qc is not None and qc.get("quant_method") in ("foudre", "gptq", "awq")


def _set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, attr, new)


def quantization_config(
    model: LlamaForCausalLM, scheme: str, extra: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The ``quantization_config`` describing every ``QuantLinear`` of ``model``."""
    modules: dict[str, Any] = {}
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            modules[name] = {
                "bits": mod.bits,
                "group_size": mod.group_size,
                "bias": mod.bias is not None,
                "input_scale": mod.input_scale is not None,
                "perm": mod.perm is not None,
                "zero_point": mod.bits == 8 and mod.zeros is not None,
                "scale_dtype": str(mod.scales.dtype).removeprefix("torch."),
            }
    bits = [m["bits"] for m in modules.values()]
    groups = [m["group_size"] for m in modules.values() if m["group_size"] is not None]
    return {
        "quant_method": "foudre",
        "format_version": 1,
        "scheme": scheme,
        "bits": max(set(bits), key=bits.count) if bits else None,
        "group_size": max(set(groups), key=groups.count) if groups else None,
        "average_bits": _average_bits(model, modules),
        "modules": modules,
        **(extra or {}),
    }


def _average_bits(model: LlamaForCausalLM, modules: dict[str, Any]) -> float | None:
    weighted = total = 0
    for name, spec in modules.items():
        mod = model.get_submodule(name)
        assert isinstance(mod, QuantLinear)
        size = mod.in_features * mod.out_features
        weighted += spec["bits"] * size
        total += size
    return weighted / total if total else None


def save_quantized(
    model: LlamaForCausalLM,
    output: str | Path,
    scheme: str,
    tokenizer_source: str | Path | None = None,
) -> Path:
    """Write ``model`` (after ``quantize_``) as a directory ``load_quantized`` reads back into
    identical modules. Returns the directory."""
    if model.config.is_moe:
        raise ValueError(
            "quantized mixture-of-experts checkpoints are not written; quantize at load time "
            "instead (--quantization int8 or int4)"
        )
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    raw = hf_config_dict(cfg, float_dtype(model))
    raw["quantization_config"] = quantization_config(model, scheme)
    write_configs(out, raw, cfg)
    state = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict().items():
        if id(tensor) in seen or tensor.data_ptr() in seen:
            continue  # a tied lm_head shares the embedding's storage
        seen.add(tensor.data_ptr())
        state[name] = tensor.detach().cpu().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer_source is not None:
        copy_tokenizer(tokenizer_source, out)
    return out


def load_quantized(
    model: LlamaForCausalLM,
    model_dir: str | Path,
    select: SliceSelector | None = None,
    prepare: WeightsFilter | None = None,
) -> None:
    """Load the quantized checkpoint at ``model_dir`` into ``model`` (built from its config.json,
    in the target dtype and device, weights not loaded), replacing linears by ``QuantLinear``.

    Handles ``quant_method`` "foudre" (ours), "gptq" (4-bit, v1 or v2 zeros, act-order) and
    "awq" (4-bit GEMM). Raises ``ValueError`` naming any tensor missing or unexpected.

    A shard of a parallel model (``foudre/distributed``) passes ``select``, which says what it
    holds of each Hugging Face-named weight (``hf.iter_safetensors_slices``), and ``prepare``,
    applied to the float weights before they are loaded. GPTQ and AWQ only: each linear's codes
    are cut by output rows, or by input columns in whole groups (a linear in act-order, or cut
    inside a group, stays float, dequantized, as unshardable layouts do on one device).
    """
    qc = read_quantization_config(model_dir)
    if qc is None:
        raise ValueError(f"{model_dir}: config.json has no quantization_config")
    method = qc.get("quant_method")
    if method == "foudre" and select is None:
        _load_foudre(model, Path(model_dir), qc)
    elif method in ("gptq", "awq"):
        _load_hf_int4(model, Path(model_dir), qc, select, prepare)
    elif method == "foudre":
        raise ValueError(f"{model_dir}: foudre's quantized checkpoints do not load sharded")
    else:
        raise ValueError(f"{model_dir}: unsupported quant_method {method!r}")


def _load_foudre(model: LlamaForCausalLM, model_dir: Path, qc: dict[str, Any]) -> None:
    ref = model.model.embed_tokens.weight
    for name, spec in qc["modules"].items():
        lin = model.get_submodule(name)
        if not isinstance(lin, nn.Linear):
            raise ValueError(f"{model_dir}: {name!r} is not a linear of this model")
        new = QuantLinear(
            lin.in_features,
            lin.out_features,
            spec["bits"],
            spec.get("group_size"),
            bias=spec.get("bias", False),
            input_scale=spec.get("input_scale", False),
            perm=spec.get("perm", False),
            dtype=ref.dtype,
            device=ref.device,
            scale_dtype=getattr(torch, spec["scale_dtype"]) if "scale_dtype" in spec else None,
            zero_point=spec.get("zero_point", False),
        )
        _set_module(model, name, new)
    state = model.state_dict()
    loaded: set[str] = set()
    for name, tensor in releasing(iter_safetensors_weights(model_dir)):
        dest = state.get(name)
        if dest is None:
            raise ValueError(f"{model_dir}: unexpected tensor {name!r}")
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(
                f"{model_dir}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                f"expected {tuple(dest.shape)}"
            )
        with torch.no_grad():
            dest.copy_(tensor)
        loaded.add(name)
    tied = model.config.tie_word_embeddings and not isinstance(model.lm_head, QuantLinear)
    missing = [n for n in state if n not in loaded and not (tied and n == "lm_head.weight")]
    if missing:
        raise ValueError(f"{model_dir}: tensors missing from the checkpoint: {missing[:5]}")
    for mod in model.modules():
        if isinstance(mod, QuantLinear):
            mod.invalidate_layouts()


_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def _int4_format(model_dir: Path, qc: dict[str, Any]) -> tuple[int, int]:
    """``(group_size, zero_offset)`` of a GPTQ / AWQ ``quantization_config``, checked to be
    a layout we read (4 bits; AWQ's GEMM)."""
    method = qc["quant_method"]
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group_size = int(qc.get("group_size", qc.get("q_group_size", 128)))
    if bits != 4:
        raise ValueError(f"{model_dir}: only 4-bit {method} checkpoints are supported, got {bits}")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise ValueError(f"{model_dir}: only the AWQ GEMM layout is supported")
    zero_offset = 0 if qc.get("checkpoint_format") == "gptq_v2" else 1
    return group_size, zero_offset


def _read_int4_tensors(
    model_dir: Path, select: SliceSelector | None
) -> tuple[list[tuple[str, torch.Tensor]], dict[str, dict[str, torch.Tensor]]]:
    """``(floats, parts)``: the checkpoint's float tensors (this shard's slices with
    ``select``), and its packed ones by linear (``qweight``, ``qzeros``, ``scales``, ...)."""
    floats: list[tuple[str, torch.Tensor]] = []
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in iter_safetensors_weights(model_dir):
        prefix, _, leaf = name.rpartition(".")
        if leaf in _QUANT_SUFFIXES:
            parts.setdefault(prefix, {})[leaf] = tensor
        elif select is None:
            floats.append((name, tensor))
        elif (chosen := select(name, tuple(tensor.shape))) is not None:
            new_name, index = chosen
            floats.append((new_name, tensor if index is None else tensor[index].contiguous()))
    return floats, parts


def _decode_int4(
    parts: dict[str, dict[str, torch.Tensor]],
    method: str,
    group_size: int,
    zero_offset: int,
    select: SliceSelector | None,
    floats: list[tuple[str, torch.Tensor]],
) -> dict[str, Int4Codes]:
    """Each linear's codes by module name (this shard's slice with ``select``), its dequantized
    weight appended to ``floats`` (only that, where a slice is not in whole groups)."""
    codes: dict[str, Int4Codes] = {}
    for prefix, t in parts.items():
        try:
            if method == "gptq":
                c = gptq_codes(
                    t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), group_size, zero_offset
                )
            else:
                c = awq_codes(t["qweight"], t["qzeros"], t["scales"], group_size)
        except ValueError as e:
            raise ValueError(f"{prefix}.qweight: {e}") from None
        name = prefix + ".weight"
        if select is not None:
            chosen = select(name, tuple(c.codes.shape))
            if chosen is None:
                continue
            name, index = chosen
            cut = c if index is None else _cut_codes(c, index)
            if cut is None:  # not in whole groups: this shard's slice, in float
                floats.append((name, c.dequantize()[index].contiguous()))
                continue
            c = cut
        codes[name.removesuffix(".weight")] = c
        floats.append((name, c.dequantize()))
    return codes


def _swap_in_int4(model: LlamaForCausalLM, codes: dict[str, Int4Codes]) -> None:
    """Rebuild each (fused) linear from its exact codes where the parts share one layout."""
    targets: dict[str, list[tuple[int, Int4Codes]]] = {}
    for prefix, c in codes.items():
        parent, _, leaf = prefix.rpartition(".")
        fused, order = _FUSED.get(leaf, (leaf, 0))
        targets.setdefault(f"{parent}.{fused}" if parent else fused, []).append((order, c))
    for name, items in targets.items():
        lin = model.get_submodule(name)
        assert isinstance(lin, nn.Linear)
        group = [c for _, c in sorted(items, key=lambda i: i[0])]
        first = group[0]
        same_perm = all(
            (c.perm is None and first.perm is None)
            or (c.perm is not None and first.perm is not None and torch.equal(c.perm, first.perm))
            for c in group
        )
        total = sum(c.codes.shape[0] for c in group)
        if (
            not same_perm
            or first.group_size not in INT4_GROUP_SIZES
            or first.codes.shape[1] % first.group_size
            or total != lin.out_features
        ):
            continue  # stays the float (dequantized) linear
        new = QuantLinear.from_codes(
            torch.cat([c.codes for c in group]),
            torch.cat([c.scales for c in group]),
            torch.cat([c.zeros for c in group]),
            lin.bias.detach() if lin.bias is not None else None,
            4,
            first.group_size,
            lin.in_features,
            perm=first.perm,
            dtype=lin.weight.dtype,
        ).to(device=lin.weight.device)
        _set_module(model, name, new)


def _load_hf_int4(
    model: LlamaForCausalLM,
    model_dir: Path,
    qc: dict[str, Any],
    select: SliceSelector | None = None,
    prepare: WeightsFilter | None = None,
) -> None:
    group_size, zero_offset = _int4_format(model_dir, qc)
    floats, parts = _read_int4_tensors(model_dir, select)
    codes = _decode_int4(parts, qc["quant_method"], group_size, zero_offset, select, floats)
    # validates names and shapes; quantized ones as dequantized
    model.load_weights(floats if prepare is None else prepare(floats))
    _swap_in_int4(model, codes)


def _cut_codes(c: Int4Codes, index: tuple[slice, ...]) -> Int4Codes | None:
    """``c`` cut to ``weight[index]``: output rows, or input columns in whole groups of a
    linear in order (None for another cut: no exact codes for it)."""
    rows = index[0]
    if len(index) == 1:
        return Int4Codes(c.codes[rows], c.scales[rows], c.zeros[rows], c.group_size, c.perm)
    cols, g = index[1], c.group_size
    start, stop, _ = cols.indices(c.codes.shape[1])
    if c.perm is not None or start % g or stop % g:
        return None
    groups = slice(start // g, stop // g)
    return Int4Codes(
        c.codes[rows, cols].contiguous(),
        c.scales[rows, groups].contiguous(),
        c.zeros[rows, groups].contiguous(),
        g,
    )


def build_quantized_model(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> LlamaForCausalLM:
    """A ready (eval) model from a quantized checkpoint directory, built the way
    ``foudre.loading.loader.load_model`` builds one, with ``load_quantized`` for the weights."""
    cfg = load_hf_config(Path(model_dir))
    device = torch.device(device)
    with torch.device("meta"):
        net = build_model(cfg)
    net = net.to_empty(device=device).to(dtype)
    init_rotary_tables(net, device)
    net.reset_moe_stats()
    if cfg.tie_word_embeddings:
        net.lm_head.weight = net.model.embed_tokens.weight
    load_quantized(net, model_dir)
    return net.eval()
