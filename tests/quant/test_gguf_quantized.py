"""GGUF linears kept quantized (``foudre.loading.gguf_quant``): Q4_0, Q4_1 and Q4_K as 4-bit
groups of 32, Q6_K as 6 bits where our CPU kernels serve it, Q5_0, Q5_1, Q5_K and Q8_0 (and
modules mixing types, and Q6_K elsewhere) as group-wise 8-bit, and the group-wise int8 kernel's
Q8_0 dot (the kernels themselves: ``test_cpu_qmatmul``).

Oracles: the gguf package's dequantizers (``gguf.quants.dequantize``, the blocks of files written
with its writer: random bytes, or ``test_gguf.quantize``'s models), which is also what the same
file dequantized at load gives (``FOUDRE_GGUF_DEQUANTIZE=1``, the loader's previous behaviour),
and dequantize-then-matmul for the kernels. Tolerances:

- weights: types without mins (Q4_0, Q5_0, Q6_K, Q8_0) re-express the file exactly (the same
  float32 values bit for bit); Q4_1, Q4_K, Q5_1 and Q5_K hold ``z = c / s`` in float32, so
  ``(q - z) s`` may differ from ``q s - c`` by a few float32 roundings of ``|c|``: within
  ``1e-6 max|w|`` (measured: under ``1e-7``).
- kernel: ``cpu_qmatmul.error_bound`` (float32 summation order, and on the VNNI path each
  activation within half its block's int8 step).
- modules: on the activations the model gives it, each kept module returns what
  dequantize-then-matmul returns on them rounded as its kernel rounds them (the VNNI kernels:
  to int8 per block, ``cpu_qmatmul.round_like_kernel``), to float32 summation order of the terms
  the kernel sums (``_term_sizes``); and plain dequantize-then-matmul does not, where it rounds.
- logits: the model's are those of the file dequantized at load within that int8 rounding of
  the activations (the format's error: llama.cpp runs Q8_0, Q4_* and Q5_* weights on int8
  activations too), under 3% through two layers; greedy tokens are those of the dequantized
  file with the same rounding (without it, this random model's top two logits are often nearer
  than the rounding's error). Not logits against the rounded reference model: a rounding tie
  that float32 summation order flips in one layer moves a row by 1e-3 and spreads to the later
  positions through attention.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from foudre.layers.moe import Experts
from foudre.loading.gguf import read_gguf
from foudre.loading.gguf_quant import ENV, KEPT_TYPES, Layout, decode_codes
from foudre.loading.loader import load_model
from foudre.models.llama import LlamaForCausalLM
from foudre.quant import cpu_qmatmul
from foudre.quant.experts import QuantExperts
from foudre.quant.packing import INT6_BLOCK, unpack_int4, unpack_int6
from foudre.quant.qlinear import (
    QuantLinear,
    dequantized_gemm_rows,
    set_compute_dtype,
    uses_native_kernels,
)
from tests.conftest import make_hf_model
from tests.quant.test_gguf import PROMPT, _logits, _rel, write_gguf
from tests.quant.test_gguf_moe import moe_source, write_moe_gguf

CPU = torch.device("cpu")
# Q6_K alone in a module is 6 bits where our kernels serve float32 activations (these tests'
SIX = uses_native_kernels(torch.float32)  # models), else group-wise 8 bits
# type -> (bits, group, zero points) of the module a file of only that type gives
KEPT = {
    "Q8_0": (8, 32, False),
    "Q4_0": (4, 32, True),
    "Q4_1": (4, 32, True),
    "Q4_K": (4, 32, True),
    "Q5_0": (8, 32, False),
    "Q5_1": (8, 32, True),
    "Q5_K": (8, 32, True),
    "Q6_K": (6 if SIX else 8, 16, False),
}
CODES = {4: torch.uint8, 6: torch.uint8, 8: torch.int8}  # qweight's dtype by bits
EXACT = ("Q8_0", "Q4_0", "Q5_0", "Q6_K")  # no mins: bit for bit
VNNI = cpu_qmatmul.path() == "vnni"  # (where Q8_0, Q5_0, Q4_x are repacked: interleaves)
needs_kernels = pytest.mark.skipif(cpu_qmatmul.path() is None, reason="no C++ compiler")


# ----------------------------------------------------------------------------- kernel

ROWS = (1, 3, 16, 64)


def _grouped(group: int, n: int, k: int) -> QuantLinear:
    torch.manual_seed(n * 1000 + k + group)
    w = torch.randn(n, k) * 0.1 + torch.linspace(-0.05, 0.1, k)
    w[: n // 3, :group] = 0  # a group of scale 0 in a third of the rows
    mod = QuantLinear.from_float(w, None, 8, group)
    assert mod.qweight.shape == (n, -(-k // group) * group)
    assert bool((mod.scales[: n // 3, 0] == 0).all()) and bool((mod.scales[n // 3 :] > 0).all())
    return mod


@needs_kernels
@pytest.mark.parametrize("m", [5, 17])
def test_vnni_grouped_int8_is_the_q8_0_dot(m: int) -> None:
    """On the VNNI path each block of 32 is llama.cpp's Q8_0 x Q8_0 dot: the integer dot of the
    weight's and the activation's codes times both scales (the activation's scale kept in
    float32, where ggml stores a float16). Checked to float32 summation order, far inside the
    rounding bound; at 17 rows on AMX's tiles where the CPU has them (a tile product a block)."""
    if not cpu_qmatmul.rounds_activations():
        pytest.skip("this build multiplies in float32")
    mod = _grouped(32, 45, 320)
    x = torch.randn(m, 320) * 3
    y = cpu_qmatmul.matmul(x, cpu_qmatmul.layout(mod.qweight, mod.scales, None, 32))
    xr = cpu_qmatmul.round_like_kernel(x, 8, 32).double()  # llama.cpp's quantize_row_q8_0
    wd = mod.dequantize().double()
    ref = xr @ wd.t()
    tight = 1e-5 * (xr.abs() @ wd.abs().t()) + 1e-6
    assert bool(((y.double() - ref).abs() <= tight).all())
    plain = x.double() @ wd.t()  # the rounding is really there, and the bound covers it
    assert float((y.double() - plain).abs().max()) > 10 * float(tight.max())
    bound = cpu_qmatmul.error_bound(x, mod.dequantize(), 8, 32)
    assert bool(((y - plain.float()).abs() <= bound).all())


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
    tol = cpu_qmatmul.error_bound(x.reshape(-1, k), mod.dequantize(), 8, 32).reshape(2, m, n) + 1e-5
    assert bool(((y - ref).abs() <= tol).all())
    monkeypatch.setenv("FOUDRE_NATIVE_QMATMUL", "0")
    assert torch.equal(mod(x), ref)


# ----------------------------------------------------------------------------- models


def _load(path: Path, dtype: str = "float32", *, dequantize: bool = False) -> LlamaForCausalLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, "1" if dequantize else "0")
        return load_model(str(path), None, dtype, CPU, None).model


def _quant_linears(model: nn.Module) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _rounds_input(mod: QuantLinear, rows: int) -> bool:
    """Whether ``mod``'s CPU forward (float32 activations) runs the VNNI kernel for ``rows``."""
    if not cpu_qmatmul.rounds_activations() or not uses_native_kernels(torch.float32):
        return False
    if rows >= dequantized_gemm_rows(mod.bits, mod.group_size):
        return False  # the dequantized weight into torch's GEMM: nothing rounded
    return rows <= mod.native_rows()


def _kernel_input(mod: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``mod``'s CPU kernel sees it: rounded to int8 per block where it runs the VNNI
    kernel (``cpu_qmatmul.round_like_kernel``)."""
    if not _rounds_input(mod, x[..., 0].numel()):
        return x
    return cpu_qmatmul.round_like_kernel(x, mod.bits, mod.group_size)


def _term_sizes(mod: QuantLinear) -> torch.Tensor:
    """``(|q| + |z| + 256) |s|`` per weight ``[N, K]``: the size of the terms a kernel sums (the
    VNNI one offsets int8 codes by 128 and takes ``(z + 128) s`` off per group; 6 bits: z = 32,
    s = d sc), which its float32 rounding scales with; at least ``|w|``."""
    assert mod.group_size is not None
    z: torch.Tensor | int = 0
    rows = mod.state_dict()  # (the buffers as rows where they are interleaved)
    if mod.bits == 6:
        q, subs = unpack_int6(rows["qweight"])
        d = rows["scales"].float().repeat_interleave(INT6_BLOCK // 16, 1)
        s, z = (d * subs.float()).repeat_interleave(16, 1), 32
        return ((q.float() + z + 256) * s.abs())[:, : mod.in_features]
    q = rows["qweight"] if mod.bits == 8 else unpack_int4(rows["qweight"])
    s = rows["scales"].float().repeat_interleave(mod.group_size, 1)
    if mod.zeros is not None:
        z = rows["zeros"].float().abs().repeat_interleave(mod.group_size, 1)
    return ((q.float().abs() + z + 256) * s.abs())[:, : mod.in_features]


@contextmanager
def _kernels_checked(model: nn.Module) -> Iterator[dict[str, float]]:
    """Assert that every ``QuantLinear`` of ``model`` returns, on the activations the model
    gives it, what dequantize-then-matmul returns on them rounded as its kernel rounds them, to
    float32 summation order (``1e-5 sum |x| t``, ``t`` the ``_term_sizes``). Yields, by module,
    the largest error of plain dequantize-then-matmul (no rounding) in units of that bound: over
    1 where the kernel rounds, so the rounding is really there and the oracle models it."""
    plain: dict[str, float] = {}

    def check(name: str, mod: QuantLinear, x: torch.Tensor, y: torch.Tensor) -> None:
        xk = _kernel_input(mod, x)
        bound = 1e-5 * (xk.abs().float() @ _term_sizes(mod).t()) + 1e-6
        err = (y.float() - mod.forward_reference(xk).float()).abs()
        assert bool((err <= bound).all()), (name, float((err / bound).max()))
        if not torch.equal(xk, x):  # (an all-zero input, from all-zero v rows, is not rounded)
            ratio = float(((y.float() - mod.forward_reference(x).float()).abs() / bound).max())
            plain[name] = max(plain.get(name, 0.0), ratio)

    handles = [
        mod.register_forward_hook(
            lambda m, args, y, name=name: check(name, cast(QuantLinear, m), args[0], y)
        )
        for name, mod in _quant_linears(model).items()
    ]
    try:
        yield plain
    finally:
        for h in handles:
            h.remove()


GREEDY_FROM, GREEDY_STEPS = 8, 6  # _greedy's steps compute 8 to 13 rows


def _greedy(model: LlamaForCausalLM) -> list[int]:
    """Greedy tokens after ``PROMPT[:GREEDY_FROM]``, each step recomputed from position 0."""
    ids = PROMPT[:GREEDY_FROM]
    for _ in range(GREEDY_STEPS):
        ids = [*ids, int(_logits(model, ids)[-1].argmax())]
    return ids[GREEDY_FROM:]


@contextmanager
def _rounding_like(ref: LlamaForCausalLM, kept: LlamaForCausalLM) -> Iterator[None]:
    """Pre-hooks on ``ref``'s linears that round their input as ``kept``'s kernels do."""

    def hook(mod: QuantLinear, args: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor]:
        return (_kernel_input(mod, args[0]),)

    handles = [
        ref.get_submodule(name).register_forward_pre_hook(lambda _, args, mod=mod: hook(mod, args))
        for name, mod in _quant_linears(kept).items()
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _check_logits(kept: LlamaForCausalLM, ref: LlamaForCausalLM, ids: list[int] = PROMPT) -> float:
    """Every kept module computes its dequantized weights' product (``_kernels_checked``); the
    logits are the dequantized file's within its activations' int8 rounding (none where no kernel
    rounds), and the greedy tokens are the dequantized file's with that rounding (without it,
    this random model's top two logits are often nearer than the rounding's error). Returns the
    logits' relative error."""
    set_compute_dtype(kept, None)  # float32 activations into the kernels, as the reference's
    with _kernels_checked(kept) as plain:
        got = _logits(kept, ids)
        tokens = _greedy(kept)
    modules = _quant_linears(kept)
    rows = (len(ids), *range(GREEDY_FROM, GREEDY_FROM + GREEDY_STEPS))  # logits', greedy's
    rounding = {n for n, m in modules.items() if any(_rounds_input(m, r) for r in rows)}
    # the oracle sees the rounding: without it, the kernels' results are out of bounds
    assert set(plain) <= rounding and bool(plain) == bool(rounding), (plain, rounding)
    assert all(v > 1 for v in plain.values()), plain
    error = _rel(got, _logits(ref, ids))
    rounded = any(_rounds_input(m, len(ids)) for m in modules.values())
    assert error < (0.03 if rounded else 1e-5), error  # int8 activations through two layers
    with _rounding_like(ref, kept):
        assert tokens == _greedy(ref)
    return error


def _exact(mod: QuantLinear) -> bool:
    """Whether ``mod`` holds its file's values bit for bit: no zero points, or integer ones
    (Q4_0's 8), so that ``(q - z) s`` rounds once, as ``d (q - 8)``."""
    zeros = mod.state_dict().get("zeros")  # (rows: interleaved buffers are empty)
    return zeros is None or torch.equal(zeros, zeros.round())


def _same(got: torch.Tensor, want: torch.Tensor, exact: bool) -> bool:
    """Bit for bit, or within float32 roundings of the zero points."""
    if exact:
        return torch.equal(got, want)
    return float((got - want).abs().max()) <= 1e-6 * float(want.abs().max())


def _check_weights(kept: LlamaForCausalLM, ref: LlamaForCausalLM) -> None:
    for name, mod in _quant_linears(kept).items():
        if ".experts." not in name:
            want = ref.get_submodule(name).weight.detach().float()
            assert _same(mod.dequantize(), want, _exact(mod)), name


PER_LAYER = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")


@pytest.mark.parametrize("qtype", list(KEPT))
def test_kept_types_load_as_quant_linear(qtype: str, llama_dir: Path, tmp_path: Path) -> None:
    """Every linear of a file of ``qtype`` is a ``QuantLinear`` of its codes (the embedding
    table float), holding the file's values (bit for bit for the types without mins); logits
    and greedy tokens are those of the file dequantized at load."""
    out = tmp_path / f"llama-{qtype}.gguf"
    write_gguf(llama_dir, out, qtype)
    kept, ref = _load(out), _load(out, dequantize=True)
    assert not _quant_linears(ref)
    linears = _quant_linears(kept)
    expected = {f"model.layers.{i}.{p}" for i in range(2) for p in PER_LAYER} | {"lm_head"}
    assert set(linears) == expected
    bits, group, zero_point = KEPT[qtype]
    for mod in linears.values():
        assert (mod.bits, mod.group_size, mod.zeros is not None) == (bits, group, zero_point)
        # codes, not floats (Q8_0, Q5_0 and the Q4 types on the VNNI path: in blocks of 16
        # rows, uint8)
        blocks = bits == 4 or (bits, group, zero_point) == (8, 32, False)
        assert mod.interleaved == (blocks and VNNI)
        assert mod.qweight.dtype == (torch.uint8 if mod.interleaved else CODES[bits])
        half = qtype in ("Q4_0", "Q5_0", "Q8_0") or bits == 6  # the file's float16 d, exactly
        assert mod.scales.dtype == (torch.float16 if half else torch.float32)
        assert _exact(mod) == (qtype in EXACT)
    assert kept.model.embed_tokens.weight.dtype == torch.float32  # looked up: dequantized
    _check_weights(kept, ref)
    _check_logits(kept, ref)


def _raw_gguf(path: Path, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    w = gguf.GGUFWriter(str(path), "llama")
    for name, (raw, qtype) in tensors.items():
        w.add_tensor(name, raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _random_blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random bytes of ``qtype`` (every code, 6-bit scale and min), its float16 scales and mins
    replaced by finite ones (some 0), the first row's first block all zero."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    halves = (rng.standard_normal((rows, cols // block, 2)) * 0.02).astype(np.float16)
    halves[rng.random(halves.shape) < 0.05] = 0
    at = {Q.Q6_K: [208], Q.Q8_0: [0], Q.Q4_0: [0], Q.Q5_0: [0]}.get(qtype, [0, 2])
    for i, offset in enumerate(at):
        raw[..., offset : offset + 2] = np.ascontiguousarray(halves[..., i : i + 1]).view(np.uint8)
    raw[0, 0] = 0
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", list(KEPT))
def test_decoded_codes_are_the_gguf_dequantizers_values(qtype: str, tmp_path: Path) -> None:
    """Random blocks of ``qtype`` decoded into every layout a module with them can take (its
    own; 8-bit groups of 16 with and without zero points, as beside a Q6_K part): the module's
    ``dequantize()`` is ``gguf.quants.dequantize``'s values, bit for bit without mins."""
    qt = Q[qtype]
    rows, cols = 6, 512
    raw = _random_blocks(qt, rows, cols, np.random.default_rng(int(qt)))
    _raw_gguf(tmp_path / "t.gguf", {"t": (raw, qt)})
    f = read_gguf(tmp_path / "t.gguf")
    want = torch.from_numpy(gguf.quants.dequantize(raw, qt))
    own = KEPT_TYPES[qt]
    mins = own.zero_point
    layouts = [Layout(4, 32, True)] if own.bits == 4 else [own]
    layouts += [Layout(8, 16, True)] + ([] if mins else [Layout(8, 16, False)])
    layouts += [Layout(6, 16, False)] if qt == Q.Q6_K else []
    for layout in layouts:
        c = decode_codes(f, f.tensors["t"], layout)
        zeros = c.zeros if layout.zero_point else None
        if layout.bits == 6:
            assert c.subs is not None and c.scales.shape == (rows, cols // INT6_BLOCK)
        mod = QuantLinear.from_codes(
            c.codes, c.scales, zeros, None, layout.bits, layout.group, cols, sub_scales=c.subs
        )
        assert mod.qweight.dtype == CODES[layout.bits]
        got = mod.dequantize()
        assert _same(got, want, not mins), (layout, float((got - want).abs().max()))
        if mins:  # the tolerance is not slack: measured within 1e-7
            assert float((got - want).abs().max()) <= 1e-7 * float(want.abs().max())


def test_mixed_modules_are_8_bit(llama_dir: Path, tmp_path: Path) -> None:
    """Q4_K_M's mix (v, down and the head in Q6_K, the rest Q4_K) and others: a module whose
    parts are not all 4-bit types (nor all Q6_K: 6 bits) is 8-bit with the smallest group of its
    parts and zero points where a part has mins; each part keeps its values."""
    out = tmp_path / "mixed.gguf"
    types = {
        "blk.0.attn_v.weight": "Q6_K",
        "blk.0.ffn_down.weight": "Q6_K",
        "output.weight": "Q6_K",
        "blk.1.attn_k.weight": "Q5_0",
        "blk.1.ffn_gate.weight": "Q8_0",
        "blk.1.ffn_up.weight": "Q4_0",
    }
    write_gguf(llama_dir, out, "Q4_K", types=types)
    kept, ref = _load(out), _load(out, dequantize=True)
    linears = _quant_linears(kept)
    layouts = {
        "model.layers.0.self_attn.qkv_proj": (8, 16, True),
        "model.layers.0.self_attn.o_proj": (4, 32, True),
        "model.layers.0.mlp.gate_up_proj": (4, 32, True),
        "model.layers.0.mlp.down_proj": KEPT["Q6_K"],
        "model.layers.1.self_attn.qkv_proj": (8, 32, True),
        "model.layers.1.mlp.gate_up_proj": (8, 32, False),
        "lm_head": KEPT["Q6_K"],
    }
    for name, layout in layouts.items():
        mod = linears[name]
        assert (mod.bits, mod.group_size, mod.zeros is not None) == layout, name
        # the file's float16 d where every part is Q4_0, Q5_0 or Q8_0, or in 6 bits; d sc or
        # c / s else
        half = name == "model.layers.1.mlp.gate_up_proj" or mod.bits == 6
        assert mod.scales.dtype == (torch.float16 if half else torch.float32), name
    assert _exact(linears["model.layers.1.mlp.gate_up_proj"])  # Q8_0 beside Q4_0: q - 8, no z
    _check_weights(kept, ref)
    _check_logits(kept, ref)


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
    _check_weights(kept, ref)
    _check_logits(kept, ref)


@pytest.mark.parametrize("qtype", list(KEPT))
def test_zero_scale_blocks_are_exact(qtype: str, llama_dir: Path, tmp_path: Path) -> None:
    """Blocks whose scale is 0 hold one value (0, or Q4_1 / Q5_1's m, Q4_K / Q5_K's -dmin m)
    and keep it, exactly."""
    out = tmp_path / f"zero-{qtype}.gguf"
    write_gguf(llama_dir, out, qtype)
    t = read_gguf(out).tensors["blk.0.ffn_up.weight"]  # [512, 256]: up_proj, rows 512..1023
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    row_bytes = t.shape[1] // block * size
    d_at = 208 if qtype == "Q6_K" else 0
    data = bytearray(out.read_bytes())
    for row in range(3):  # the first block of rows 0-2: d = 0
        at = t.offset + row * row_bytes + d_at
        data[at : at + 2] = b"\0\0"
    sub = {"Q4_K": 32, "Q5_K": 32, "Q6_K": 16}.get(qtype)
    if qtype in ("Q4_K", "Q5_K"):  # row 3: sub-block 1's 6-bit scale 0 (d stays)
        data[t.offset + 3 * row_bytes + 4 + 1] &= 0xC0
    if qtype == "Q6_K":  # row 3: sub-block 1's int8 scale 0
        data[t.offset + 3 * row_bytes + 192 + 1] = 0
    out.write_bytes(bytes(data))
    kept, ref = _load(out), _load(out, dequantize=True)
    mod = kept.get_submodule("model.layers.0.mlp.gate_up_proj")
    assert isinstance(mod, QuantLinear)
    want = ref.get_submodule("model.layers.0.mlp.gate_up_proj").weight.detach()[512:516]
    got = mod.dequantize()[512:516]
    # (row, first column, width) of the groups whose scale is 0
    width = sub or 32
    spans = [(r, c) for r in range(3) for c in range(0, block, width)]
    spans += [(3, width)] if sub else []
    for r, c in spans:
        values = want[r, c : c + width]
        assert bool((values == values[0]).all())  # one value per block of scale 0
        if qtype in ("Q4_1", "Q4_K", "Q5_1", "Q5_K"):
            assert float(values[0]) != 0  # m, -dmin m: not just zeros
        assert torch.equal(got[r, c : c + width], values)  # kept exactly
    _check_weights(kept, ref)
    _check_logits(kept, ref)


def test_other_types_are_dequantized_with_one_log_line(
    llama_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Types with no kept layout (an IQ4_NL v, a Q3_K down_proj) load dequantized, with the
    parts fused with them, and one log line says so."""
    out = tmp_path / "mixed.gguf"
    zeros = {"blk.0.attn_v.weight": Q.IQ4_NL, "blk.1.ffn_down.weight": Q.Q3_K}
    write_gguf(llama_dir, out, "Q4_0", zeros=zeros)
    with caplog.at_level(logging.INFO, logger="foudre.loading.gguf_quant"):
        kept = _load(out)
    records = [r for r in caplog.records if r.name == "foudre.loading.gguf_quant"]
    assert len(records) == 1
    line = records[0].getMessage()
    assert "\n" not in line and "7 linears and 0 expert sets kept quantized" in line
    assert "IQ4_NL (no kept-quantized kernel): blk.0.attn_v.weight" in line
    assert "fused with IQ4_NL: blk.0.attn_q.weight, blk.0.attn_k.weight" in line
    assert "Q3_K (no kept-quantized kernel): blk.1.ffn_down.weight" in line
    assert "the embedding table: token_embd.weight" in line
    assert type(kept.get_submodule("model.layers.0.self_attn.qkv_proj")) is not QuantLinear
    assert type(kept.get_submodule("model.layers.1.mlp.down_proj")) is not QuantLinear
    assert isinstance(kept.get_submodule("model.layers.1.self_attn.qkv_proj"), QuantLinear)
    ref = _load(out, dequantize=True)
    _check_weights(kept, ref)
    _check_logits(kept, ref)


def test_group_wise_8_bit_is_dequantized_where_no_kernel_runs_it(
    llama_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without our kernels (neither AVX-512 nor AVX2, or switched off) group-wise 8-bit layouts
    would be dequantized at every call: they are dequantized once at load instead, and the log
    says why; 4-bit layouts stay quantized on torch's kernels."""
    from foudre.loading import loader

    monkeypatch.setattr(loader, "uses_native_kernels", lambda dtype: False)
    out = tmp_path / "q8.gguf"
    write_gguf(llama_dir, out, "Q8_0")
    with caplog.at_level(logging.INFO, logger="foudre.loading.gguf_quant"):
        model = _load(out)
    assert not _quant_linears(model)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "foudre.loading.gguf_quant"]
    assert "group-wise 8-bit (no kernel on this CPU: dequantized once, at load)" in line
    q4 = tmp_path / "q4.gguf"
    write_gguf(llama_dir, q4, "Q4_0")
    assert all(m.bits == 4 for m in _quant_linears(_load(q4)).values())


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
        native = mod._native
        held = [] if native is None else [native.w, native.s, native.z]
        for t in [*held, *(t for layout in mod._packed.values() for t in layout)]:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                extra += t.numel() * t.element_size()
    return weights, extra


@needs_kernels
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q6_K"])
def test_resident_size_is_the_files(qtype: str, llama_dir: Path, tmp_path: Path) -> None:
    """A Q4_0 / Q8_0 / Q6_K file with an F16 embedding (``llama-quantize
    --token-embedding-type f16``) takes at most 1.15x its tensors' bytes once loaded (bfloat16
    model; no KV cache here; Q6_K where it loads in 6 bits: in 8 bits it takes 1.5x); the Q8_0
    and 6-bit kernels' layouts are the modules' own buffers, so running them adds nothing."""
    if qtype == "Q6_K" and not uses_native_kernels(torch.bfloat16):
        pytest.skip("Q6_K loads in group-wise 8 bits without our kernels")
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
    if qtype in ("Q8_0", "Q6_K") and cpu_qmatmul.path() in cpu_qmatmul.NATIVE_PATHS:
        assert extra == 0


# Q4_K_M's kind of mix: layer 1's experts with down_proj in Q6_K (their gate/up stay 4-bit)
MOE_MIXES = {"Q4_K_M": ("Q4_K", {"blk.1.ffn_down_exps.weight": "Q6_K"})}


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q4_K_M"])
def test_moe_experts_kept_quantized(qtype: str, tmp_path: Path) -> None:
    """Stacked experts become ``QuantExperts`` of the file's codes, gate/up and down each in the
    layout of their type (the shared expert and the attention ``QuantLinear``s, the routers
    float); the model's logits are those of the same modules computed by dequantize-then-matmul
    with the kernels' input rounding, each on the activations the model gives it."""
    src = moe_source(tmp_path / "src")
    out = tmp_path / f"moe-{qtype}.gguf"
    base, types = MOE_MIXES.get(qtype, (qtype, {}))
    write_moe_gguf(src, out, base, types=types)
    kept, ref = _load(out), _load(out, dequantize=True)
    blocks = kept.moe_blocks()
    assert len(blocks) == 2
    for i, block in blocks.items():
        experts, want = block.experts, ref.moe_blocks()[i].experts
        assert isinstance(experts, QuantExperts) and isinstance(want, Experts)
        assert type(block.gate) is not QuantLinear  # the router stays float
        for e in range(4):
            pairs = (
                (experts.gate_up[e], want.gate_up_proj[e], "gate"),
                (experts.down[e], want.down_proj[e], "down"),
            )
            for got, w, part in pairs:
                assert isinstance(got, QuantLinear)
                stored = types.get(f"blk.{i}.ffn_{part}_exps.weight", base)
                assert (got.bits, got.group_size, got.zeros is not None) == KEPT[stored]
                assert _exact(got) == (stored in EXACT)
                assert _same(got.dequantize(), w.detach().float(), _exact(got)), (i, e)
    assert isinstance(
        kept.get_submodule("model.layers.0.mlp.shared_expert.gate_up_proj"), QuantLinear
    )
    _check_weights(kept, ref)
    set_compute_dtype(kept, None)
    ids = PROMPT[:12]
    with _kernels_checked(kept):
        got = _logits(kept, ids)
    assert _rel(got, _logits(ref, ids)) < 0.05  # and near the float model


def test_engine_generates_with_kept_modules(llama_dir: Path, tmp_path: Path) -> None:
    """The engine (paged KV cache, one-row decode steps) runs a Q4_K_M-like file's kept modules
    (4-bit, 8-bit with groups of 16 and zero points, and 6-bit where our kernels run: the head
    and a down_proj): its greedy tokens are those of the same loaded model recomputed from
    position 0 at every step."""
    from foudre import LLM, SamplingParams

    out = tmp_path / "q4_k_m.gguf"
    q6 = ("blk.0.attn_v.weight", "blk.1.attn_v.weight", "blk.0.ffn_down.weight", "output.weight")
    types = {name: "Q6_K" for name in q6} | {"blk.1.ffn_down.weight": "Q5_K"}
    write_gguf(llama_dir, out, "Q4_K", types=types)
    llm = LLM(
        model=str(out), dtype="float32", max_model_len=64, num_kv_blocks=16,
        skip_tokenizer_init=True,
    )  # fmt: skip
    qkv = llm.engine.model.get_submodule("model.layers.0.self_attn.qkv_proj")
    assert isinstance(qkv, QuantLinear) and (qkv.bits, qkv.group_size) == (8, 16)
    head = llm.engine.model.get_submodule("lm_head")
    assert isinstance(head, QuantLinear) and head.bits == KEPT["Q6_K"][0]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    got = llm.generate([PROMPT[:8]], params)[0].outputs[0].token_ids
    assert list(got) == _greedy(_load(out))


def test_six_bit_modules_save_and_load_back(llama_dir: Path, tmp_path: Path) -> None:
    """A Q6_K file's 6-bit modules written as a foudre checkpoint (``save_quantized``) load
    back as the same modules, buffer for buffer, with the same logits."""
    if not SIX:
        pytest.skip("Q6_K loads in group-wise 8 bits without our kernels")
    from foudre.loading.quantized import save_quantized

    out = tmp_path / "q6.gguf"
    write_gguf(llama_dir, out, "Q6_K")
    kept = _load(out)
    saved = save_quantized(kept, tmp_path / "saved", "gguf")
    back = _load(saved)
    linears = _quant_linears(kept)
    assert linears and all(mod.bits == 6 for mod in linears.values())
    for name, mod in linears.items():
        other = back.get_submodule(name)
        assert isinstance(other, QuantLinear) and (other.bits, other.group_size) == (6, 16), name
        assert torch.equal(other.qweight, mod.qweight) and torch.equal(other.scales, mod.scales)
        assert other.scales.dtype == torch.float16
    assert torch.equal(_logits(back, PROMPT), _logits(kept, PROMPT))


def test_q6_k_alone_is_8_bit_where_6_bits_have_no_kernel(llama_dir: Path, tmp_path: Path) -> None:
    """Planned for CUDA or a CPU without our kernels (``six_bit`` off), a module all of Q6_K is
    8-bit in groups of 16 (the Triton kernels' form), its values the file's."""
    from foudre.loading.gguf_quant import plan_gguf_quantized

    out = tmp_path / "q6.gguf"
    write_gguf(llama_dir, out, "Q6_K")
    model = _load(out, dequantize=True)
    f = read_gguf(out)
    for six_bit in (False, True):
        plan = plan_gguf_quantized(f, model, grouped8=True, six_bit=six_bit)
        assert plan.kept and all(
            k.layout == Layout(6 if six_bit else 8, 16, False) for k in plan.kept
        )
        assert all(
            k.scale_dtype == (torch.float16 if six_bit else torch.float32) for k in plan.kept
        )
