"""GGUF linears kept quantized (``foudre.loading.gguf_quant``) and the group-wise int8 kernel
that runs Q8_0.

Oracles: the same file dequantized at load (``FOUDRE_GGUF_DEQUANTIZE=1``, the loader's previous
behaviour, itself checked against the block layouts of ggml-quants.c in ``test_gguf``), and
dequantize-then-matmul for the kernel. Tolerances:

- weights: Q8_0 and Q4_0 re-express the file exactly (the same float32 values bit for bit);
  Q4_1 and Q4_K hold ``z = c / s`` in float32, so ``(q - z) s`` may differ from ``q s - c`` by a
  few float32 roundings of ``|c|``: within ``1e-6 max|w|``.
- kernel: ``cpu_qmatmul.error_bound`` (float32 summation order, and on the VNNI path each
  activation within half its block's int8 step).
- logits: where the VNNI kernel rounds a linear's input to int8 per block of 32, the reference
  model's linear gets the same rounding (a pre-hook); what is left is float32 summation order
  and, rarely, an activation on a rounding tie flipped by it: ``1e-4`` relative. Without that
  hook the rounding's own error shows (``test_..._logits`` asserts it is larger), which is the
  format's: int8 activations as llama.cpp runs Q8_0 and Q4_* weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from torch import nn
from torch.utils.hooks import RemovableHandle

from foudre.layers.moe import Experts
from foudre.loading.gguf import read_gguf
from foudre.loading.gguf_quant import ENV
from foudre.loading.loader import load_model
from foudre.models.llama import LlamaForCausalLM
from foudre.quant import cpu_qmatmul
from foudre.quant.experts import QuantExperts
from foudre.quant.qlinear import (
    NATIVE_MAX_ROWS,
    QuantLinear,
    set_compute_dtype,
    uses_native_kernels,
)
from tests.conftest import make_hf_model
from tests.engine.march import run_built_for
from tests.quant.test_gguf import PROMPT, _logits, _rel, write_gguf
from tests.quant.test_gguf_moe import write_moe_gguf

CPU = torch.device("cpu")
KEPT = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q4_K": 4}
needs_kernels = pytest.mark.skipif(cpu_qmatmul.path() is None, reason="no C++ compiler")


# ----------------------------------------------------------------------------- kernel

# (group, n, k): K not a multiple of 32 or 64, N odd; groups of scale 0
CASES = [(32, 37, 100), (32, 17, 1000), (32, 64, 256), (64, 33, 520), (128, 16, 1024)]
ROWS = (1, 3, 16, 64)


def _grouped(group: int, n: int, k: int) -> QuantLinear:
    torch.manual_seed(n * 1000 + k + group)
    w = torch.randn(n, k) * 0.1 + torch.linspace(-0.05, 0.1, k)
    w[: n // 3, :group] = 0  # a group of scale 0 in a third of the rows
    mod = QuantLinear.from_float(w, None, 8, group)
    assert mod.qweight.shape == (n, -(-k // group) * group)
    assert bool((mod.scales[: n // 3, 0] == 0).all()) and bool((mod.scales[n // 3 :] > 0).all())
    return mod


def check_grouped_int8() -> None:
    """Every case, row count and dtype through this build's path."""
    for group, n, k in CASES:
        mod = _grouped(group, n, k)
        packed = cpu_qmatmul.layout(mod.qweight, mod.scales, None, group)
        wd = mod.dequantize()
        for m in ROWS:
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k) * torch.rand(m, 1) * 4).to(dtype)
                y = cpu_qmatmul.matmul(x, packed, group)
                assert y.dtype == dtype and y.shape == (m, n)
                ref = x.float() @ wd.t()
                tol = cpu_qmatmul.error_bound(x.float(), wd)
                if dtype == torch.bfloat16:
                    tol = tol + ref.abs() * 2**-8
                err = (y.float() - ref).abs()
                assert bool((err <= tol).all()), (group, n, k, m, dtype, (err - tol).max())


def check_path_avx512() -> None:
    assert cpu_qmatmul.path() == "avx512"
    check_grouped_int8()


def check_path_portable() -> None:
    assert cpu_qmatmul.path() == "portable"
    check_grouped_int8()


@needs_kernels
def test_grouped_int8_kernel_matches_dequantized_matmul() -> None:
    check_grouped_int8()


@needs_kernels
@pytest.mark.parametrize("march,check", [("skylake-avx512", "avx512"), ("x86-64", "portable")])
def test_grouped_int8_other_paths(march: str, check: str, tmp_path: Path) -> None:
    run_built_for(
        march, f"tests.quant.test_gguf_quantized:check_path_{check}", "cpu_qmatmul", tmp_path
    )


def _round_like_vnni(x: torch.Tensor) -> torch.Tensor:
    """x rounded to int8 per row and block of 32 columns as the VNNI kernel (and llama.cpp's
    ``quantize_row_q8_0``) does: ``d = max|x| / 127``, codes ``round(x * (127 / max|x|))`` (ties
    to even, as ``vcvtps2dq``), back as ``codes * d``."""
    k = x.shape[-1]
    xb = F.pad(x.float().reshape(-1, k), (0, -k % 32)).reshape(-1, (k + 31) // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    codes = torch.round(xb * inv)
    return (codes * (amax / 127.0)).reshape(xb.shape[0], -1)[:, :k].reshape(x.shape).to(x.dtype)


@needs_kernels
def test_vnni_grouped_int8_is_the_q8_0_dot() -> None:
    """On the VNNI path each block of 32 is llama.cpp's Q8_0 x Q8_0 dot: the integer dot of the
    weight's and the activation's codes times both scales (the activation's scale kept in
    float32, where ggml stores a float16). Checked to float32 summation order, far inside the
    rounding bound."""
    if cpu_qmatmul.path() != "vnni":
        pytest.skip("this build multiplies in float32")
    mod = _grouped(32, 45, 320)
    x = torch.randn(5, 320) * 3
    y = cpu_qmatmul.matmul(x, cpu_qmatmul.layout(mod.qweight, mod.scales, None, 32), 32)
    xr, wd = _round_like_vnni(x).double(), mod.dequantize().double()
    ref = xr @ wd.t()
    tight = 1e-5 * (xr.abs() @ wd.abs().t()) + 1e-6
    assert bool(((y.double() - ref).abs() <= tight).all())
    plain = x.double() @ wd.t()  # the rounding is really there, and the bound covers it
    assert float((y.double() - plain).abs().max()) > 10 * float(tight.max())
    assert bool(((y - plain.float()).abs() <= cpu_qmatmul.error_bound(x, mod.dequantize())).all())


@needs_kernels
@pytest.mark.parametrize("m", ROWS)
def test_grouped_int8_quant_linear(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``QuantLinear`` 8-bit with groups (and a bias) against ``forward_reference``; switched
    off, the reference itself (aten has no group-wise int8 kernel)."""
    torch.manual_seed(m)
    k, n = 200, 45
    mod = QuantLinear.from_float(torch.randn(n, k) * 0.1, torch.randn(n), 8, 32)
    assert mod.group_size == 32 and mod.zeros is None and mod.scales.shape == (n, 7)
    x = torch.randn(2, m, k)
    y, ref = mod(x), mod.forward_reference(x)
    assert y.shape == (2, m, n)
    tol = cpu_qmatmul.error_bound(x.reshape(-1, k), mod.dequantize()).reshape(2, m, n) + 1e-5
    assert bool(((y - ref).abs() <= tol).all())
    monkeypatch.setenv("FOUDRE_NATIVE_QMATMUL", "0")
    assert torch.equal(mod(x), ref)


# ----------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random HF Llama wide enough (256) for K-quant blocks, GQA 4:2."""
    return make_hf_model(
        tmp_path_factory.mktemp("llama"),
        "llama",
        vocab_size=384,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


def _load(path: Path, dtype: str = "float32", *, dequantize: bool = False) -> LlamaForCausalLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "1" if dequantize else "0")
        return load_model(str(path), None, dtype, CPU, None).model


def _quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _rounds_input(mod: QuantLinear, rows: int) -> bool:
    """Whether ``mod``'s CPU forward (float32 activations) runs the VNNI kernel for ``rows``."""
    if cpu_qmatmul.path() != "vnni" or not uses_native_kernels(torch.float32):
        return False
    return (mod.bits == 8 and mod.group_size is not None) or rows <= NATIVE_MAX_ROWS[mod.bits]


def _rounded_reference(ref: LlamaForCausalLM, kept: LlamaForCausalLM) -> list[RemovableHandle]:
    """Pre-hooks on ``ref``'s linears that round their input as the kept modules' kernels do."""
    handles = []
    for name, mod in _quant_linears(kept).items():

        def hook(_: nn.Module, args: tuple[torch.Tensor, ...], mod: QuantLinear = mod) -> object:
            x = args[0]
            return (_round_like_vnni(x),) if _rounds_input(mod, x[..., 0].numel()) else None

        handles.append(ref.get_submodule(name).register_forward_pre_hook(hook))
    return handles


def _rounded_error(got: torch.Tensor, rounded: torch.Tensor) -> float:
    """Relative error of logits ``got`` against the rounding oracle's, checking its form: most
    positions differ by float32 summation order only (under 1e-5); one may differ more where an
    activation fell within that order of a rounding tie and its int8 code moved by one (about
    1e-3 of the position's logits, 3e-3 seen), never by 1e-2."""
    rows = ((got - rounded).norm(dim=-1) / rounded.norm(dim=-1)).tolist()
    assert sorted(rows)[len(rows) // 2] < 1e-5 and max(rows) < 1e-2, rows
    return _rel(got, rounded)


def _check_logits(kept: LlamaForCausalLM, ref: LlamaForCausalLM) -> tuple[float, float]:
    """(error against the reference with the kernels' activation rounding, error without)."""
    set_compute_dtype(kept, None)  # float32 activations into the kernels, as the reference's
    got, plain = _logits(kept), _logits(ref)
    handles = _rounded_reference(ref, kept)
    try:
        rounded = _logits(ref)
    finally:
        for h in handles:
            h.remove()
    return _rounded_error(got, rounded), _rel(got, plain)


def _same(got: torch.Tensor, want: torch.Tensor, qtype: str) -> bool:
    """Bit for bit for Q8_0 / Q4_0; within float32 roundings of the zero points otherwise."""
    if qtype in ("Q8_0", "Q4_0"):
        return torch.equal(got, want)
    return float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())


def _check_weights(kept: LlamaForCausalLM, ref: LlamaForCausalLM, qtype: str) -> None:
    for name, mod in _quant_linears(kept).items():
        if ".experts." not in name:
            want = ref.get_submodule(name).weight.detach().float()
            assert _same(mod.dequantize(), want, qtype), name


@pytest.mark.parametrize("qtype", list(KEPT))
def test_kept_types_load_as_quant_linear(qtype: str, llama_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / f"llama-{qtype}.gguf"
    write_gguf(llama_dir, out, qtype)
    kept, ref = _load(out), _load(out, dequantize=True)
    assert not _quant_linears(ref)
    linears = _quant_linears(kept)
    per_layer = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    expected = {f"model.layers.{i}.{p}" for i in range(2) for p in per_layer} | {"lm_head"}
    assert set(linears) == expected
    for mod in linears.values():
        assert (mod.bits, mod.group_size) == (KEPT[qtype], 32)
        assert mod.scales.dtype == (torch.float16 if qtype == "Q4_0" else torch.float32)
    assert kept.model.embed_tokens.weight.dtype == torch.float32  # looked up: dequantized
    _check_weights(kept, ref, qtype)
    rounded, plain = _check_logits(kept, ref)
    if any(_rounds_input(m, len(PROMPT)) for m in linears.values()):
        assert plain > 10 * rounded  # the oracle sees the rounding it takes off
        assert plain < 0.03, plain  # the activations' int8 rounding through two layers
    else:
        assert plain == rounded


def test_qwen2_biases_with_kept_weights(tmp_path: Path) -> None:
    """Attention biases load into the kept module; no q/k row permutation outside llama."""
    src = make_hf_model(tmp_path / "qwen2", "qwen2", vocab_size=400)
    out = tmp_path / "qwen2.gguf"
    write_gguf(src, out, "Q8_0")
    kept, ref = _load(out), _load(out, dequantize=True)
    qkv = kept.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, QuantLinear) and qkv.bias is not None
    ref_qkv = ref.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert torch.equal(qkv.bias, ref_qkv.bias)
    _check_weights(kept, ref, "Q8_0")
    _check_logits(kept, ref)


@pytest.mark.parametrize("qtype", list(KEPT))
def test_zero_scale_blocks_are_exact(qtype: str, llama_dir: Path, tmp_path: Path) -> None:
    """Blocks whose scale is 0 hold one value (0, or Q4_1's m, Q4_K's -dmin m) and keep it."""
    out = tmp_path / f"zero-{qtype}.gguf"
    write_gguf(llama_dir, out, qtype)
    t = read_gguf(out).tensors["blk.0.ffn_up.weight"]  # [512, 256]: up_proj, rows 512..1023
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    row_bytes = t.shape[1] // block * size
    data = bytearray(out.read_bytes())
    for row in range(3):  # the first block of rows 0-2: d = 0
        data[t.offset + row * row_bytes : t.offset + row * row_bytes + 2] = b"\0\0"
    if qtype == "Q4_K":  # row 3: sub-block 1's 6-bit scale 0 (d stays)
        data[t.offset + 3 * row_bytes + 4 + 1] &= 0xC0
    out.write_bytes(bytes(data))
    kept, ref = _load(out), _load(out, dequantize=True)
    mod = kept.get_submodule("model.layers.0.mlp.gate_up_proj")
    assert isinstance(mod, QuantLinear)
    want = ref.get_submodule("model.layers.0.mlp.gate_up_proj").weight.detach()[512:516]
    got = mod.dequantize()[512:516]
    # (row, first column) of the blocks of 32 whose scale is 0
    spans = [(r, c) for r in range(3) for c in range(0, 256 if qtype == "Q4_K" else 32, 32)]
    spans += [(3, 32)] if qtype == "Q4_K" else []
    for r, c in spans:
        values = want[r, c : c + 32]
        assert bool((values == values[0]).all())  # one value per block of scale 0
        if qtype in ("Q4_1", "Q4_K"):
            assert float(values[0]) != 0  # Q4_1's m, Q4_K's -dmin m: not just zeros
        assert torch.equal(got[r, c : c + 32], values)  # kept exactly
    _check_weights(kept, ref, qtype)
    _check_logits(kept, ref)


def test_other_types_are_dequantized_with_one_log_line(
    llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A Q6_K v (Q4_K_M's kind of mix) keeps layer 0's q/k/v in float; a Q5_0 down_proj too."""
    out = tmp_path / "mixed.gguf"
    zeros = {"blk.0.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q5_0}
    write_gguf(llama_dir, out, "Q4_0", zeros=zeros)
    with caplog.at_level(logging.INFO, logger="foudre.loading.gguf_quant"):
        kept = _load(out)
    records = [r for r in caplog.records if r.name == "foudre.loading.gguf_quant"]
    assert len(records) == 1
    line = records[0].getMessage()
    assert "\n" not in line and "7 linears and 0 expert sets kept quantized" in line
    assert "Q6_K (no kept-quantized kernel): blk.0.attn_v.weight" in line
    assert "fused with Q6_K: blk.0.attn_q.weight, blk.0.attn_k.weight" in line
    assert "Q5_0 (no kept-quantized kernel): blk.1.ffn_down.weight" in line
    assert "the embedding table: token_embd.weight" in line
    assert type(kept.get_submodule("model.layers.0.self_attn.qkv_proj")) is not QuantLinear
    assert type(kept.get_submodule("model.layers.1.mlp.down_proj")) is not QuantLinear
    assert isinstance(kept.get_submodule("model.layers.1.self_attn.qkv_proj"), QuantLinear)
    ref = _load(out, dequantize=True)
    _check_weights(kept, ref, "Q4_0")
    _check_logits(kept, ref)


def _resident_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the weights: parameters and QuantLinear buffers, each storage once; bytes of
    the kernel layouts the QuantLinears hold on top of them)."""
    seen: set[int] = set()
    weights = 0
    tensors = list(model.parameters())
    for mod in _quant_linears(model).values():
        tensors += list(mod.buffers(recurse=False))
    for t in tensors:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            weights += t.numel() * t.element_size()
    extra = 0
    for mod in _quant_linears(model).values():
        for layout in mod._packed.values():
            for t in layout:
                if t.data_ptr() not in seen:
                    seen.add(t.data_ptr())
                    extra += t.numel() * t.element_size()
    return weights, extra


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_resident_size_is_the_files(qtype: str, llama_dir: Path, tmp_path: Path) -> None:
    """A Q4_0 / Q8_0 file with an F16 embedding (``llama-quantize --token-embedding-type f16``)
    takes at most 1.15x its tensors' bytes once loaded (bfloat16 model; no KV cache here); the
    Q8_0 kernel's layout is the module's own buffers, so running it adds nothing."""
    out = tmp_path / f"size-{qtype}.gguf"
    write_gguf(llama_dir, out, qtype, types={"token_embd.weight": "F16"})
    file_bytes = sum(t.nbytes for t in read_gguf(out).tensors.values())
    model = _load(out, "auto")
    weights, extra = _resident_bytes(model)
    assert weights <= 1.15 * file_bytes, (weights, file_bytes)
    dense = _resident_bytes(_load(out, "auto", dequantize=True))[0]
    assert dense > 1.5 * file_bytes  # what dequantizing at load took
    _logits(model, PROMPT[:4])  # every kernel builds its layout
    weights_after, extra = _resident_bytes(model)
    assert weights_after == weights
    if qtype == "Q8_0" and cpu_qmatmul.path() in ("vnni", "avx512"):
        assert extra == 0


def _reference_forward(self: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """The kernels' arithmetic by dequantize-then-matmul: the input rounded as the VNNI kernel
    rounds it, where it does."""
    rows = x[..., 0].numel()
    return self.forward_reference(_round_like_vnni(x) if _rounds_input(self, rows) else x)


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_moe_experts_kept_quantized(
    qtype: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stacked experts become ``QuantExperts`` of the file's codes (the shared expert and the
    attention ``QuantLinear``s, the routers float); the model's logits are those of the same
    modules computed by dequantize-then-matmul with the kernels' input rounding."""
    src = make_hf_model(
        tmp_path / "src",
        "qwen2_moe",
        vocab_size=400,
        hidden_size=256,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
        shared_expert_intermediate_size=256,
    )
    out = tmp_path / f"moe-{qtype}.gguf"
    write_moe_gguf(src, out, qtype)
    kept, ref = _load(out), _load(out, dequantize=True)
    blocks = kept.moe_blocks()
    assert len(blocks) == 2
    for i, block in blocks.items():
        experts, want = block.experts, ref.moe_blocks()[i].experts
        assert isinstance(experts, QuantExperts) and isinstance(want, Experts)
        assert type(block.gate) is not QuantLinear  # the router stays float
        for e in range(4):
            pairs = (
                (experts.gate_up[e], want.gate_up_proj[e]),
                (experts.down[e], want.down_proj[e]),
            )
            for got, w in pairs:
                assert isinstance(got, QuantLinear)
                assert (got.bits, got.group_size) == (KEPT[qtype], 32)
                assert _same(got.dequantize(), w.detach().float(), qtype), (i, e)
    assert isinstance(
        kept.get_submodule("model.layers.0.mlp.shared_expert.gate_up_proj"), QuantLinear
    )
    _check_weights(kept, ref, qtype)
    set_compute_dtype(kept, None)
    ids = PROMPT[:12]
    got = _logits(kept, ids)
    with monkeypatch.context() as mp:
        mp.setattr(QuantLinear, "forward", _reference_forward)
        rounded = _logits(kept, ids)
    _rounded_error(got, rounded)
    assert _rel(got, _logits(ref, ids)) < 0.05  # and near the float model
