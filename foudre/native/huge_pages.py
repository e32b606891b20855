"""Weights in 2 MiB pages: a CPU decode step streams every weight once, and with 4 KiB pages it
crosses a page (a TLB entry) every 4 KiB of them.

Linux backs memory with transparent huge pages where the process asks for them
(``madvise(MADV_HUGEPAGE)``: the kernel's default ``madvise`` mode) or everywhere (``always``);
PyTorch's CPU allocator asks only with ``THP_MEM_ALLOC_ENABLE=1`` in the environment before its
first allocation, which a library cannot arrange. ``place_in_huge_pages`` (called by ``ModelRunner``
on the CPU, before anything runs) moves a model's weights into one map aligned to 2 MiB, whose pages
are then moved into huge pages (where the kernel has them to give: otherwise they stay on 4 KiB
pages, as before). A float checkpoint's weights are loaded straight into such a map (``allocate``,
called by ``load_model``): no copy is made and then moved, and ``place_in_huge_pages`` leaves them
there. (Using a weight in place from the file's map, with no copy at all, would keep it in 4 KiB
pages of the page cache, and most weights are fused at load (q|k|v, gate|up) anyway: the map of a
file is only read from, one tensor at a time, its pages dropped once copied.)

A decode step with its weights in huge pages takes a few percent less time, on every
precision, and a plain read of a large buffer runs faster too (so the roofline's probe reads a
buffer of ``empty``: ``foudre.bench.roofline``); the figures are in ``docs/architecture.md``.

Weights are written into their maps in 4 KiB pages and moved into 2 MiB pages only after the
engine's first step (a server's: at its start), in a thread of their own (``promote_later``:
``madvise`` ``MADV_HUGEPAGE``, then ``MADV_COLLAPSE`` over what was written): on a virtual
machine whose free 2 MiB blocks the host has taken back, faulting a model's weights in as fresh
2 MiB pages cost 0.3-0.7 s per 250 MB at load, the time to a first token, where 4 KiB pages are
at hand warm. ``settle`` waits for that move (benchmarks call it before the steps they time).
``FOUDRE_HUGE_PAGES=eager`` advises the weights' maps before their first touch instead;
``FOUDRE_HUGE_PAGES=0`` switches huge pages off; elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import itertools
import logging
import math
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import cast

import torch

logger = logging.getLogger("foudre")

HUGE_PAGE = 2 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ALIGN = 64  # each storage's start in the buffer: torch's own alignment


@functools.cache
def _kernel_gives_them() -> bool:
    """Linux with transparent huge pages not ``never`` (the mode read once a process)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


def enabled() -> bool:
    """Whether buffers from ``empty`` are advised into huge pages: Linux with transparent huge
    pages not ``never``, and not switched off (``FOUDRE_HUGE_PAGES=0``)."""
    return os.environ.get("FOUDRE_HUGE_PAGES", "1") != "0" and _kernel_gives_them()


def _mapped(nbytes: int, later: bool = False) -> torch.Tensor | None:
    """``empty``'s map, or None where not ``enabled`` or the map is refused (no memory left to
    commit). ``later``: a weight map, written in full at load in 4 KiB pages (advised
    ``MADV_NOHUGEPAGE`` meanwhile: THP ``always`` would fault it in as 2 MiB pages too), then
    moved into 2 MiB pages by ``promote_later`` once its writer calls ``_ready`` (``seal``,
    ``place_in_huge_pages``); advised ``MADV_HUGEPAGE`` now instead with
    ``FOUDRE_HUGE_PAGES=eager`` or where the kernel has no ``MADV_COLLAPSE``."""
    if not enabled() or nbytes == 0:
        return None
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    try:
        region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, MemoryError):
        return None
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the map
    start = -raw.data_ptr() % HUGE_PAGE
    later = later and os.environ.get("FOUDRE_HUGE_PAGES") != "eager" and _collapse_works()
    with contextlib.suppress(OSError):  # refused: 4 KiB pages, as torch's
        region.madvise(mmap.MADV_NOHUGEPAGE if later else mmap.MADV_HUGEPAGE, start, span)
    if later:
        with _lock:
            for ptr in [p for p, (ref, _, _) in _written.items() if ref() is None]:
                del _written[ptr]  # (maps gone before they were ready: a failed load)
            _written[raw.data_ptr()] = (weakref.ref(region), raw.data_ptr() + start, span)
    return raw[start : start + nbytes]


# a weight map (``_mapped(later=True)``): the map, its first 2 MiB boundary's address, the
# span from there; by the map's address (its storage's), until written in full (``_ready``),
# then waiting for ``promote_later``; the thread moving them, while it runs
_Map = tuple[weakref.ref[mmap.mmap], int, int]
_written: dict[int, _Map] = {}
_pending: list[_Map] = []
_promoter: threading.Thread | None = None
_lock = threading.Lock()
_MADV_COLLAPSE = 25  # Linux 6.1: a range's pages into 2 MiB pages, now, in the caller


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return libc


@functools.cache
def _collapse_works() -> bool:
    """Whether this kernel has ``MADV_COLLAPSE`` (Linux 6.1; tried once a process on a page of
    a map of its own): without it a map advised after it was written waits for ``khugepaged``
    (16 MiB every 10 s by default), so weights are advised before their first touch there."""
    probe = mmap.mmap(-1, 2 * HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        address = ctypes.addressof(ctypes.c_char.from_buffer(probe))
        start = -address % HUGE_PAGE
        probe[start] = 1
        if _libc().madvise(address + start, HUGE_PAGE, _MADV_COLLAPSE) == 0:
            return True
        return ctypes.get_errno() != errno.EINVAL  # (out of 2 MiB pages now: it has it)
    finally:
        probe.close()


def _ready(storage_address: int) -> None:
    """The weight map at ``storage_address`` is written in full: ``promote_later`` may move it
    (not before: a map moved while it is still being written would take the rest of its pages
    as 2 MiB pages, the cost this defers)."""
    with _lock:
        entry = _written.pop(storage_address, None)
        if entry is not None:
            _pending.append(entry)


def _reset_after_fork() -> None:
    """A forked child moves nothing (its pages are shared with its parent's until written:
    collapsing them would copy them) and starts with no thread."""
    global _lock, _promoter, _written, _pending
    _lock, _promoter, _written, _pending = threading.Lock(), None, {}, []


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)


def promote_later() -> None:
    """Move the weight maps written in full since the last call into 2 MiB pages, in a thread
    of its own at the lowest priority (started here where any wait and none runs; the engine
    calls this after each step, so that its first token does not wait for it): each map is
    advised ``MADV_HUGEPAGE`` and its 2 MiB ranges of which a page is resident (written, or
    read) are collapsed into 2 MiB pages (a range never touched, such as a tied head's room,
    stays unbacked; the untouched rest of a range touched is filled, as a fault of a 2 MiB page
    fills it). The values are the same throughout; a step reading a range while it moves waits
    for that range. Never raises: where no thread can be started, the maps are only advised
    (``khugepaged`` moves them over time)."""
    global _promoter
    with _lock:
        if not _pending or (_promoter is not None and _promoter.is_alive()):
            return
        thread = threading.Thread(target=_promote, name="foudre-huge-pages", daemon=True)
        try:
            thread.start()
        except RuntimeError as e:  # (no thread to be had: a process limit, shutdown)
            logger.warning("weights left to khugepaged: no thread to move them (%s)", e)
            for ref, address, span in _pending:
                region = ref()
                if region is not None:
                    _libc().madvise(address, span, mmap.MADV_HUGEPAGE)
            _pending.clear()
            return
        _promoter = thread


def settle() -> None:
    """``promote_later``, then wait until every weight map of this process waiting for it is in
    2 MiB pages (what a benchmark calls before the steps it times; a parallel worker moves its
    own after its first step, unwaited)."""
    promote_later()
    thread = _promoter
    if thread is not None:
        thread.join()


def _promote() -> None:
    global _promoter
    # the lowest priority (Linux: this thread alone): the engine's threads go first, the move
    # runs in their gaps (figures: docs/performance.md)
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    moved, t0 = 0, time.perf_counter()
    while True:
        with _lock:
            if not _pending:
                _promoter = None
                break
            ref, address, span = _pending.pop(0)
        region = ref()  # held while its pages move: not unmapped meanwhile
        if region is not None:
            moved += _collapse(address, span)
        del region
    logger.debug(
        "weights in 2 MiB pages: %.0f MB in %.2f s", moved / 2**20, time.perf_counter() - t0
    )


def _collapse(address: int, span: int) -> int:
    """Advise ``span`` bytes from ``address`` (2 MiB-aligned) ``MADV_HUGEPAGE`` and collapse each
    run of 2 MiB ranges of which a page is resident (``mincore``) into 2 MiB pages (one call a
    run: the kernel locks one range at a time); returns the bytes collapsed."""
    libc = _libc()
    if libc.madvise(address, span, mmap.MADV_HUGEPAGE):
        return 0
    pages = span // mmap.PAGESIZE
    resident = (ctypes.c_ubyte * pages)()
    if libc.mincore(address, span, resident):
        return 0
    per = HUGE_PAGE // mmap.PAGESIZE
    flags = bytes(resident)
    touched = [flags.count(0, i, i + per) < per for i in range(0, pages, per)]
    moved = 0
    for first, group in itertools.groupby(range(len(touched)), key=touched.__getitem__):
        if first:
            ranges = list(group)
            start, end = ranges[0] * HUGE_PAGE, (ranges[-1] + 1) * HUGE_PAGE
            if libc.madvise(address + start, end - start, _MADV_COLLAPSE) == 0:
                moved += end - start
    return moved


def empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` starting on a 2 MiB boundary of fresh memory (an
    anonymous map of its own: memory from the allocator's heap may have been touched already, in
    4 KiB pages), advised ``MADV_HUGEPAGE`` before anything touches it, where ``enabled``; else
    (or where the map is refused) ``torch.empty``. The map is unmapped when the last tensor on
    it goes."""
    mapped = _mapped(nbytes)
    return torch.empty(nbytes, dtype=torch.uint8) if mapped is None else mapped


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor, in 2 MiB pages of a fresh map where ``enabled``, else
    ``torch.zeros``. The map reads as zeros until written and its pages are faulted in as they
    are first written, not now: where the kernel has to compact memory to find 2 MiB pages,
    faulting a 2 GiB pool in took seconds (a server's start), against a fraction of that spread
    over the steps that first reach each page. (A page read before it is ever written maps the
    kernel's shared zero page, and the write after it may take 4 KiB pages there: the engine
    reads a block's K/V only after writing them. ``warn_if_short`` tells where such pools
    exceed the memory available.)"""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    mapped = _mapped(nbytes)
    if mapped is None:
        return torch.zeros(shape, dtype=dtype)
    return mapped.view(dtype).view(shape)


def warn_if_short(nbytes: int, what: str) -> bool:
    """Log a warning (and return True) where ``nbytes`` of ``zeros`` pools exceed the memory
    Linux reports available now (``MemAvailable``): their pages fault in as they are first
    written, so the process would run out of memory as they fill rather than at start."""
    try:
        text = Path("/proc/meminfo").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    available = int(fields.get("MemAvailable", "0 kB").split()[0]) * 1024
    if not available or nbytes <= available:
        return False
    logger.warning(
        "%s: %.2f GiB, more than the %.2f GiB of memory available: its pages are taken as they "
        "are first written, so the process may run out of memory once it fills; give a smaller "
        "kv_cache_memory or num_kv_blocks",
        what,
        nbytes / 2**30,
        available / 2**30,
    )
    return True


# how many tensors hold a storage, and its storage object if it has one (None where this torch
# has no such function: nothing is moved)
_USE_COUNT: Callable[[int], int] | None = getattr(torch._C, "_storage_Use_Count", None)


def _holds(t: torch.Tensor, use_count: Callable[[int], int]) -> tuple[int, int]:
    """(tensors holding ``t``'s storage, plus its storage object if it has one; references to
    that storage object), taken the same way for every tensor."""
    storage = t.untyped_storage()
    return use_count(storage._cdata), sys.getrefcount(storage)


def place_in_huge_pages(module: torch.nn.Module) -> int:
    """Move the storages of ``module``'s CPU parameters and buffers into one new map (2 MiB pages
    once ``promote_later`` ran), each tensor repointed there (``Tensor.set_``): the same tensor
    objects, values, shapes and strides, so whatever holds them (the modules, kernels' layouts
    built of them) reads the new copy; the old storage is freed as it is left (and the C
    allocator asked to give back what it kept: ``malloc_trim``). A storage that anything else
    holds too (a view of it kept elsewhere, its storage object) stays where it is: moving it
    would leave that holder on the old copy and both in memory; inference tensors too outside
    inference mode (``set_`` refuses them). What holds only a raw address is not seen (a NumPy
    array of ``.numpy()``, a DLPack capsule): call it on a module nothing has run yet, as
    ``ModelRunner`` does.

    The moved tensors then share one storage: one replaced later (a linear quantized in place)
    frees nothing until every tensor on it is gone; calling this again moves what is left into a
    new map and frees the old one. A map that still holds just what was placed in it (here, or
    by ``allocate`` and ``seal`` at load) stays where it is, and only the rest moves (nothing
    where there is no rest). Returns the bytes moved (0 where not ``enabled``, or where the
    map is refused: everything stays where it was)."""
    use_count = _USE_COUNT
    if not enabled() or use_count is None:
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.device.type != "cpu" or id(t) in seen:
            continue
        seen.add(id(t))
        by_storage.setdefault(t.untyped_storage()._cdata, []).append(t)
    # a storage's holders are only its tensors here: no other tensor on it (a view kept
    # elsewhere), nor a reference to its storage object beyond those of one nobody holds
    _, refs = _holds(torch.empty(1), use_count)
    inference = torch.is_inference_mode_enabled()
    sized = [(tensors, tensors[0].untyped_storage().nbytes()) for tensors in by_storage.values()]
    movable = [
        (tensors, nbytes)
        for tensors, nbytes in sized
        if nbytes
        and _holds(tensors[0], use_count) == (len(tensors) + 1, refs)
        and (inference or not any(t.is_inference() for t in tensors))
    ]
    # a map placed already (here or by ``allocate``) that still holds just what it was given
    # stays; the rest moves into a new one
    movable = [
        (tensors, nbytes)
        for tensors, nbytes in movable
        if _placed.get(tensors[0].untyped_storage().data_ptr()) != _extent(tensors)
    ]
    if not movable:
        return 0
    total = sum(-(-n // _ALIGN) * _ALIGN for _, n in movable)
    arena = _mapped(total, later=True)
    if arena is None:
        return 0
    target, base = arena.untyped_storage(), arena.storage_offset()  # bytes: uint8
    pos = 0
    with torch.no_grad():
        for i, (tensors, nbytes) in enumerate(movable):
            if i:  # the last old copy given back before the next is made: a peak of one copy
                _trim()
            source = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
            arena[pos : pos + nbytes].copy_(source)
            del source
            for t in tensors:  # base + pos is a multiple of 64: of every element size
                size = t.element_size()
                t.set_(target, (base + pos) // size + t.storage_offset(), t.size(), t.stride())
            pos += -(-nbytes // _ALIGN) * _ALIGN
    _trim()
    _placed[target.data_ptr()] = _extent([t for tensors, _ in movable for t in tensors])
    _ready(target.data_ptr())
    return total


def to_empty(module: torch.nn.Module, device: torch.device | str = "cpu") -> torch.nn.Module:
    """``module.to_empty(device=device)``: uninitialised memory for every parameter and buffer,
    shapes and strides kept, made by ``torch.empty_strided`` rather than ``torch.empty_like`` of
    the meta tensors, whose Python implementation imports sympy (about 0.9 s of a process's
    first load). Returns ``module``."""
    return module._apply(
        lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device)
    )


def allocate(module: torch.nn.Module, skip: tuple[type, ...] = ()) -> bool:
    """``module.to_empty(device="cpu")`` for a ``module`` built on ``meta``, every parameter and
    buffer a view of one map (nothing touched yet; 2 MiB pages once ``promote_later`` ran): its
    weights are then loaded straight into the pages they run from, and ``place_in_huge_pages``
    leaves them there (``seal``) instead of copying each into a new map. What is never written
    (a tied head's own tensor, tables replaced later, a linear replaced by a quantized one before
    it is loaded) is never resident (promoted too, but for the 2 MiB ranges it shares with what
    is written). Submodules of the types in ``skip`` (whose tensors are replaced once loaded: a
    layout built of them) get memory of their own (``to_empty``). Returns False, allocating
    nothing, where not ``enabled`` or the map is refused (call ``to_empty`` then)."""
    skipped = [m for m in module.modules() if isinstance(m, skip)]
    inside = {id(d) for m in skipped for d in m.modules()}
    tensors = [
        (m, name, t, is_param)
        for m in module.modules()
        if id(m) not in inside
        for is_param, table in ((True, m._parameters), (False, m._buffers))
        for name, t in table.items()
        if t is not None
    ]
    if not enabled() or any(not t.is_meta for _, _, t, _ in tensors):
        return False
    first: dict[int, int] = {}  # a tensor met twice (tied) gets one place
    total = 0
    for _, _, t, _ in tensors:
        if id(t) not in first:
            first[id(t)] = total
            span = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
            total += -(-max(1, span * t.element_size()) // _ALIGN) * _ALIGN
    arena = _mapped(total, later=True)
    if arena is None:
        return False
    outer = {id(d) for m in skipped for d in m.modules() if d is not m}
    for m in skipped:
        if id(m) not in outer:
            to_empty(m)
    target, base = arena.untyped_storage(), arena.storage_offset()
    _allocated.add(target.data_ptr())
    made: dict[int, torch.Tensor] = {}
    for m, name, t, is_param in tensors:
        new = made.get(id(t))
        if new is None:
            size = t.element_size()
            view = torch.empty(0, dtype=t.dtype).set_(
                target, (base + first[id(t)]) // size, t.size(), t.stride()
            )
            new = torch.nn.Parameter(view, t.requires_grad) if is_param else view
            made[id(t)] = new
        if is_param:
            m._parameters[name] = cast(torch.nn.Parameter, new)
        else:
            m._buffers[name] = new
    return True


def arena(nbytes: int) -> torch.Tensor | None:
    """A map (nothing touched yet; 2 MiB pages once ``promote_later`` ran) for weights that a
    loader builds in place itself (views of it, each made with ``Tensor.set_`` on its storage,
    written once): ``seal`` then marks it as it marks ``allocate``'s, so that
    ``place_in_huge_pages`` leaves it where it is. None where not ``enabled`` or the map is
    refused."""
    mapped = _mapped(nbytes, later=True)
    if mapped is not None:
        _allocated.add(mapped.untyped_storage().data_ptr())
    return mapped


def seal(module: torch.nn.Module) -> None:
    """Mark each map of ``allocate`` as holding what ``module``'s tensors on it are now (once
    loaded: a tied head's tensor gone, tables replaced), so that ``place_in_huge_pages`` leaves
    it where it is while that stays so. Call it once the module is loaded."""
    on: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.device.type == "cpu" and id(t) not in seen:
            seen.add(id(t))
            on.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    for ptr, tensors in on.items():
        if ptr in _allocated:
            _placed[ptr] = _extent(tensors)
            _ready(ptr)


# the maps ``allocate`` made, by address
_allocated: set[int] = set()


def _extent(tensors: list[torch.Tensor]) -> tuple[int, int]:
    return len(tensors), sum(t.nbytes for t in tensors)


# the maps placed, by address: how many tensors moved there and their bytes (a map that still
# holds just those is left alone: placing again moves nothing, and what holds their addresses
# stays valid)
_placed: dict[int, tuple[int, int]] = {}


def _trim() -> None:
    """Ask glibc's allocator to return the freed memory it keeps (freed blocks from its heap
    stay resident otherwise); nothing elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)
