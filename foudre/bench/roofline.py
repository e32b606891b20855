"""The memory roofline of decoding: bytes of weights one step reads, and the machine's bandwidth.

A decode step reads every weight once (the input embedding table is only gathered, a few rows),
so a step cannot take less than ``weight_bytes(model) / measure_bandwidth()`` seconds.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch

from foudre.layers import fused
from foudre.layers.moe import SparseMoeBlock
from foudre.native import huge_pages

_WEIGHT_BUFFER_MARKS = ("weight", "scale", "zero")


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads.

    Counts every parameter once (a tied ``lm_head`` shares the embedding tensor and is counted
    once), except input embedding tables that no other module uses: a step gathers a few of their
    rows rather than reading them. Buffers whose name marks them as weights or their scales (the
    packed tensors of quantized layers) are counted too. The routed experts of a
    mixture-of-experts layer count for ``top_k / num_experts`` of their bytes: what one token
    reads (its active parameters), the bytes of a batch-1 decode step.
    """
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    used_elsewhere = {
        id(p)
        for m in model.modules()
        if not isinstance(m, torch.nn.Embedding)
        for p in m.parameters(recurse=False)
    }
    total = 0
    for p in model.parameters():  # deduplicated: a tied tensor appears once
        if id(p) in embeddings and id(p) not in used_elsewhere:
            continue
        total += p.numel() * p.element_size()
    total += _buffer_bytes(model)
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            experts = block.experts
            routed = _buffer_bytes(experts) + sum(
                p.numel() * p.element_size() for p in experts.parameters()
            )
            total -= routed - routed * block.top_k // block.num_experts
    return total


def _buffer_bytes(module: torch.nn.Module) -> int:
    """Bytes of the buffers whose names mark them as weights or their scales."""
    total = 0
    for name, b in module.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        if any(mark in leaf for mark in _WEIGHT_BUFFER_MARKS):
            total += b.numel() * b.element_size()
    return total


def last_level_cache_bytes() -> int:
    """The size of the CPU's largest cache level (Linux's sysfs: cpu0's caches), 0 where it
    cannot be read."""
    best_level, size = 0, 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            level = int((index / "level").read_text())
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        digits = text.rstrip("KMG")
        if level > best_level and digits.isdigit():
            best_level, size = level, int(digits) * units.get(text[len(digits) :], 1)
    return size


# The probe reads at least this many times the last-level cache: read again and again, a
# matrix not much larger than that cache is partly read from it. On an Intel Xeon whose L3 is
# 480 MiB (2 cores of it lent), the fastest of the three reads over 256 / 512 / 1024 / 2048 MiB:
# 41.7 / 36.2 / 34.6 / 33.3 GB/s (our kernel's 41.7 / 35.0 / 32.6 / 31.0); later, over 512 /
# 1024 / 2048 / 4096 MiB, 35.0 / 34.3 / 34.0 / 33.7 (the kernel's 35.0 / 32.1 / 31.0 / 31.3):
# from four times the cache the figures no longer fall.
CACHE_MULTIPLE = 4
PROBE_MIB = 512  # the least (and the GPU's: 512 MiB is several times any GPU's L2)


def probe_mib(device: torch.device | str | None = None) -> int:
    """The MiB ``measure_bandwidth`` reads by default: ``PROBE_MIB``, or on the CPU
    ``CACHE_MULTIPLE`` times its last-level cache where that is more."""
    if torch.device(device or "cpu").type != "cpu":
        return PROBE_MIB
    return max(PROBE_MIB, -(-CACHE_MULTIPLE * last_level_cache_bytes() // (1 << 20)))


def _matvec_samplers(mib: int, dev: torch.device) -> list[Callable[[], float]]:
    """One function per way of reading one ``mib`` MiB fp32 matrix on ``dev``: each reads it
    once and returns the bytes/s. A plain read (``torch.sum``: no product, what any kernel's
    stream at best reaches) first, then the matrix-vector products: ``torch.mv``, then foudre's
    kernel (``fused.linear``) on a CPU where it builds (the last). (The matrix holds one value
    but for one element a 4 KiB page, each page's own, so that no two pages are alike for a
    kernel to merge: what it holds changes no read's speed, and filling gigabytes with random
    numbers took seconds a probe.)"""
    cols = 4096
    rows = max(1, mib * (1 << 20) // (4 * cols))
    if dev.type == "cpu":  # in 2 MiB pages where the OS gives them, as the engine's weights
        w = huge_pages.empty(rows * cols * 4).view(torch.float32).view(rows, cols).fill_(0.5)
    else:
        w = torch.full((rows, cols), 0.5, device=dev)
    flat = w.view(-1)
    flat[::1024] = torch.arange(flat[::1024].numel(), device=dev, dtype=torch.float32)
    x = torch.randn(cols, device=dev)
    products: list[Callable[[], object]] = [lambda: w.sum(), lambda: torch.mv(w, x)]
    if dev.type == "cpu" and fused.enabled(w):
        x2 = x[None]
        products.append(lambda: fused.linear(x2, w))

    def sampler(product: Callable[[], object]) -> Callable[[], float]:
        def sample() -> float:
            t = time.perf_counter()
            product()
            _sync(dev)
            return w.numel() * 4 / (time.perf_counter() - t)

        return sample

    return [sampler(p) for p in products]


def measure_bandwidth(
    mib: int | None = None, repeats: int = 8, device: torch.device | str | None = None
) -> float:
    """Bytes/s of reading an fp32 matrix of ``mib`` MiB (by default ``probe_mib``: several
    times the last-level cache, the CPU's L3 or the GPU's L2, so that it is read from memory):
    the best of ``repeats`` timed runs after one warm-up, on
    ``device`` (the CPU by default), of a plain read (``torch.sum``), ``torch.mv`` and, on a CPU
    where it builds, foudre's decode kernel (``fused.linear``), the fastest counting: a roofline
    below what any of them reaches would flatter every fraction measured against it (the kernel
    reads at up to twice ``torch.mv``'s speed here; a plain read at times 1.1-1.2x the
    kernel's, and as fast as our int8 one)."""
    best = 0.0
    dev = torch.device(device or "cpu")
    for sample in _matvec_samplers(mib or probe_mib(dev), dev):
        sample()  # warm-up
        best = max([best, *(sample() for _ in range(repeats))])
    return best


def matvec_probe(mib: int | None = None) -> Callable[[], float]:
    """A function that runs one fp32 matrix-vector product over ``mib`` MiB (``probe_mib``) on
    the CPU (foudre's kernel where it builds, else ``torch.mv``) and returns its bytes/s: one
    sample of the bandwidth, to pair with a decode step measured right beside it on a host whose
    bandwidth drifts (``benchmarks/core_throughput.py``)."""
    sample = _matvec_samplers(mib or probe_mib(), torch.device("cpu"))[-1]  # (the kernel's)
    sample()  # warm-up
    return sample


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def machine(device: torch.device | str | None = None) -> str:
    """One line naming the CPU, core count, torch version and torch's thread count, and the GPU
    when ``device`` is a CUDA device."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    threads = torch.get_num_threads()
    line = f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {threads} threads"
    dev = torch.device(device or "cpu")
    if dev.type == "cuda":
        props = torch.cuda.get_device_properties(dev)
        gib = props.total_memory / 2**30
        line = f"{props.name} ({gib:.0f} GiB), CUDA {torch.version.cuda}; {line}"
    return line
