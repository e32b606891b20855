"""C++ kernels for the CPU, compiled on first use and loaded with ``ctypes``.

A kernel source ships inside the package and is compiled by the system's C++ compiler (``$CXX``,
else ``g++``, ``c++`` or ``clang++``; a few seconds) with ``-O3 -march=native -fopenmp`` into
``$FOUDRE_CACHE`` (default ``~/.cache/foudre``)``/kernels``, under a name keyed by the source
(and the headers beside it that it includes), the compiler, the flags and the CPU's feature
flags, so an edit or another machine rebuilds it.
No PyTorch headers or build tools beyond the compiler are needed. The libraries' OpenMP calls
resolve to the libgomp that torch already loaded, so kernels and torch share one thread pool.
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


def flags() -> list[str]:
    return [*FLAGS, "-std=c++17", f"-march={os.environ.get('FOUDRE_KERNEL_MARCH', 'native')}"]


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
    text = source.read_bytes() + b"".join(_headers(source))
    key = hashlib.sha256(
        text + " ".join([cxx, *flags(), platform.machine(), cpu_flags()]).encode()
    ).hexdigest()[:16]
    cache = Path(os.environ.get("FOUDRE_CACHE", Path.home() / ".cache" / "foudre")) / "kernels"
    lib = cache / f"{source.stem}-{key}.so"
    if not lib.is_file():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:
                built = Path(tmp) / lib.name
                subprocess.run(
                    [cxx, *flags(), str(source), "-o", str(built)],
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
    try:
        return ctypes.CDLL(str(lib))
    except OSError as e:
        log.warning("loading %s failed: %s", lib, e)
        return None
