"""Every native kernel source builds where a C++ compiler exists: the kernels' tests skip where
a library is missing (no compiler), so a source that stopped compiling would otherwise only
show as skipped tests. Its AVX-512 code (VNNI, BF16) and its AVX2 code are also compiled for
such a target, syntax and types only, whatever this CPU has: the library built here holds only
the paths of this CPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from foudre.attention import cpu_paged
from foudre.layers import fused
from foudre.native import build as native
from foudre.quant import cpu_qmatmul, mxfp4

SOURCES = [
    fused.SOURCE,
    cpu_paged.SOURCE,
    cpu_paged.PREFILL_SOURCE,
    cpu_qmatmul.SOURCE,
    mxfp4.SOURCE,
]
needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")


@needs_compiler
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_source_builds(source: Path) -> None:
    assert native.load(source) is not None, f"{source.name} did not build: see the log"


@needs_compiler
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
@pytest.mark.parametrize("march", ["sapphirerapids", "znver3"])
def test_avx512_and_avx2_code_compiles(source: Path, march: str) -> None:
    compiler = native.compiler()
    assert compiler is not None
    flags = [f for f in native.flags() if not f.startswith("-march=") and f != "-shared"]
    command = [compiler, *flags, f"-march={march}", "-fsyntax-only", str(source)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if out.returncode and march in out.stderr:
        pytest.skip(f"{compiler} does not know -march={march}")
    assert out.returncode == 0, out.stderr[-3000:]
