"""Checks of the native kernels' other code paths: a fresh interpreter whose kernels are built
for another ``-march`` (``FOUDRE_KERNEL_MARCH``) into a cache of that build's own runs a check
function. The ``march_cache`` fixture (tests/conftest.py) gives each ``-march`` one cache for the
whole session, so the checks of one build share its libraries (each takes 4-12 s to compile on
2 cores; a private cache per test compiled cpu_paged_prefill for haswell three times). A check
is skipped where this CPU's own build takes the same code paths as the other ``-march`` (an
AVX2 CPU and haswell): the tests of this build run them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from foudre.native import build as native

ROOT = Path(__file__).resolve().parents[2]

# the code paths that the kernels' sources choose between at compile time (their #if's), of
# each -march that the tests build for
MARCH_PATHS = {
    "x86-64": frozenset(),
    "haswell": frozenset({"avx2"}),
    "skylake-avx512": frozenset({"avx2", "avx512"}),
}


# the feature macros that the kernels' sources test in their #if's (what native_paths models;
# tests/quant/test_cpu_qmatmul.py checks that no source tests another)
MODELED_MACROS = frozenset(
    {"AVX2", "FMA", "F16C", "AVX512F", "AVX512BW", "AVX512VL", "AVX512VNNI", "AVX512BF16"}
    | {"AMX_TILE", "AMX_INT8"}
)


def native_paths() -> frozenset[str] | None:
    """``MARCH_PATHS``' names of the paths that this process's own build takes: this CPU's
    (``-march=native``), or those of the ``-march`` that ``FOUDRE_KERNEL_MARCH`` names (None
    where the tests do not know that one)."""
    own = os.environ.get("FOUDRE_KERNEL_MARCH", "native")
    return cpu_paths() if own == "native" else MARCH_PATHS.get(own)


def cpu_paths() -> frozenset[str]:
    """``MARCH_PATHS``' names of the paths that a build for this CPU takes (from its flags):
    also the code it can run."""
    flags = set(native.cpu_flags().split())
    avx512 = {"avx512f", "avx512bw", "avx512vl"} <= flags
    paths = {
        "avx2": {"avx2", "fma", "f16c"} <= flags,
        "avx512": avx512,
        "avx512bf16": avx512 and "avx512_bf16" in flags,
        "avx512vnni": avx512 and "avx512_vnni" in flags,
        # (the VNNI path beneath it: tests/quant/test_cpu_qmatmul.py runs it with FOUDRE_AMX=0)
        "amx": avx512 and {"avx512_vnni", "amx_tile", "amx_int8"} <= flags,
    }
    return frozenset(name for name, taken in paths.items() if taken)


def run_built_for(march: str, check: str, library: str, march_cache: Callable[[str], Path]) -> None:
    """Call ``check`` (``"module:function"``) with the kernels built for ``march`` in that
    build's cache (``march_cache(march)``, the fixture); assert that it passed and that its
    process loaded the ``library`` (a source's stem) built there. Skips where this CPU cannot run
    that code."""
    if os.uname().machine != "x86_64":
        pytest.skip("x86 -march values")
    if not MARCH_PATHS[march] <= cpu_paths():
        pytest.skip(f"this CPU cannot run {march}'s code")
    if MARCH_PATHS[march] == native_paths():
        pytest.skip(f"this CPU's own build takes {march}'s paths: its tests run them")
    cache = march_cache(march)
    env = dict(os.environ, FOUDRE_KERNEL_MARCH=march, FOUDRE_CACHE=str(cache))
    # the check's process must have loaded the library of this build (from this cache), not
    # one it found elsewhere: a built library of that name in the cache would not show it
    built = f"{os.path.realpath(cache)}/kernels/{library}-"
    run_check(
        check, env, f"assert {built!r} in open('/proc/self/maps').read(), 'not loaded: {library}'\n"
    )


def run_check(check: str, env: dict[str, str], after: str = "") -> None:
    """Call ``check`` (``"module:function"``) in a fresh interpreter with the environment
    ``env`` (then the lines ``after``); assert that it passed."""
    module, function = check.split(":")
    script = f"from {module} import {function}\n{function}()\n{after}print('ok')\n"
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
