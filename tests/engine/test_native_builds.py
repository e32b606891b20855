"""Every native kernel source builds where a C++ compiler exists: the kernels' tests skip where
a library is missing (no compiler), so a source that stopped compiling would otherwise only
show as skipped tests. Its AVX-512 code (VNNI, BF16) is also compiled for an AVX-512 target,
syntax and types only, whatever this CPU has: on a host without AVX-512 the library built here
holds only the portable paths."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from foudre.layers import fused, native
from foudre.quant import cpu_qmatmul
from foudre.runner.attention import cpu_paged

SOURCES = [fused.SOURCE, cpu_paged.SOURCE, cpu_paged.PREFILL_SOURCE, cpu_qmatmul.SOURCE]
needs_compiler = pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")


@needs_compiler
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_source_builds(source: Path) -> None:
    assert native.load(source) is not None, f"{source.name} did not build: see the log"


@needs_compiler
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_avx512_code_compiles(source: Path) -> None:
    compiler = native.compiler()
    assert compiler is not None
    flags = [f for f in native.flags() if not f.startswith("-march=") and f != "-shared"]
    command = [compiler, *flags, "-march=sapphirerapids", "-fsyntax-only", str(source)]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if out.returncode and "sapphirerapids" in out.stderr:
        pytest.skip(f"{compiler} does not know -march=sapphirerapids")
    assert out.returncode == 0, out.stderr[-3000:]
