"""The Triton GEMV / split-K / tiled dequantize-matmul kernels against dequantize-then-matmul.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` on CPU tensors, in a subprocess (the
variable must be set before Triton is imported), one for every weight layout; with a GPU the same
script runs them for real. Each layout is checked at M = 1, 3, 16 and 64 rows, on shapes whose N
and K are not multiples of the tiles (two on a GPU, one in the interpreter), with fixed tile
configs (single and split K, sub-tiles inside one group and several groups per step) and with
``choose_config``'s, in float32 and in a half dtype: float16 through ``tl.dot`` (the
interpreter's bfloat16 ``tl.dot`` is wrong: it multiplies the raw bits), bfloat16 through the
GEMV kernel. The oracle is the float64 product of
the same activations with the weight dequantized in the test (``(q - zero) * scale``).
"""

from __future__ import annotations

import json

import pytest
import torch

from foudre.quant.packing import pack_int4, quantize_int4, quantize_int8
from tests.triton_check import run_triton_check, start_triton_checks

HAS_CUDA = torch.cuda.is_available()

_CHECK = """
import json, sys
import torch
from foudre.quant import triton_kernels as tk
from foudre.quant.packing import pack_int4, quantize_int4, quantize_int8, quantize_int8_grouped

device = torch.device(sys.argv[1])
C = tk.KernelConfig
CONFIGS = {  # fixed tiles; None: choose_config's
    1: [C(1, 16, 32, 1), C(1, 8, 64, 3), None],
    3: [C(16, 16, 32, 2), C(16, 32, 16, 1), None],
    16: [C(16, 32, 64, 3), None],
    64: [C(32, 32, 32, 2), C(64, 16, 16, 1), None],
}


def layout(n, k, g):
    # (qweight, scales, zeros, group_size, float64 dequantized weight [n, k])
    w = torch.randn(n, k, generator=g) * (torch.rand(n, 1, generator=g) + 0.5)
    if kind == "int8":
        q, s = quantize_int8(w)
        return q, s, None, None, q.double() * s.double()[:, None]
    if kind == "fp8":
        s = w.abs().amax(1) / 448
        q = (w / s[:, None]).to(torch.float8_e4m3fn)
        return q, s, None, None, q.double() * s.double()[:, None]
    if kind == "int4":
        q, s, z = quantize_int4(w, group)
        codes = q.double().view(n, -1, group)
        deq = ((codes - z.double()[..., None]) * s.double()[..., None]).view(n, -1)
        return pack_int4(q), s, z, group, deq[:, :k]
    q, s = quantize_int8_grouped(w, group)
    z = None
    codes = q.double().view(n, -1, group)
    if kind == "int8gz":  # zero points: w = (q - z) * s
        z = torch.randint(-4, 5, s.shape, generator=g).float()
        codes = codes - z.double()[..., None]
    deq = (codes * s.double()[..., None]).view(n, -1)
    return q, s, z, group, deq[:, :k]


TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}
# (the interpreter runs the second alone: N and K both off the tiles, seconds a case)
SHAPES = ((37, 200), (70, 171)) if device.type == "cuda" else ((70, 171),)
results = {}
for kind, group in (arg.split(":") for arg in sys.argv[2:]):
    group = int(group) or None
    failures, cases = [], 0
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        q, s, z, gs, deq = layout(n, k, g)
        bias = torch.randn(n, generator=g)
        for m, configs in CONFIGS.items():
            for cfg in configs:
                # bf16 through tl.dot on a GPU only (the interpreter's bf16 tl.dot is wrong)
                half = torch.bfloat16 if m == 1 or device == "cuda" else torch.float16
                dtypes = [torch.float32, half]
                for dtype in dtypes:
                    x = torch.randn(m, k, generator=g).to(dtype)
                    b = bias if m != 3 else None
                    y = tk.quant_matmul(
                        x.to(device), q.to(device), s.to(device),
                        None if z is None else z.to(device), gs,
                        None if b is None else b.to(device), cfg,
                    )
                    ref = x.double() @ deq.t() + (0 if b is None else b.double())
                    err = (y.cpu().double() - ref).abs().max().item()
                    bound = TOL[dtype] * ref.abs().max().item() + 1e-5
                    cases += 1
                    if not (y.dtype == dtype and y.shape == (m, n) and err <= bound):
                        failures.append([n, k, m, repr(cfg), str(dtype), err, bound])
    results[f"{kind}:{group or 0}"] = {"cases": cases, "failures": failures}
print(json.dumps(results))
"""

KINDS = [
    ("int8", 0),
    ("fp8", 0),
    ("int8g", 16),
    ("int8g", 32),
    ("int8g", 128),
    ("int8gz", 16),
    ("int8gz", 64),
    ("int4", 16),
    ("int4", 32),
    ("int4", 128),
    ("int4", 256),
]


def _fp8_unsupported() -> bool:
    return HAS_CUDA and torch.cuda.get_device_capability() < (8, 9)


@pytest.fixture(scope="module")
def checked() -> dict[str, dict[str, object]]:
    """Every layout's cases, in two interpreters side by side (a process's start and Triton's
    import, ~3 s, once a half and not once a layout): ``"kind:group" -> {"cases",
    "failures"}``."""
    kinds = [f"{k}:{g}" for k, g in KINDS if not (k == "fp8" and _fp8_unsupported())]
    device = "cuda" if HAS_CUDA else "cpu"
    halves = {str(i): (_CHECK, device, *kinds[i::2]) for i in range(2)}
    results: dict[str, dict[str, object]] = {}
    for out in start_triton_checks(halves, interpret=not HAS_CUDA, timeout=1200).values():
        done = out.result()
        assert done.returncode == 0, done.stderr[-3000:]
        results |= json.loads(done.stdout.strip().splitlines()[-1])
    return results


@pytest.mark.slow
@pytest.mark.parametrize("kind,group", KINDS, ids=[f"{k}-g{g}" for k, g in KINDS])
def test_kernels_match_dequantize_reference(
    kind: str, group: int, checked: dict[str, dict[str, object]]
) -> None:
    if kind == "fp8" and _fp8_unsupported():
        pytest.skip("Triton's float8 e4m3 needs compute capability 8.9")
    result = checked[f"{kind}:{group}"]
    assert result["cases"] == (2 if HAS_CUDA else 1) * 11 * 2  # shapes x configs x dtypes
    assert result["failures"] == [], result["failures"]


_MODULE_CHECK = """
import sys
import torch
from foudre.quant.qlinear import QuantLinear

device = torch.device(sys.argv[1])
torch.manual_seed(0)
for bits, group in ((8, None), (8, 32), (4, 64)):
    for shape in ((1, 96), (2, 3, 96), (40, 96)):
        mod = QuantLinear.from_float(torch.randn(50, 96), torch.randn(50), bits, group).to(device)
        x = torch.randn(*shape, device=device)
        y, ref = mod._forward_cuda(x), mod.forward_reference(x)
        assert y.shape == (*shape[:-1], 50), (bits, group, shape, y.shape)
        err = (y - ref).abs().max().item()
        assert err < 1e-4 * ref.abs().max().item(), (bits, group, shape, err)
print("ok")
"""


def test_quant_linear_cuda_forward_runs_the_kernels() -> None:
    """``QuantLinear._forward_cuda`` (every layout, group-wise int8 included) with bias and
    leading dimensions, against ``forward_reference``."""
    device = "cuda" if HAS_CUDA else "cpu"
    run_triton_check(_MODULE_CHECK, device, interpret=not HAS_CUDA, timeout=300)


def test_choose_config_by_rows() -> None:
    tk = pytest.importorskip("foudre.quant.triton_kernels", reason="triton is not installed")
    cpu = torch.device("cpu")
    one = tk.choose_config(1, 4096, 4096, cpu)
    assert one.block_m == 1 and one.split_k >= 1
    assert tk.choose_config(16, 4096, 4096, cpu).block_m == 16
    assert tk.choose_config(64, 4096, 4096, cpu).block_m == 64
    assert tk.choose_config(512, 4096, 4096, cpu).block_m == 128
    # a short K is not split into slices of less than two steps
    short = tk.choose_config(1, 16, 256, cpu)
    assert short.split_k == 1
    q8, s8 = quantize_int8(torch.randn(24, 64))
    assert tk.quant_matmul(torch.empty(0, 64), q8, s8, None, None).shape == (0, 24)


def test_bad_layouts_raise() -> None:
    tk = pytest.importorskip("foudre.quant.triton_kernels", reason="triton is not installed")
    w = torch.randn(16, 96)
    q4, s4, z4 = quantize_int4(w, 32)
    x = torch.randn(1, 96)
    with pytest.raises(ValueError, match="zeros"):
        tk.quant_matmul(x, q4, s4, None, 32)
    with pytest.raises(ValueError, match="group_size"):
        tk.quant_matmul(x, q4, s4, z4, None)
    q8, s8 = quantize_int8(w)
    with pytest.raises(ValueError, match="group_size"):
        tk.quant_matmul(x, q8, s8[:, None].expand(16, 2).contiguous(), None, 48)
    with pytest.raises(ValueError, match="97 columns"):
        tk.quant_matmul(torch.randn(1, 97), q8, s8, None, None)
    with pytest.raises(ValueError, match="powers of two"):
        tk.KernelConfig(16, 48, 64)
    with pytest.raises(ValueError, match=">= 16"):
        tk.KernelConfig(16, 8, 64)
    with pytest.raises(ValueError, match="one row"):
        tk.quant_matmul(torch.randn(2, 96), q8, s8, None, None, config=tk.KernelConfig(1, 16, 32))
    with pytest.raises(ValueError, match="scales has shape"):
        tk.quant_matmul(x, q8, s8[:8], None, None)
    with pytest.raises(ValueError, match="zeros has shape"):
        tk.quant_matmul(x, pack_int4(q4), s4, z4[:, :1], 32)
    with pytest.raises(ValueError, match="bias has shape"):
        tk.quant_matmul(x, q8, s8, None, None, torch.randn(8))
    with pytest.raises(ValueError, match="qweight must be"):
        tk.quant_matmul(x, w.bfloat16(), s8, None, None)


_COMPILE_CHECK = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from foudre.quant import triton_kernels as tk

ints = ("N", "K", "KB", "M", "stride_xm", "stride_ym", "stride_wn", "stride_sn", "TILES")


def build(kernel, x, w, consts, capability):
    names = kernel.arg_names
    sig = {a: "constexpr" if a in consts else "i32" if a in ints else "*bf16" for a in names}
    sig |= {"x_ptr": x, "y_ptr": x, "w_ptr": w, "p_ptr": "*fp32"}
    src = ASTSource(kernel, sig, consts, {})
    triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": 4})


common = dict(HAS_BIAS=True, PARTIAL=True, BLOCK_N=32)
for capability, x in ((90, "*bf16"), (80, "*fp16")):
    for bits, w, group_b, zeros, fp8 in (
        (8, "*i8", 0, False, False), (8, "*i8", 16, True, False), (4, "*u8", 64, True, False),
        (8, "*fp8e4nv", 0, False, True),
    ):
        if fp8 and capability < 89:
            continue
        for block_kb in (32, 128):
            gt = block_kb if group_b == 0 else min(group_b, block_kb)
            c = dict(common, BITS=bits, GROUP_B=group_b, GT=gt, NGT=block_kb // gt,
                     HAS_ZEROS=zeros, FP8=fp8, BLOCK_KB=block_kb)
            build(tk._gemv_kernel, x, w, c, capability)
            build(tk._gemm_kernel, x, w, dict(c, IEEE=False, BLOCK_M=16), capability)
print("ok")
"""


@pytest.mark.slow
def test_kernels_compile_for_gpus() -> None:
    """The kernels through Triton's real compiler (to sm_90 and sm_80 machine code; no GPU
    needed), which checks what the interpreter does not: layouts, ``tl.dot`` shapes, types."""
    run_triton_check(_COMPILE_CHECK, interpret=False, timeout=600)
