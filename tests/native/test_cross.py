"""The native kernels on another architecture and another compiler, without that machine.

``harness.cpp`` (beside this file) drives the kernels from stdin and stdout. It is built with the
kernel sources twice: for aarch64 with the distribution's cross compiler, run under qemu-user,
and for x86-64's baseline on this host. Each call's inputs are laid out here the way the Python
side lays them out for the host's own kernels (``cpu_qmatmul.layout``, the paged cache), and the
outputs are compared with the host's references: the same error bounds as the host's kernel
tests, and, where both builds run the same portable code, bit for bit with the x86-64 build
(the float rules, -ffp-contract=off, make them identical).
The tools come from the distribution's packages (``g++-aarch64-linux-gnu``, ``qemu-user``,
``clang``; scripts/setup.sh installs them where it can); a host without them skips.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest
import torch

from foudre.native import build as native
from foudre.quant import cpu_qmatmul
from tests.engine.march import run_check
from tests.quant.test_cpu_qmatmul import CASES, quant_module

HERE = Path(__file__).parent
KERNELS = [native.SOURCES / "cpu_qmatmul.cpp", native.SOURCES / "cpu_paged_decode.cpp"]
CROSS, QEMU = "aarch64-linux-gnu-g++", "qemu-aarch64"
# the kernels' own flags, for an executable instead of a library
FLAGS = [f for f in native.flags() if f not in ("-shared", "-fPIC") and not f.startswith("-march")]

needs_cross = pytest.mark.skipif(
    shutil.which(CROSS) is None or shutil.which(QEMU) is None,
    reason=f"{CROSS} and {QEMU} not installed (apt-get install g++-aarch64-linux-gnu qemu-user)",
)


def _build(out: Path, command: list[str]) -> Path:
    done = subprocess.run(
        [*command, str(HERE / "harness.cpp"), *map(str, KERNELS), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


# the Arm targets the harness is built for, and the quantized matmuls' path each build takes
# (qemu-aarch64 -cpu max runs them all: it emulates dotprod, i8mm, bf16 and fp16)
ARM_TARGETS = {
    "armv8-a": "neon",
    "armv8.2-a+dotprod": "dotprod",
    "armv8.6-a+i8mm+bf16": "i8mm",
}


@pytest.fixture(scope="module", params=list(ARM_TARGETS))
def march(request: pytest.FixtureRequest) -> str:
    """An Arm target (ARM_TARGETS)."""
    return str(request.param)


@pytest.fixture(scope="module")
def arm(march: str, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The command that runs the aarch64 harness built for ``march`` (Armv8.0: NEON's float
    paths; with dotprod, and with i8mm too: the integer paths)."""
    if shutil.which(CROSS) is None or shutil.which(QEMU) is None:
        pytest.skip(f"{CROSS} and {QEMU} not installed")
    out = tmp_path_factory.mktemp("arm") / "harness"
    return [QEMU, "-cpu", "max", str(_build(out, [CROSS, *FLAGS, f"-march={march}", "-static"]))]


def arm_path(command: list[str]) -> str:
    """The quantized matmuls' path of the harness ``command`` (cpu_qmatmul.PATHS' name)."""
    out = subprocess.run(command, input=b"path\n", capture_output=True, timeout=120).stdout
    return cpu_qmatmul.PATHS[struct.unpack("<i", out)[0]]


@pytest.fixture(scope="module")
def x86(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The command that runs the x86-64 baseline harness (no AVX: the same portable paths)."""
    cxx = native.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    out = tmp_path_factory.mktemp("x86") / "harness"
    return [str(_build(out, [cxx, *FLAGS, "-march=x86-64"]))]


def call(command: list[str], name: str, params: list[float], arrays: list[torch.Tensor]) -> bytes:
    """``name``'s output for ``params`` and ``arrays``, from the harness ``command``."""
    blob = [f"{name}\n".encode(), struct.pack(f"<q{len(params)}d", len(params), *params)]
    blob.append(struct.pack("<q", len(arrays)))
    for a in arrays:
        data = a.contiguous().view(torch.uint8).numpy().tobytes() if a.numel() else b""
        blob += [struct.pack("<q", len(data)), data]
    done = subprocess.run(command, input=b"".join(blob), capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout


def qmm(command: list[str], x: torch.Tensor, packed: cpu_qmatmul.Packed) -> torch.Tensor:
    """``cpu_qmatmul.matmul(x, packed)`` through the harness ``command``."""
    z_address, zc, st, groups, group, stride = packed.arguments()
    m, n, k = x.shape[0], packed.rows, packed.k
    x = torch.nn.functional.pad(x, (0, k - x.shape[1]))
    s = _to_the_end(packed.s)
    z = _to_the_end(packed.z) if z_address and packed.z is not None else torch.empty(0)
    suffix = "f32" if x.dtype == torch.float32 else "bf16"
    params = [cpu_qmatmul.KINDS[packed.kind], zc, st, groups, group, stride, m, n, k]
    out = call(command, f"qmm_{suffix}", params, [x, packed.w, s, z])
    return torch.frombuffer(bytearray(out), dtype=x.dtype).view(m, n)


def _to_the_end(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage from its first element on: what the kernel may read from its address
    (scales and zero points paired in one buffer, read with their row stride)."""
    size = t.untyped_storage().nbytes() // t.element_size() - t.storage_offset()
    return t.as_strided((size,), (1,), t.storage_offset())


@needs_cross
def test_aarch64_build_takes_its_targets_path(march: str, arm: list[str], x86: list[str]) -> None:
    """Each Arm build's path is its target's (Armv8.0: NEON float; +dotprod: SDOT; +i8mm:
    SMMLA), the x86-64 baseline's the portable one."""
    assert arm_path(arm) == ARM_TARGETS[march]
    assert arm_path(x86) == "portable"


@needs_cross
def test_quantized_matmul_on_aarch64_matches_the_host(arm: list[str], x86: list[str]) -> None:
    """Every weight layout of the host's kernel tests (int8 per channel and in groups, int4,
    int6, zero points or not, each scale type), float32 and bfloat16 activations, 1, 3 and 17 x
    rows (SMMLA's pairs and an odd row left), through each Arm build's path (int6 the portable
    one): within the host's error bound of the reference for that path (cpu_qmatmul.error_bound:
    the float paths' sums; with dotprod and i8mm x rounded to int8 per block as VNNI and AVX2
    round it); int6 equal to the x86-64 build's portable loops bit for bit."""
    rounds = arm_path(arm) in cpu_qmatmul.ROUNDING_PATHS
    for bits, group, zero, n, k, scale_dtype in CASES[::2]:
        torch.manual_seed(bits * 1000 + n + k)
        w = torch.randn(n, k) * 0.1 + torch.linspace(-0.05, 0.1, k)
        mod = quant_module(bits, group, zero, w).to(scale_dtype)
        packed = cpu_qmatmul.layout(mod.qweight, mod.scales, mod.zeros, mod.group_size, bits)
        if packed.z is not None:  # scales and zero points paired in one stream, as models run
            s, z = cpu_qmatmul.pair_scales(packed.s, packed.z)
            packed = dataclasses.replace(packed, s=s, z=z)
        wd = mod.dequantize()
        for m in (1, 3, 17):
            for dtype in (torch.float32, torch.bfloat16):
                x = (torch.randn(m, k) * torch.rand(m, 1) * 4).to(dtype)
                got = qmm(arm, x, packed)
                if bits == 6:
                    assert torch.equal(got, qmm(x86, x, packed)), (group, zero, m, dtype)
                ref = x.float() @ wd.t()
                tol = cpu_qmatmul.error_bound(x.float(), wd, bits, group, rounds=rounds)
                if dtype == torch.bfloat16:
                    tol = tol + ref.abs() * 2**-8
                assert bool(((got.float() - ref).abs() <= tol).all()), (bits, group, zero, m)


@needs_cross
@pytest.mark.parametrize("window", [0, 5])
def test_paged_decode_on_aarch64_matches_the_host(
    arm: list[str], x86: list[str], window: int
) -> None:
    """Decode attention over a paged float32 cache (GQA, rows of different lengths, blocks out
    of order, a sliding window): the softmax-weighted sum of the reference, and the x86-64
    build's values bit for bit."""
    torch.manual_seed(window)
    heads, kv_heads, d, bs, blocks = 8, 2, 32, 4, 20
    cache = torch.randn(2, blocks, bs, kv_heads, d)
    lens = torch.tensor([1, 7, 13, 16], dtype=torch.int32)
    tables = torch.randperm(blocks)[:16].view(4, 4).to(torch.int32)
    q = torch.randn(len(lens), heads, d)
    scale = d**-0.5
    params = [len(lens), heads, kv_heads, d, bs, tables.shape[1], scale, window]
    out = call(arm, "paged_decode_f32", params, [q, cache, tables, lens])
    got = torch.frombuffer(bytearray(out), dtype=torch.float32).view_as(q)
    assert got.numpy().tobytes() == call(x86, "paged_decode_f32", params, [q, cache, tables, lens])
    for r, n in enumerate(lens.tolist()):
        slots = [int(tables[r, p // bs]) * bs + p % bs for p in range(n)]
        first = max(0, n - window) if window else 0
        k, v = (cache[i].reshape(-1, kv_heads, d)[slots[first:]] for i in (0, 1))
        k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
        p = torch.softmax(torch.einsum("hd,thd->ht", q[r], k) * scale, dim=-1)
        torch.testing.assert_close(got[r], torch.einsum("ht,thd->hd", p, v), atol=2e-6, rtol=1e-5)


needs_clang = pytest.mark.skipif(shutil.which("clang++") is None, reason="clang++ not installed")


@pytest.mark.slow
@needs_clang
@pytest.mark.parametrize("source", sorted(native.SOURCES.glob("*.cpp")), ids=lambda p: p.name)
def test_kernels_build_with_clang(source: Path, tmp_path: Path) -> None:
    """Each source compiles with clang as with GCC: with clang's OpenMP where it has a runtime,
    else against foudre's (omp/runtime.cpp), and with no OpenMP at all (one thread)."""
    mode = native.openmp_mode("clang++")
    assert mode in ("native", "runtime"), mode
    extra = [str(native.RUNTIME)] if mode == "runtime" else []
    flags = [f for f in native.flags(mode) if f != "-O3"]  # (-O1: a third of the time)
    command = ["clang++", *flags, "-O1", str(source), *extra, "-o", str(tmp_path / "lib.so")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    command = ["clang++", *native.flags("none"), "-fsyntax-only", str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@needs_clang
def test_kernels_run_on_foudres_openmp_runtime(tmp_path: Path) -> None:
    """Where clang has no OpenMP runtime (as Apple's), the kernels built by it run their
    parallel loops on foudre's pool (two threads here) and pass the host's kernel checks: the
    quantized matmuls of every layout and the paged decode and prefill kernels."""
    if native.openmp_mode("clang++") != "runtime":
        pytest.skip("this clang has an OpenMP runtime of its own")
    env = dict(os.environ, CXX="clang++", FOUDRE_CACHE=str(tmp_path), OMP_NUM_THREADS="2")
    checks = [
        "tests.quant.test_cpu_qmatmul:check_kernels",
        "tests.engine.test_cpu_attention:check_all_dtypes",
        "tests.engine.test_prefill_attention:check_cpu_kernels",
    ]
    loaded = (
        "import torch\n"
        "from foudre.quant import cpu_qmatmul\n"
        "assert torch.get_num_threads() == 2\n"
        f"assert {str(tmp_path)!r} in open('/proc/self/maps').read()\n"
    )
    run_check(checks, env, loaded)
