"""C++ kernels for the CPU, compiled on first use and loaded with ``ctypes``.

A kernel source ships inside the package and is compiled by the system's C++ compiler (``$CXX``,
else ``g++``, ``c++`` or ``clang++``; a few seconds) with ``-O3 -march=native -fopenmp`` into
``$FOUDRE_CACHE`` (default ``~/.cache/foudre``)``/kernels``, under a name keyed by the source
(and the headers beside it that it includes), the compiler, the flags and the CPU's feature
flags, so an edit or another machine rebuilds it.
No PyTorch headers or build tools beyond the compiler are needed. The libraries' OpenMP calls
resolve to the libgomp that torch already loaded, so kernels and torch share one thread pool. A
clang without an OpenMP runtime (Apple's; clang without libomp) compiles the same pragmas
(``-Xclang -fopenmp``) against foudre's own runtime, ``omp/runtime.cpp``, a thread pool linked
into each library (``openmp_mode``: "runtime"); a compiler with neither builds the kernels
single-threaded, logged once.
``FOUDRE_KERNEL_MARCH`` builds for another ``-march`` (how the tests check the paths that this
machine would not take). Where nothing builds, ``load`` returns None and callers fall back to
torch.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = Path(__file__).parent  # every C++ source and header of the package

FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-ffp-contract=off", "-fPIC", "-shared"]


RUNTIME = SOURCES / "omp" / "runtime.cpp"  # foudre's OpenMP runtime (see omp/omp.h)


def flags(openmp: str = "native") -> list[str]:
    """The kernels' compiler flags, OpenMP as ``openmp`` says (``openmp_mode``)."""
    base = [f for f in FLAGS if f != "-fopenmp"]
    if openmp == "native":
        base = FLAGS
    elif openmp == "runtime":
        base = [*base, "-Xclang", "-fopenmp", f"-I{RUNTIME.parent}"]
    # the optimisation level: -O3, or what FOUDRE_KERNEL_OPT says (tests that check results,
    # not speed, build at -O1 in a third of the time)
    base = [os.environ.get("FOUDRE_KERNEL_OPT", f) if f == "-O3" else f for f in base]
    return [*base, "-std=c++17", f"-march={os.environ.get('FOUDRE_KERNEL_MARCH', 'native')}"]


def cpu_flags() -> str:
    """The CPU's feature flags (``/proc/cpuinfo``), else its name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def compiler() -> str | None:
    """The C++ compiler the kernels build with (``$CXX``, else the first on the PATH), or None."""
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


_PROBE = """#include <omp.h>
extern "C" int probe() {
  int seen[64] = {0};
#pragma omp parallel for schedule(dynamic, 1)
  for (int i = 0; i < 64; ++i) seen[i] = omp_get_num_threads();
  int n = 0;
  for (int i = 0; i < 64; ++i) n += seen[i] > 0;
  return n == 64 ? omp_get_max_threads() : -1;
}
"""


@cache
def openmp_mode(cxx: str) -> str:
    """How ``cxx`` builds the kernels' OpenMP loops: "native" (its own runtime: ``-fopenmp``),
    "runtime" (clang's code generation against foudre's runtime, ``omp/runtime.cpp``, where
    it has none of its own), or "none" (one thread). A mode counts where its probe links with
    every symbol defined and then runs a parallel loop."""
    strict = ["-Wl,-z,defs"] if platform.system() == "Linux" else []  # (macOS: the default)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text(_PROBE)
        for mode, extra in (("native", []), ("runtime", [str(RUNTIME)])):
            lib = Path(tmp) / f"probe-{mode}.so"
            command = [cxx, *flags(mode), *strict, str(src), *extra, "-o", str(lib)]
            try:
                built = subprocess.run(command, capture_output=True, timeout=300).returncode == 0
                if built and ctypes.CDLL(str(lib)).probe() > 0:
                    if mode == "runtime":
                        log.info("%s has no OpenMP runtime: the kernels use foudre's", cxx)
                    return mode
            except (OSError, subprocess.SubprocessError):
                pass
    log.warning("%s has no OpenMP: the kernels are built without it (one thread)", cxx)
    return "none"


def has_openmp(cxx: str) -> bool:
    """Whether ``cxx`` has an OpenMP runtime of its own."""
    return openmp_mode(cxx) == "native"


def _headers(source: Path) -> list[bytes]:
    """The headers beside ``source`` that it includes (``#include "name"``): part of what the
    library is built from, so part of its cache key."""
    names = re.findall(rb'^\s*#include\s+"([^"]+)"', source.read_bytes(), re.M)
    paths = [source.parent / name.decode() for name in names]
    return [path.read_bytes() for path in paths if path.is_file()]


@cache
def load(source: Path) -> ctypes.CDLL | None:
    """The library built from ``source`` (compiled on first use, then cached on disk), or None
    with the reason logged when it cannot be built or loaded."""
    cxx = compiler()
    if cxx is None:
        log.info("no C++ compiler found: %s is not built, torch ops are used instead", source.name)
        return None
    mode = openmp_mode(cxx)
    extra = [RUNTIME] if mode == "runtime" else []
    text = b"".join([source.read_bytes(), *_headers(source), *(p.read_bytes() for p in extra)])
    lib = _built(source, cxx, flags(mode), text, extra)
    if lib is None:
        return None
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError as e:
        log.warning("loading %s failed: %s", lib, e)
        return None
    if mode == "runtime":  # its pool runs as many threads as torch's
        import torch

        dll.foudre_omp_set_num_threads(ctypes.c_int(torch.get_num_threads()))
    return dll


def _built(
    source: Path, cxx: str, build_flags: list[str], text: bytes, extra: list[Path]
) -> Path | None:
    """The library compiled from ``source`` and the ``extra`` sources (``text``: all of them
    and the headers) with ``build_flags``, from the cache or built now; None with the
    compiler's complaint logged where it fails."""
    key = hashlib.sha256(
        text + " ".join([cxx, *build_flags, platform.machine(), cpu_flags()]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("FOUDRE_CACHE", Path.home() / ".cache" / "foudre")) / "kernels"
    lib = cache / f"{source.stem}-{key}.so"
    if lib.is_file():
        return lib
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            built = Path(tmp) / lib.name
            subprocess.run(
                [cxx, *build_flags, str(source), *map(str, extra), "-o", str(built)],
                check=True,
                capture_output=True,
                text=True,
                timeout=300,
            )
            built.replace(lib)  # atomic: a concurrent build never loads a partial file
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        log.warning("building %s failed: %s", source.name, detail.strip())
        return None
    return lib
