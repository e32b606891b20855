"""GGUF blocks repacked straight into the kernels' 16-row layouts, and dequantized natively
(``foudre.quant.gguf_blocks``, ``gguf_repack.cpp``): the fast path of loading Q4_0, Q4_1, Q4_K,
Q5_0 and Q8_0 files.

Oracles: the general path it replaces, bit for bit: a tensor's codes decoded
(``gguf_quant.decode_codes``), held as a ``QuantLinear``'s rows and repacked by its
``_native_layout`` (``cpu_qmatmul.interleave``); a whole file loaded with the fast path switched
off (every module's buffers and layout state, and every float weight, equal); the gguf package's
dequantizers (``gguf.quants.dequantize``) with torch's rounding to bfloat16.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from foudre.loading.gguf import read_gguf
from foudre.loading.gguf_quant import Layout, decode_codes
from foudre.loading.loader import load_model
from foudre.quant import cpu_qmatmul, gguf_blocks
from foudre.quant.packing import pack_int6
from foudre.quant.qlinear import QuantLinear
from tests.quant.test_gguf import write_gguf
from tests.quant.test_gguf_quantized import _random_blocks, _raw_gguf

pytestmark = pytest.mark.skipif(
    not cpu_qmatmul.repacks() or gguf_blocks._library() is None,
    reason="the 16-row blocks are built on the VNNI path only",
)

CPU = torch.device("cpu")


def _rows_path(f: object, tensor: object, layout: Layout, orders: list[torch.Tensor]) -> bytes:
    """The blocks the general path builds of ``tensor``'s rows in ``orders`` (one after another:
    a fused module's parts): decoded codes as a module's rows, interleaved."""
    c = decode_codes(f, tensor, layout)  # type: ignore[arg-type]
    codes = torch.cat([c.codes[o] for o in orders])
    scales = torch.cat([c.scales[o] for o in orders])
    zeros = None if c.zeros is None else torch.cat([c.zeros[o] for o in orders])
    half = tensor.type in (Q.Q4_0, Q.Q5_0, Q.Q8_0)  # type: ignore[attr-defined]
    mod = QuantLinear.from_codes(
        codes,
        scales,
        zeros,
        None,
        layout.bits,
        32,
        codes.shape[1],
        scale_dtype=torch.float16 if half else torch.float32,
    )
    mod._native_layout()
    assert mod.interleaved
    return mod.qweight.numpy().tobytes()


@pytest.mark.parametrize(
    ("qtype", "kind"),
    [
        ("Q4_0", "int4x16"),
        ("Q4_0", "int8x16"),
        ("Q5_0", "int8x16"),
        ("Q8_0", "int8x16"),
        ("Q4_1", "int4x16z"),
        ("Q4_K", "int4x16z"),
    ],
)
@pytest.mark.parametrize("permuted", [False, True])
def test_blocks_are_the_interleaved_rows(
    qtype: str, kind: str, permuted: bool, tmp_path: Path
) -> None:
    """Random blocks (40 rows: a last block of 8 padding rows), alone and in a module after 24
    rows of another tensor, rows in the file's order or another, repacked: the bytes the general
    path builds."""
    qt, rows, cols = Q[qtype], 40, 256
    raw = _random_blocks(qt, rows, cols, np.random.default_rng(int(qt)))
    if qtype == "Q4_0":  # (a d of 0 makes a zero point of 0: see the next test)
        d = raw.reshape(rows, -1, 18)[..., :2]
        d[(d == 0).all(axis=-1)] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    _raw_gguf(tmp_path / "t.gguf", {"t": (raw, qt)})
    f = read_gguf(tmp_path / "t.gguf")
    tensor = f.tensors["t"]
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(0))
    order = order if permuted else torch.arange(rows)
    layout = Layout(8, 32, False) if kind == "int8x16" else Layout(4, 32, True)
    assert gguf_blocks.blocks_kind([int(qt)], layout.bits, 32, False, cols) == kind
    address = f.data.ctypes.data + tensor.offset
    for first in (0, 24):  # alone; after 24 rows of another tensor (here: its first 24)
        total, zeros = first + rows, gguf_blocks.ZeroPoints()
        out = torch.full(gguf_blocks.shape(kind, total, cols), 0xA5, dtype=torch.uint8)
        if first:
            assert gguf_blocks.repack(kind, int(qt), address, None, first, cols, out, 0, zeros)
        index = order if permuted else None
        assert gguf_blocks.repack(kind, int(qt), address, index, rows, cols, out, first, zeros)
        assert not zeros.alike() or kind != "int4x16z"
        gguf_blocks.pad(kind, out, cols, total)
        want = _rows_path(f, tensor, layout, [torch.arange(first), order])
        assert out.numpy().tobytes() == want, first


@pytest.mark.parametrize("permuted", [False, True])
def test_int6_rows_are_pack_int6_of_the_decoded_codes(permuted: bool, tmp_path: Path) -> None:
    """Random Q6_K blocks (every code and sub-scale, some d 0) as a 6-bit module's rows 24..63
    (after 24 rows of another tensor), rows in the file's order or another: ``pack_int6`` of
    the decoded codes and sub-scales, and the file's d, byte for byte."""
    rows, cols = 40, 512
    raw = _random_blocks(Q.Q6_K, rows, cols, np.random.default_rng(6))
    _raw_gguf(tmp_path / "t.gguf", {"t": (raw, Q.Q6_K)})
    f = read_gguf(tmp_path / "t.gguf")
    tensor = f.tensors["t"]
    c = decode_codes(f, tensor, Layout(6, 16, False))
    assert c.subs is not None
    order = torch.randperm(rows, generator=torch.Generator().manual_seed(1))
    order = order if permuted else torch.arange(rows)
    q = torch.full((64, cols // 16 * 13), 0xA5, dtype=torch.uint8)
    d = torch.full((64, cols // 256), 7.0, dtype=torch.float16)
    address = f.data.ctypes.data + tensor.offset
    assert gguf_blocks.int6_rows(address, None, 24, cols, q, d, 0)
    assert gguf_blocks.int6_rows(address, order if permuted else None, rows, cols, q, d, 24)
    every = torch.cat([torch.arange(24), order])
    assert torch.equal(q, pack_int6(c.codes[every], c.subs[every]))
    assert torch.equal(d.view(torch.int16), c.scales[every].half().view(torch.int16))
    with pytest.raises(ValueError, match="int6 rows"):  # room for fewer rows
        gguf_blocks.int6_rows(address, None, rows, cols, q, d, 40)


def test_zero_d_in_4_bits_takes_the_general_path(tmp_path: Path) -> None:
    """A Q4_0 group whose d is 0 has zero point 0 in the general path's form (not 8): repack
    declines it, so the loader takes that path."""
    raw = _random_blocks(Q.Q4_0, 16, 256, np.random.default_rng(1))
    raw[3, 18 * 2 : 18 * 2 + 2] = 0
    path = tmp_path / "t.gguf"
    _raw_gguf(path, {"t": (raw, Q.Q4_0)})
    f = read_gguf(path)
    out = torch.empty(gguf_blocks.shape("int4x16", 16, 256), dtype=torch.uint8)
    address = f.data.ctypes.data + f.tensors["t"].offset
    assert not gguf_blocks.repack("int4x16", Q.Q4_0, address, None, 16, 256, out, 0)
    out = torch.empty(gguf_blocks.shape("int8x16", 16, 256), dtype=torch.uint8)
    assert gguf_blocks.repack("int8x16", Q.Q4_0, address, None, 16, 256, out, 0)  # 8 bits: no z
    with pytest.raises(ValueError, match="dst must be"):  # room for fewer rows
        gguf_blocks.repack("int8x16", Q.Q4_0, address, None, 16, 256, out, 8)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_k_quants_dequantize_as_the_gguf_dequantizers(qtype: str, dtype: torch.dtype) -> None:
    """Random K-quant blocks (every code, sub-scale and min; finite d and dmin, some 0, some
    subnormal): the gguf package's float32 values, rounded to bfloat16 as torch rounds them,
    bit for bit; an infinite d or dmin is declined."""
    qt = Q[qtype]
    rng = np.random.default_rng(int(qt))
    raw = _random_blocks(qt, 64, 4096, rng)  # 1024 blocks of 256
    halves = raw.reshape(-1, gguf.GGML_QUANT_SIZES[qt][1])
    at = [208] if qt == Q.Q6_K else [0, 2]
    tiny = (rng.integers(1, 1024, halves.shape[0]).astype(np.uint16)).view(np.uint8).reshape(-1, 2)
    halves[::7, at[0] : at[0] + 2] = tiny[::7]  # subnormal d
    want = torch.from_numpy(gguf.quants.dequantize(raw, qt).reshape(-1)).to(dtype)
    out = torch.empty(want.shape, dtype=dtype)
    assert gguf_blocks.dequantize(int(qt), raw.ctypes.data, out)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), want.view(bits))
    halves[3, at[-1] : at[-1] + 2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    assert not gguf_blocks.dequantize(int(qt), raw.ctypes.data, out)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_0", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_is_the_gguf_dequantizers(qtype: str, dtype: torch.dtype) -> None:
    """Every finite float16 d (subnormals included) with random codes: the gguf package's
    float32 values, rounded to bfloat16 as torch rounds them, bit for bit; an infinite d is
    declined (NaN values: the general path's)."""
    qt = Q[qtype]
    size = gguf.GGML_QUANT_SIZES[qt][1]
    raw = np.random.default_rng(int(qt)).integers(0, 256, (1 << 16, size), dtype=np.uint8)
    d = np.arange(1 << 16, dtype=np.uint16)
    d[(d & 0x7C00) == 0x7C00] = 0x3C00  # infinities and NaNs: 1.0
    raw[:, :2] = d.view(np.uint8).reshape(-1, 2)
    want = torch.from_numpy(gguf.quants.dequantize(raw.reshape(1, -1), qt).reshape(-1)).to(dtype)
    out = torch.empty(want.shape, dtype=dtype)
    assert gguf_blocks.dequantize(int(qt), raw.ctypes.data, out)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    assert torch.equal(out.view(bits), want.view(bits))
    raw[5, :2] = np.frombuffer(np.float16(np.inf).tobytes(), np.uint8)
    assert not gguf_blocks.dequantize(int(qt), raw.ctypes.data, out)


def _state(model: torch.nn.Module) -> dict[str, object]:
    """Every buffer and parameter's bytes, and each ``QuantLinear``'s layout state."""
    out: dict[str, object] = {}
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        out[name] = (t.dtype, tuple(t.shape), t.detach().contiguous().view(torch.uint8).clone())
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            out[f"{name}.interleaved"] = mod._interleaved
    return out


def _same_state(a: dict[str, object], b: dict[str, object]) -> None:
    assert a.keys() == b.keys()
    for key, value in a.items():
        other = b[key]
        if isinstance(value, tuple) and len(value) == 3 and isinstance(value[2], torch.Tensor):
            assert isinstance(other, tuple)
            assert value[:2] == other[:2] and torch.equal(value[2], other[2]), key
        else:
            assert value == other, key


@pytest.mark.parametrize(
    "case", ["Q4_0", "Q8_0", "Q5_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K", "mixed", "zero_d"]
)
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_loaded_model_is_the_general_paths(
    case: str, dtype: str, llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A llama file (q/k rows un-permuted at load) loaded with the blocks built straight from
    the file is the model the general path loads, byte for byte: every module's blocks and
    layout state, and the embedding dequantized natively (all but Q4_1). ``mixed``: Q8_0 and
    Q5_0 parts beside Q4_0 ones (8-bit modules), Q4_K and Q4_1 ones (4 bits, zero points
    stored); ``zero_d``: Q4_0 groups whose d is 0 (those modules: the general path)."""
    out = tmp_path / f"{case}.gguf"
    qtype = "Q4_0" if case in ("mixed", "zero_d") else case
    mixed = {
        "blk.0.attn_k.weight": "Q8_0",
        "blk.1.ffn_up.weight": "Q5_0",
        "blk.0.ffn_up.weight": "Q4_K",
        "blk.1.attn_q.weight": "Q4_1",
    }
    types = mixed if case == "mixed" else None
    write_gguf(llama_dir, out, qtype, types=types)
    if case == "zero_d":
        t = read_gguf(out).tensors["blk.0.ffn_up.weight"]
        data = bytearray(out.read_bytes())
        data[t.offset + 5 * 18 : t.offset + 5 * 18 + 2] = b"\0\0"
        out.write_bytes(bytes(data))
    taken: list[str] = []  # the native paths the fast load took
    for name in ("repack", "int6_rows", "dequantize"):
        native = getattr(gguf_blocks, name)
        spy = lambda *a, _f=native, _n=name, **k: taken.append(_n) or _f(*a, **k)  # noqa: E731
        monkeypatch.setattr(gguf_blocks, name, spy)
    fast = load_model(str(out), None, dtype, CPU, None).model
    monkeypatch.undo()
    interleaved = [m for m in fast.modules() if isinstance(m, QuantLinear) and m.interleaved]
    assert bool(interleaved) == (case not in ("Q5_K", "Q6_K"))  # (those: rows, as before)
    assert ("int6_rows" in taken) == (case == "Q6_K")
    assert ("dequantize" in taken) and (("repack" in taken) == bool(interleaved))
    with monkeypatch.context() as mp:
        mp.setattr(gguf_blocks, "blocks_kind", lambda *args: None)
        mp.setattr(gguf_blocks, "dequantize", lambda *args: False)
        mp.setattr(gguf_blocks, "int6_rows", lambda *args: False)
        general = load_model(str(out), None, dtype, CPU, None).model
    _same_state(_state(fast), _state(general))
