"""The native kernels on another architecture and another compiler, without that machine.

``harness.cpp`` (beside this file) drives the kernels from stdin and stdout. It is built with the
kernel sources for aarch64 with the distribution's cross compiler, for three targets (Armv8.0:
NEON's float paths; +dotprod and +i8mm: the quantized matmuls' integer paths; ARM_TARGETS),
each run under ``qemu-aarch64 -cpu max`` (which emulates those features), and for x86-64's
baseline on this host (the portable loops). Each call's inputs are laid out here the way the Python
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
from typing import Any

import pytest
import torch

from foudre.native import build as native
from foudre.quant import cpu_qmatmul
from tests.engine.march import run_check
from tests.engine.test_prefill_attention import reference
from tests.quant.test_cpu_qmatmul import CASES, quant_module

HERE = Path(__file__).parent
KERNELS = [
    native.SOURCES / f"{name}.cpp"
    for name in ("cpu_qmatmul", "cpu_paged_decode", "cpu_paged_prefill")
]
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
    check_quantized_matmul(arm, x86, CASES[::2])


def check_quantized_matmul(
    command: list[str], x86: list[str], cases: list[tuple[Any, ...]]
) -> None:
    """test_quantized_matmul_on_aarch64_matches_the_host's checks of the harness ``command``
    over the host kernel tests' ``cases``."""
    rounds = arm_path(command) in cpu_qmatmul.ROUNDING_PATHS
    for bits, group, zero, n, k, scale_dtype in cases:
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
                got = qmm(command, x, packed)
                if bits == 6:
                    assert torch.equal(got, qmm(x86, x, packed)), (group, zero, m, dtype)
                ref = x.float() @ wd.t()
                tol = cpu_qmatmul.error_bound(x.float(), wd, bits, group, rounds=rounds)
                if dtype == torch.bfloat16:
                    tol = tol + ref.abs() * 2**-8
                assert bool(((got.float() - ref).abs() <= tol).all()), (bits, group, zero, m)


# the storage types of the paged kernels (the harness's suffixes) and their bounds against the
# float32 reference over the same rounded values (the host's kernel tests': float32 to its
# rounding; 16-bit types a few output ulps)
ATTENTION_TYPES = {"f32": (torch.float32, 2e-5), "bf16": (torch.bfloat16, 1e-2)}
ATTENTION_TYPES["f16"] = (torch.float16, 2e-3)


def _pool(
    rows: list[tuple[int, int]], kv_heads: int, d: int, bs: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """A paged pool for ``rows`` ((new tokens, context) each), its blocks handed out in random
    order: the pool NaN wherever a kernel must not read (spare blocks, past each row's context),
    the same pool with zeros there, and each row's block table."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-c // bs) for _, c in rows) + 3
    perm = torch.randperm(nb, generator=g).tolist()
    tables, used = [], 0
    for _, ctx in rows:
        tables.append(perm[used : used + -(-ctx // bs)])
        used += len(tables[-1])
    clean = torch.randn(2, nb, bs, kv_heads, d, generator=g).to(dtype)
    poisoned = clean.clone()
    poisoned[:, perm[used:]] = float("nan")
    for table, (_, ctx) in zip(tables, rows, strict=True):
        poisoned[:, table[-1], (ctx - 1) % bs + 1 :] = float("nan")
    return poisoned, torch.where(poisoned.isnan(), 0.0, poisoned), tables


def _table_tensor(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


@needs_cross
@pytest.mark.parametrize("type_name", list(ATTENTION_TYPES))
def test_paged_decode_on_aarch64_matches_the_host(
    arm: list[str], x86: list[str], type_name: str
) -> None:
    """Decode attention over a paged cache of each storage type (float32, bfloat16, float16;
    GQA, rows of different lengths, blocks out of order, NaN wherever the kernel must not read),
    with and without a sliding window and attention sinks: on every Arm build (NEON's path)
    the host's float32 reference over the same values (tests/engine/test_prefill_attention's
    masked SDPA, with sinks an explicit softmax), within the host's kernel tests' bounds; the
    x86-64 baseline build (the portable loops) within the same bounds. And with each row's new
    token handed over (its slot NaN in the pool), which the kernel stores before it reads."""
    dtype, atol = ATTENTION_TYPES[type_name]
    heads, kv_heads, d, bs = 8, 2, 40, 4  # (head_dim 40: two whole chunks of 16 and a part)
    rows = [(1, n) for n in (1, 7, 13, 16, 37)]
    poisoned, clean, tables = _pool(rows, kv_heads, d, bs, dtype, seed=len(type_name))
    lens = torch.tensor([c for _, c in rows], dtype=torch.int32)
    q = torch.randn(len(rows), heads, d).to(dtype)
    # each row's last key and value NaN in the pool, handed to the kernel as new tokens instead
    last = [(t[(c - 1) // bs], (c - 1) % bs) for t, (_, c) in zip(tables, rows, strict=True)]
    unstored = poisoned.clone()
    for b, j in last:
        unstored[:, b, j] = float("nan")
    new_k, new_v = (torch.stack([clean[i, b, j] for b, j in last]) for i in (0, 1))
    none = torch.empty(0)
    cases = [
        (w, s, pool, kv)
        for w, s in ((0, False), (5, False), (0, True), (6, True))
        for pool, kv in ((poisoned, (none, none)), (unstored, (new_k, new_v)))
    ]
    for window, with_sinks, pool, fresh in cases:
        sinks = 2 * torch.randn(heads) if with_sinks else torch.empty(0)
        params = [len(rows), heads, kv_heads, d, bs, max(map(len, tables)), d**-0.5, window]
        arrays = [q, pool, _table_tensor(tables), lens, sinks, *fresh]
        ref = reference(q, clean, tables, rows, bs, window or None, sinks if with_sinks else None)
        for command in (arm, x86):
            out = call(command, f"paged_decode_{type_name}", params, arrays)
            got = torch.frombuffer(bytearray(out), dtype=dtype).view_as(q).float()
            assert not got.isnan().any(), "read a slot it must not"
            torch.testing.assert_close(got, ref, atol=atol, rtol=0, msg=str((window, sinks)))


@needs_cross
@pytest.mark.parametrize("type_name", list(ATTENTION_TYPES))
def test_paged_prefill_on_aarch64_matches_the_host(
    arm: list[str], x86: list[str], type_name: str
) -> None:
    """Prefill attention (rows of several new tokens after a cached prefix, a decode row, GQA
    groups of 1 to 4, head sizes 20 and 64, a sliding window, attention sinks) over a paged cache
    of each storage type: on every Arm build (NEON's tiles) and the x86-64 baseline (the
    portable ones) the host's float32 reference within the host's bounds."""
    dtype, atol = ATTENTION_TYPES[type_name]
    shapes = [(4, 2, 64, 8, None, False), (6, 2, 20, 16, 9, True), (4, 4, 20, 8, 40, False)]
    for seed, (heads, kv_heads, d, bs, window, with_sinks) in enumerate(shapes):
        rows = [(33, 45), (1, 2 * bs + 5), (3, bs + 2), (5, 5)]
        poisoned, clean, tables = _pool(rows, kv_heads, d, bs, dtype, seed)
        total = sum(n for n, _ in rows)
        q = torch.randn(total, heads, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
        starts = torch.tensor([0, 33, 34, 37], dtype=torch.int32)
        q_lens = torch.tensor([n for n, _ in rows], dtype=torch.int32)
        ctx = torch.tensor([c for _, c in rows], dtype=torch.int32)
        sinks = 2 * torch.randn(heads) if with_sinks else torch.empty(0)
        params = [len(rows), heads, kv_heads, d, bs, max(map(len, tables)), window or 0, d**-0.5]
        arrays = [q, poisoned, starts, q_lens, ctx, _table_tensor(tables), sinks]
        ref = reference(q, clean, tables, rows, bs, window, sinks if with_sinks else None)
        for command in (arm, x86):
            out = call(command, f"paged_prefill_{type_name}", params, arrays)
            got = torch.frombuffer(bytearray(out), dtype=dtype).view_as(q).float()
            assert not got.isnan().any(), "read a slot it must not"
            torch.testing.assert_close(got, ref, atol=atol, rtol=0, msg=str(shapes[seed]))


def _codes(
    clean: torch.Tensor, kind: str, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A quantized cache like ``clean`` (attention/kv_quant.py's layout: 8-bit codes, one float32
    scale per token and KV head): the codes (int8, or float8 e4m3fn's bytes), the scales (NaN
    wherever ``clean`` is: a kernel must not read them), and the values they stand for."""
    g = torch.Generator().manual_seed(seed)
    if kind == "int8":
        codes = torch.randint(-127, 128, clean.shape, generator=g, dtype=torch.int8)
        values = codes.float()
    else:
        values = (torch.randn(clean.shape, generator=g) * 40).to(torch.float8_e4m3fn)
        codes, values = values.view(torch.uint8), values.float()
    scales = torch.rand(clean.shape[:-1], generator=g) / 64 + 1 / 256
    scales = torch.where(clean.isnan().any(-1), float("nan"), scales)
    return codes, scales, values * torch.where(scales.isnan(), 0.0, scales)[..., None]


@needs_cross
@pytest.mark.parametrize("type_name", ["f32_int8", "bf16_fp8", "f16_int8", "f32_fp8"])
def test_paged_attention_over_codes_on_aarch64(
    arm: list[str], x86: list[str], type_name: str
) -> None:
    """Decode and prefill attention over a quantized cache (int8 and float8 e4m3fn codes with a
    float32 scale per token and KV head, NaN scales wherever the kernels must not read), queries
    of each type, a window and sinks: on every Arm build (NEON's codes conversion: int8 widened,
    e4m3 through a float16's bits) and the x86-64 baseline, the host's float32 reference over
    the values the codes stand for."""
    q_name, kind = type_name.split("_")
    dtype, atol = ATTENTION_TYPES[q_name]
    heads, kv_heads, d, bs = 6, 2, 40, 8
    rows = [(1, 19), (9, 30), (1, 3), (4, 11)]
    poisoned, _, tables = _pool(rows, kv_heads, d, bs, torch.float32, seed=3)
    codes, scales, values = _codes(poisoned, kind, seed=4)
    table = _table_tensor(tables)
    q = torch.randn(sum(n for n, _ in rows), heads, d).to(dtype)
    lens = torch.tensor([c for _, c in rows], dtype=torch.int32)
    q_lens = torch.tensor([n for n, _ in rows], dtype=torch.int32)
    starts = torch.cumsum(q_lens, 0, dtype=torch.int32) - q_lens
    sinks = 2 * torch.randn(heads)
    width = table.shape[1]
    for window in (0, 7):
        ref = reference(q, values, tables, rows, bs, window or None, sinks)
        decode = [i for i, (n, _) in enumerate(rows) if n == 1]  # (decode rows by themselves)
        qd = q[starts[decode].long()]
        decode_params = [len(decode), heads, kv_heads, d, bs, width, d**-0.5, window]
        decode_arrays = [qd, codes, scales, table[decode], lens[decode], sinks]
        prefill_params = [len(rows), heads, kv_heads, d, bs, width, window, d**-0.5]
        prefill_arrays = [q, codes, scales, starts, q_lens, lens, table, sinks]
        for command in (arm, x86):
            out = call(command, f"paged_decode_{type_name}", decode_params, decode_arrays)
            got = torch.frombuffer(bytearray(out), dtype=dtype).view_as(qd).float()
            assert not got.isnan().any(), "read a slot it must not"
            torch.testing.assert_close(got, ref[starts[decode].long()], atol=atol, rtol=0)
            out = call(command, f"paged_prefill_{type_name}", prefill_params, prefill_arrays)
            got = torch.frombuffer(bytearray(out), dtype=dtype).view_as(q).float()
            assert not got.isnan().any(), "read a slot it must not"
            torch.testing.assert_close(got, ref, atol=atol, rtol=0)


needs_clang = pytest.mark.skipif(shutil.which("clang++") is None, reason="clang++ not installed")


@pytest.mark.slow
@needs_cross
@needs_clang
def test_clang_aarch64_build_takes_the_integer_paths(
    tmp_path: Path, x86: list[str], march: str
) -> None:
    """The kernels built by clang for aarch64 (as on an Arm Mac or a Graviton; without OpenMP:
    one thread) with dotprod, and with i8mm too: the path each target names, and the quantized
    matmuls (int8 and int4 layouts, a few) within the host's bounds. (Clang 14 does not imply
    dotprod from armv8.6-a: the targets name it.)"""
    if march == "armv8-a":
        pytest.skip("the integer paths' targets")
    target = march if "dotprod" in march else march.replace("+i8mm", "+dotprod+i8mm")
    out = tmp_path / "harness"
    command = ["clang++", "--target=aarch64-linux-gnu", f"-march={target}", "-static"]
    flags = [f for f in native.flags("none") if f not in ("-shared", "-fPIC")]
    _build(out, [*command, *[f for f in flags if not f.startswith("-march")]])
    clang = [QEMU, "-cpu", "max", str(out)]
    assert arm_path(clang) == ARM_TARGETS[march]
    check_quantized_matmul(clang, x86, [c for c in CASES[::3] if c[0] != 6])


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
    env["FOUDRE_KERNEL_OPT"] = "-O1"  # (the results are checked, not the speed)
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
