"""Weights in 2 MiB pages: a CPU decode step streams every weight once, and with 4 KiB pages it
crosses a page (a TLB entry) every 4 KiB of them.

Linux backs memory with transparent huge pages where the process asks for them
(``madvise(MADV_HUGEPAGE)``: the kernel's default ``madvise`` mode) or everywhere (``always``);
PyTorch's CPU allocator asks only with ``THP_MEM_ALLOC_ENABLE=1`` in the environment before its
first allocation, which a library cannot arrange. ``place_in_huge_pages`` moves a model's weights
into one buffer aligned to 2 MiB and advised before its first touch, so that every page of it is
faulted in as a huge page (where the kernel has them to give: otherwise it stays on 4 KiB pages,
as before).

Measured on the 2-core EPYC (Zen 4) of the benchmarks, one process holding two copies of the
494.7M Llama and stepping them in turns: the decode step took 0.96-0.98x the time with the
weights in huge pages (int4), 0.95x (int8), 0.97x (bf16); a plain read of 512 MiB ran 1.07x as
fast (so the roofline's probe reads a buffer of ``empty`` too: ``foudre.bench.roofline``).

Switched off with ``FOUDRE_HUGE_PAGES=0``; elsewhere than Linux it does nothing.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
from collections.abc import Callable
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")
_ALIGN = 64  # each storage's start in the buffer: torch's own alignment


def enabled() -> bool:
    """Whether buffers from ``empty`` are advised into huge pages: Linux with transparent huge
    pages not ``never``, and not switched off (``FOUDRE_HUGE_PAGES=0``)."""
    if os.environ.get("FOUDRE_HUGE_PAGES", "1") == "0" or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in _THP_MODE.read_text()
    except OSError:
        return False


def empty(nbytes: int) -> torch.Tensor:
    """A uint8 CPU tensor of ``nbytes`` starting on a 2 MiB boundary of fresh memory (an
    anonymous map of its own: memory from the allocator's heap may have been touched already, in
    4 KiB pages), advised ``MADV_HUGEPAGE`` before anything touches it, where ``enabled``; else
    ``torch.empty``. The map is unmapped when the last tensor on it goes."""
    if not enabled() or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8)
    span = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    region = mmap.mmap(-1, span + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # holds the map
    start = -raw.data_ptr() % HUGE_PAGE
    with contextlib.suppress(OSError):  # refused: 4 KiB pages, as torch's
        region.madvise(mmap.MADV_HUGEPAGE, start, span)
    return raw[start : start + nbytes]


def _holders() -> Callable[[int], int] | None:
    """``torch._C._storage_Use_Count`` (how many tensors and storage objects hold a storage),
    or None where this torch has no such function."""
    return getattr(torch._C, "_storage_Use_Count", None)


def place_in_huge_pages(module: torch.nn.Module) -> int:
    """Move the storages of ``module``'s CPU parameters and buffers into one buffer of ``empty``
    (2 MiB pages), each tensor repointed there (``Tensor.set_``): the same tensor objects, values,
    shapes and strides, so whatever holds them (the modules, kernels' layouts built of them)
    reads the new copy; the old storage is freed as it is left. A storage that anything else
    holds too (a view of it elsewhere, a storage object) stays where it is: moving it would leave
    that holder on the old copy and both in memory; inference tensors too outside inference
    mode (``set_`` refuses them). Returns the bytes moved (0 where not ``enabled``)."""
    use_count = _holders()
    if not enabled() or use_count is None:
        return 0
    by_storage: dict[int, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for t in itertools.chain(module.parameters(), module.buffers()):
        if t.device.type != "cpu" or id(t) in seen:
            continue
        seen.add(id(t))
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(t)
    inference = torch.is_inference_mode_enabled()
    movable: list[tuple[list[torch.Tensor], int]] = []
    for tensors in by_storage.values():
        storage = tensors[0].untyped_storage()
        alone = use_count(storage._cdata) == len(tensors) + 1  # these and ``storage``
        if storage.nbytes() and alone and (inference or not any(t.is_inference() for t in tensors)):
            movable.append((tensors, storage.nbytes()))
        del storage
    total = sum(-(-n // _ALIGN) * _ALIGN for _, n in movable)
    arena = empty(total)
    target, base = arena.untyped_storage(), arena.storage_offset()  # bytes: uint8
    pos = 0
    with torch.no_grad():
        for tensors, nbytes in movable:
            source = torch.empty(0, dtype=torch.uint8).set_(tensors[0].untyped_storage())
            arena[pos : pos + nbytes].copy_(source)
            del source
            for t in tensors:  # base + pos is a multiple of 64: of every element size
                size = t.element_size()
                t.set_(target, (base + pos) // size + t.storage_offset(), t.size(), t.stride())
            pos += -(-nbytes // _ALIGN) * _ALIGN
    return total
