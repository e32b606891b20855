"""GPTQ (AutoGPTQ / GPTQModel) and AutoAWQ GEMM layouts, packed here the way those tools pack."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from foudre.loading.quantized import build_quantized_model
from foudre.quant import cpu_qmatmul
from foudre.quant.hf_import import AWQ_ORDER, awq_codes, gptq_codes
from foudre.quant.qlinear import QuantLinear


def _fit(w: torch.Tensor, group: int, g_idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Asymmetric 4-bit fit (zeros in 0..15, range including 0, as GPTQ does) per g_idx group:
    codes [K, N], scales [G, N], zeros [G, N]."""
    n, k = w.shape
    ng = k // group
    scales, zeros = torch.zeros(ng, n), torch.zeros(ng, n)
    q = torch.zeros(k, n, dtype=torch.int32)
    for g in range(ng):
        cols = (g_idx == g).nonzero().flatten()
        sub = w[:, cols]
        lo, hi = sub.amin(1).clamp(max=0), sub.amax(1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=1e-8)
        z = torch.round(-lo / s).clamp(0, 15)
        scales[g], zeros[g] = s, z
        q[cols] = (torch.round(sub / s[:, None]) + z[:, None]).clamp(0, 15).t().int()
    return q, scales, zeros


def _pack_gptq_rows(q: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's qweight: [K, N] -> [K/8, N], row 8i+j in bits 4j."""
    k, n = q.shape
    out = torch.zeros(k // 8, n, dtype=torch.int64)
    for j in range(8):
        out |= q[j::8].long() << (4 * j)
    return out.to(torch.int32) if out.max() < 2**31 else (out - (out >= 2**31).long() * 2**32).int()


def _pack_cols(q: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] -> [R, C/8]: column 8j + order[i] in bits 4i (AutoAWQ's pack loop)."""
    r, c = q.shape
    out = torch.zeros(r, c // 8, dtype=torch.int64)
    for i in range(8):
        out |= q[:, order[i] :: 8].long() << (4 * i)
    return (out - (out >= 2**31).long() * 2**32).to(torch.int32)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("v2", [False, True])
def test_gptq_layout(act_order: bool, v2: bool) -> None:
    torch.manual_seed(0)
    n, k, group = 48, 128, 32
    w = torch.randn(n, k)
    perm = torch.randperm(k) if act_order else torch.arange(k)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = torch.arange(k, dtype=torch.int32) // group  # AutoGPTQ's desc_act g_idx
    q, s, z = _fit(w, group, g_idx)
    s = s.half().float()  # the checkpoint stores float16 scales
    stored_z = z - (0 if v2 else 1)
    codes = gptq_codes(
        _pack_gptq_rows(q), _pack_cols(stored_z.int()), s.half(), g_idx, group, 0 if v2 else 1
    )
    expected = s[g_idx.long()].t() * (q.t().float() - z[g_idx.long()].t())
    got = codes.dequantize()
    assert torch.allclose(got, expected, atol=1e-5)
    assert (got - w).abs().max() <= s.max() / 2 + 1e-3
    assert (codes.perm is not None) == act_order
    mod = QuantLinear.from_codes(codes.codes, codes.scales, codes.zeros, None, 4, group, k,
                                 perm=codes.perm)  # fmt: skip
    x = torch.randn(5, k)
    assert torch.allclose(mod.forward_reference(x), x @ got.t(), atol=1e-3)
    xp, wd = mod._prepare_input(x), mod.dequantize()
    tol = 1e-3 + cpu_qmatmul.error_bound(xp, wd, mod.bits, mod.group_size)
    assert bool(((mod(x) - x @ got.t()).abs() <= tol).all())


def test_awq_layout() -> None:
    torch.manual_seed(1)
    n, k, group = 64, 128, 64
    w = torch.randn(n, k)
    q, s, z = _fit(w, group, torch.arange(k) // group)
    codes = awq_codes(_pack_cols(q, AWQ_ORDER), _pack_cols(z.int(), AWQ_ORDER), s.half(), group)
    got = codes.dequantize()
    expected = (
        q.t().float() - z.repeat_interleave(group, 0).t()
    ) * s.half().float().repeat_interleave(group, 0).t()
    assert torch.allclose(got, expected, atol=1e-5)
    assert (got - w).abs().max() <= s.max() / 2 + 1e-2


def test_load_hf_gptq_and_awq_directories(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from tests.conftest import make_hf_model

    src = make_hf_model(tmp_path / "src", intermediate_size=128)
    from safetensors.torch import load_file

    state = load_file(str(src / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    group = 32
    for method in ("gptq", "awq"):
        out = tmp_path / method
        out.mkdir()
        tensors: dict[str, torch.Tensor] = {}
        expected: dict[str, torch.Tensor] = {}
        for name, t in state.items():
            if t.dim() == 2 and "proj" in name:
                prefix = name[: -len(".weight")]
                q, s, z = _fit(t, group, torch.arange(t.shape[1]) // group)
                if method == "gptq":
                    tensors[prefix + ".qweight"] = _pack_gptq_rows(q)
                    tensors[prefix + ".qzeros"] = _pack_cols((z - 1).int())
                    tensors[prefix + ".g_idx"] = (torch.arange(t.shape[1]) // group).int()
                else:
                    tensors[prefix + ".qweight"] = _pack_cols(q, AWQ_ORDER)
                    tensors[prefix + ".qzeros"] = _pack_cols(z.int(), AWQ_ORDER)
                tensors[prefix + ".scales"] = s.half()
                hs = s.half().float().repeat_interleave(group, 0)
                expected[name] = ((q.float() - z.repeat_interleave(group, 0)) * hs).t()
            else:
                tensors[name] = t
        save_file(tensors, str(out / "model.safetensors"))
        qc = {"quant_method": method, "bits": 4, "group_size": group}
        if method == "awq":
            qc["version"] = "gemm"
        (out / "config.json").write_text(json.dumps({**raw, "quantization_config": qc}))
        model = build_quantized_model(out)
        qkv = model.get_submodule("model.layers.0.self_attn.qkv_proj")
        assert isinstance(qkv, QuantLinear)
        ref = torch.cat([expected[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.allclose(qkv.effective_weight(), ref, atol=1e-5)
        assert isinstance(model.get_submodule("model.layers.1.mlp.gate_up_proj"), QuantLinear)


def test_group_size_that_does_not_divide_the_features_is_named(tmp_path: Path) -> None:
    """A checkpoint whose ``group_size`` does not cut a linear's input features into its
    scales' groups fails to load with the tensor's name, not a reshape error."""
    torch.manual_seed(2)
    n, k, group = 64, 128, 64
    q, s, z = _fit(torch.randn(n, k), group, torch.arange(k) // group)
    packed = (_pack_gptq_rows(q), _pack_cols((z - 1).int()), s.half())
    with pytest.raises(ValueError, match="group_size 48 does not divide its 128 input features"):
        gptq_codes(*packed, None, 48)
    with pytest.raises(ValueError, match="group_size 48"):
        awq_codes(_pack_cols(q, AWQ_ORDER), _pack_cols(z.int(), AWQ_ORDER), s.half(), 48)
    pytest.importorskip("transformers")
    from foudre.loading.errors import ModelLoadError
    from foudre.loading.loader import load_model
    from tests.conftest import make_hf_model

    src = make_hf_model(tmp_path / "src", intermediate_size=128)
    from safetensors.torch import load_file

    state = load_file(str(src / "model.safetensors"))
    tensors: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if t.dim() == 2 and "proj" in name:
            prefix = name[: -len(".weight")]
            q, s, z = _fit(t, 32, torch.arange(t.shape[1]) // 32)
            tensors[prefix + ".qweight"] = _pack_gptq_rows(q)
            tensors[prefix + ".qzeros"] = _pack_cols((z - 1).int())
            tensors[prefix + ".scales"] = s.half()
        else:
            tensors[name] = t
    out = tmp_path / "bad"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 48}
    (out / "config.json").write_text(json.dumps({**raw, "quantization_config": qc}))
    with pytest.raises((ValueError, ModelLoadError), match=r"model\.layers\.0\..*qweight: group"):
        load_model(str(out), None, "float32", torch.device("cpu"), None)
