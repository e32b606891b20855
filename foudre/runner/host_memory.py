"""Host memory reuse: large CPU tensors without a page-fault storm on every step.

glibc's ``malloc`` serves each block over its mmap threshold (which adapts, up to 32 MiB) with a
fresh ``mmap`` and returns it to the kernel on ``free``. A CPU engine step allocates such blocks
every time (the gathered K/V of a decode batch, the MLP activations of a 2,048-token prefill
chunk), so every step touches brand-new pages, and the kernel faults in and zeroes each one: a
50 MB gather ran at 2.6 GB/s instead of 23 GB/s on the 2-core benchmark machine.

``keep_freed_host_memory`` tells ``malloc`` to serve every block from its heap and to keep freed
memory for reuse (``M_MMAP_MAX = 0``, an unbounded ``M_TRIM_THRESHOLD``): the process then holds
on to its peak footprint, as PyTorch's caching allocator does on a GPU. The engine calls it when
it runs on the CPU; ``FOUDRE_KEEP_HOST_MEMORY=0`` in the environment leaves ``malloc`` alone.
Where the C library is not glibc, it does nothing.

``freeze_startup_objects`` is the same kind of setting for Python's own heap: once per process,
as the first engine is built, the objects alive then (the imported modules' mostly: torch's
alone are over a hundred thousand) leave the cyclic collector's full passes (``gc.freeze``),
each of which walked them all while a busy engine's steps waited (at 256 running requests,
about one pass every hundred-odd steps, each as long as five steps). A frozen object is still
freed when its last reference goes, though not as part of a cycle (the first engine's own
object included: nothing in it may hold a cycle back to it); nearly all of them live as long as
the process. Parallel workers freeze theirs too, as every step waits for every rank.
``FOUDRE_GC_FREEZE=0`` leaves the collector alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_applied: bool | None = None


def keep_freed_host_memory() -> bool:
    """Apply the settings once per process; True when they are in force."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("FOUDRE_KEEP_HOST_MEMORY", "1") == "0" or not sys.platform.startswith(
        "linux"
    ):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (e.g. musl has no mallopt)
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; the trim threshold is an int: 2 GiB - 1 is "never trim"
    _applied = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _applied


_frozen = False


def freeze_startup_objects() -> None:
    """``gc.freeze`` the objects alive now, once per process (see above). No collection runs
    first: it took a tenth of a second of the first ``LLM()`` (the time to a first token) to
    find a few dozen unreachable objects, which stay frozen instead."""
    global _frozen
    if _frozen or os.environ.get("FOUDRE_GC_FREEZE", "1") == "0":
        return
    _frozen = True
    gc.freeze()
