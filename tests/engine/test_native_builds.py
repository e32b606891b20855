"""Every native kernel source builds where a C++ compiler exists: the kernels' tests skip where
a library is missing (no compiler), so a source that stopped compiling would otherwise only
show as skipped tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from foudre.layers import fused, native
from foudre.quant import cpu_qmatmul
from foudre.runner.attention import cpu_paged


@pytest.mark.skipif(native.compiler() is None, reason="no C++ compiler")
@pytest.mark.parametrize(
    "source",
    [fused.SOURCE, cpu_paged.SOURCE, cpu_paged.PREFILL_SOURCE, cpu_qmatmul.SOURCE],
    ids=lambda p: p.name,
)
def test_source_builds(source: Path) -> None:
    assert native.load(source) is not None, f"{source.name} did not build: see the log"
