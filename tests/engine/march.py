"""Checks of the native kernels' other code paths: a fresh interpreter whose kernels are built
for another ``-march`` (``FOUDRE_KERNEL_MARCH``) into a cache of that build's own runs a check
function. The ``march_cache`` fixture (tests/conftest.py) gives each ``-march`` one cache for the
whole session, so the checks of one build share its libraries (each takes 4-12 s to compile on
2 cores; a private cache per test compiled cpu_paged_prefill for haswell three times). A check
is skipped where this CPU's own build takes the same code paths as the other ``-march`` (an
AVX2 CPU and haswell): the tests of this build run them."""

from __future__ import annotations

import json
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


def _runnable(march: str) -> None:
    """Skip where this CPU cannot run ``march``'s code, or where its own build takes the same
    paths (the tests of this build run them)."""
    if os.uname().machine != "x86_64":
        pytest.skip("x86 -march values")
    if not MARCH_PATHS[march] <= cpu_paths():
        pytest.skip(f"this CPU cannot run {march}'s code")
    if MARCH_PATHS[march] == native_paths():
        pytest.skip(f"this CPU's own build takes {march}'s paths: its tests run them")


def _built(march: str, march_cache: Callable[[str], Path]) -> tuple[dict[str, str], str]:
    """The environment of a process whose kernels are built for ``march`` into that build's
    cache, and the prefix of the paths of the libraries built there."""
    cache = march_cache(march)
    env = dict(os.environ, FOUDRE_KERNEL_MARCH=march, FOUDRE_CACHE=str(cache))
    env["FOUDRE_KERNEL_OPT"] = "-O1"  # (results are checked there, not speed: a third the build)
    return env, f"{os.path.realpath(cache)}/kernels/"


def run_built_for(
    march: str, check: str | list[str], library: str, march_cache: Callable[[str], Path]
) -> None:
    """Call ``check`` (``"module:function"``, or several in turn in one process) with the kernels
    built for ``march`` in that build's cache (``march_cache(march)``, the fixture); assert that
    it passed and that its process loaded the ``library`` (a source's stem) built there. Skips
    where this CPU cannot run that code."""
    _runnable(march)
    env, kernels = _built(march, march_cache)
    # the check's process must have loaded the library of this build (from this cache), not
    # one it found elsewhere: a built library of that name in the cache would not show it
    built = f"{kernels}{library}-"
    run_check(
        check, env, f"assert {built!r} in open('/proc/self/maps').read(), 'not loaded: {library}'\n"
    )


def run_check(check: str | list[str], env: dict[str, str], after: str = "") -> None:
    """Call ``check`` (``"module:function"``, or several in turn) in a fresh interpreter with the
    environment ``env`` (then the lines ``after``); assert that it passed."""
    script = ""
    for one in [check] if isinstance(check, str) else check:
        module, function = one.split(":")
        script += f"from {module} import {function}\n{function}()\n"
    out = subprocess.run(
        [sys.executable, "-c", f"{script}{after}print('ok')\n"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


_MERGED = """
import importlib, json, sys, traceback
checks, library = json.loads(sys.argv[1]), sys.argv[2]
results = {}
for check in checks:
    module, function = check.split(":")
    try:
        getattr(importlib.import_module(module), function)()
        results[check] = ""
    except BaseException:
        results[check] = traceback.format_exc()[-3000:]
if library not in open("/proc/self/maps").read():  # this build's library, not one found elsewhere
    results = {check: error or "not loaded: " + library for check, error in results.items()}
print(json.dumps(results))
"""


class MarchChecks:
    """A module's checks with the kernels built for other ``-march`` values, one process per
    ``-march``: at the first test of a ``-march``, every check that this session's tests of the
    module run for it (a process's start and imports cost ~2 s each, once a build and not once a
    test), each caught on its own; each test then asserts its own check's result. ``tests``: a
    test function's name (parametrized by ``march`` alone) -> its check (``"module:function"``);
    ``library``: the source stem that the process must have loaded from the build's cache;
    ``names``: the names of the module's tests that this session runs (``selected``)."""

    def __init__(
        self,
        tests: dict[str, str],
        library: str,
        names: set[str],
        march_cache: Callable[[str], Path],
    ) -> None:
        self.tests, self.library, self.names, self.march_cache = tests, library, names, march_cache
        self.results: dict[str, dict[str, str]] = {}

    def run(self, test: str, march: str) -> None:
        _runnable(march)
        if march not in self.results:
            env, kernels = _built(march, self.march_cache)
            run = self.names | {f"{test}[{march}]"}
            checks = [c for t, c in self.tests.items() if f"{t}[{march}]" in run]
            out = subprocess.run(
                [sys.executable, "-c", _MERGED, json.dumps(checks), f"{kernels}{self.library}-"],
                env=env,
                cwd=ROOT,
                capture_output=True,
                text=True,
            )
            assert out.returncode == 0, out.stderr[-3000:]
            self.results[march] = json.loads(out.stdout.strip().splitlines()[-1])
        error = self.results[march][self.tests[test]]
        assert error == "", error
