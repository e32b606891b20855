"""The paged prefill kernels (C++ on the CPU, Triton) and sliding windows in every attention
backend, against SDPA with an explicit mask over the dense K/V.

Each case is one step of several rows: a prompt chunk of 1-512 tokens after a cached prefix of
0-3 blocks (plus a partial block), a decode row and a short chunk beside it, for GQA groups of
1-8, head dims 64/80/128/20, block sizes 8/16/32, and no window, a window shorter than the chunk
or one longer. The kernels run on a pool where every slot they must not read holds NaN: blocks
of no row, the tails past each row's length and, with a window, the blocks wholly before the
first key a row's queries see. The CPU kernels' paths are each checked (the others in
subprocesses built for another ``-march``: portable, AVX2, AVX-512 without AVX512-BF16); the
Triton kernels run in Triton's interpreter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from foudre import LLM, SamplingParams
from foudre.attention import AttentionBackend, BatchLayout, cpu_paged
from foudre.attention.kv_quant import STORAGE_DTYPES, dequantize_kv
from foudre.attention.quantized_cache import QuantizedKVCache
from foudre.attention.torch_sdpa import TorchSDPABackend
from foudre.models.config import ModelConfig
from tests.conftest import make_hf_model
from tests.engine.march import MarchChecks
from tests.triton_check import (
    Checks,
    run_triton_check,
    selected,
    start_triton_checks,
    wait_triton_check,
)

CHUNKS = [1, 2, 5, 16, 31, 32, 33, 100, 255, 512]


def cases(every: int = 1) -> list[tuple[int, int, int, int, list[tuple[int, int]], int | None]]:
    """(heads, kv heads, head_dim, block size, rows as (new tokens, context), window)."""
    out = []
    n = 0
    for i, chunk in enumerate(CHUNKS):
        for blocks in range(4):
            n += 1
            if n % every:
                continue
            group = (1, 2, 3, 4, 8)[(i + blocks) % 5]
            kv_heads = 1 if group == 8 else 2
            head_dim = (64, 80, 128, 20)[(i + 2 * blocks) % 4]  # 20: a tail past 8 lanes
            bs = (8, 16, 32)[(i + blocks) % 3]
            window = (None, max(1, chunk // 3), chunk + bs + 7)[(i + blocks) % 3]
            prefix = blocks * bs + (3 if (i + blocks) % 2 else 0)
            rows = [(chunk, prefix + chunk), (1, 2 * bs + 5), (3, bs + 2)]
            out.append((group * kv_heads, kv_heads, head_dim, bs, rows, window))
    return out


def reference(
    q: torch.Tensor,
    cache: torch.Tensor,
    tables: list[list[int]],
    rows: list[tuple[int, int]],
    bs: int,
    window: int | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """float32 SDPA over each row's dense K/V with an explicit causal (and window) mask; with
    ``sinks`` ``[heads]``, an explicit softmax over the scores and each head's sink logit (the
    sink's weight dropped)."""
    out = torch.empty(q.shape, dtype=torch.float32)
    heads, kv_heads, dim = q.shape[1], cache.shape[3], cache.shape[4]
    start = 0
    for table, (q_len, ctx) in zip(tables, rows, strict=True):
        k = cache[0][table].reshape(-1, kv_heads, dim)[:ctx].float()
        v = cache[1][table].reshape(-1, kv_heads, dim)[:ctx].float()
        q_pos = torch.arange(ctx - q_len, ctx).view(-1, 1)
        kj = torch.arange(ctx).view(1, -1)
        mask = kj <= q_pos
        if window is not None:
            mask &= kj > q_pos - window
        k = k.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        v = v.repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        qr = q[start : start + q_len].float().transpose(0, 1)
        if sinks is None:
            o = F.scaled_dot_product_attention(qr, k, v, attn_mask=mask, scale=dim**-0.5)
        else:
            scores = (qr @ k.transpose(1, 2) * dim**-0.5).masked_fill(~mask, float("-inf"))
            sink = sinks.float().view(-1, 1, 1).expand(heads, q_len, 1)
            o = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1] @ v
        out[start : start + q_len] = o.transpose(0, 1)
        start += q_len
    return out


def scattered(
    rows: list[tuple[int, int]], bs: int, g: torch.Generator
) -> tuple[int, list[int], list[list[int]], BatchLayout]:
    """A pool of ``nb`` blocks (the rows' and 3 spare ones) handed out in random order, as a pool
    does: ``nb``, the spare blocks, each row's block table, and the layout of the rows' new
    tokens (``(q_len, ctx)`` each: the last ``q_len`` of ``ctx`` positions)."""
    nb = sum(-(-c // bs) for _, c in rows) + 3
    perm = torch.randperm(nb, generator=g).tolist()
    tables, slots, used = [], [], 0
    for q_len, ctx in rows:
        n = -(-ctx // bs)
        table = perm[used : used + n]
        used += n
        tables.append(table)
        slots += [table[p // bs] * bs + p % bs for p in range(ctx - q_len, ctx)]
    layout = BatchLayout(
        [q for q, _ in rows], [c for _, c in rows], tables, torch.tensor(slots), bs
    )
    return nb, perm[used:], tables, layout


def errors(
    backend: AttentionBackend,
    heads: int,
    kv_heads: int,
    head_dim: int,
    bs: int,
    rows: list[tuple[int, int]],
    window: int | None,
    dtype: torch.dtype,
    seed: int = 0,
    poison: bool = True,
    device: str = "cpu",
    sinks: bool = False,
) -> tuple[float, float]:
    """Max errors against the float32 reference: of ``backend`` (on a pool poisoned with NaN
    wherever it must not read, zeros there without ``poison``), and of the SDPA backend in
    ``dtype`` (the rounding yardstick; SDPA multiplies its padding by 0, NaN would stay). With
    ``sinks``, random attention sinks (one per head) in all three."""
    g = torch.Generator().manual_seed(seed)
    nb, spare, tables, layout = scattered(rows, bs, g)
    clean = torch.randn(2, nb + 1, bs, kv_heads, head_dim, generator=g).to(dtype)
    poisoned = clean.clone()
    poisoned[:, spare] = float("nan")
    poisoned[:, nb] = float("nan")
    for table, (q_len, ctx) in zip(tables, rows, strict=True):
        poisoned[:, table[-1], (ctx - 1) % bs + 1 :] = float("nan")
        if window is not None:  # blocks wholly before the first key the row's queries see
            first = max(0, ctx - q_len - window + 1)
            poisoned[:, table[: first // bs]] = float("nan")
    total = sum(q for q, _ in rows)
    q, k, v = (
        torch.randn(total, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads)
    )
    sink = 2 * torch.randn(heads, generator=g) if sinks else None
    written = clean.float().clone()
    for i, kv in enumerate((k, v)):
        written[i].view(-1, kv_heads, head_dim)[layout.slot_mapping] = kv.float()
    ref = reference(q, written, tables, rows, bs, window, sink)

    def run(be: AttentionBackend, pool: torch.Tensor, dev: str) -> torch.Tensor:
        meta = be.build_metadata(layout, torch.device(dev))
        qd, kd, vd, cache = (x.to(dev) for x in (q, k, v, pool.clone()))
        sd = None if sink is None else sink.to(dev)
        out = be.forward(qd, kd, vd, cache, meta, head_dim**-0.5, window=window, sinks=sd)
        return out.float().cpu()

    zeroed = torch.where(poisoned.isnan(), 0.0, poisoned)
    out = run(backend, poisoned if poison else zeroed, device)
    assert not out.isnan().any(), "read a slot it must not"
    sdpa = run(TorchSDPABackend(), zeroed, "cpu")
    return (out - ref).abs().max().item(), (sdpa - ref).abs().max().item()


def check_backend(
    make: str, every: int = 1, slack: float = 2.0, device: str = "cpu", sinks: bool = False
) -> None:
    """Every case of ``cases(every)`` through the backend ``make`` names, in each dtype (with
    random attention sinks where ``sinks``)."""
    from foudre.attention import get_backend

    backend = get_backend(make, torch.device(device))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for case in cases(every):
            err, sdpa_err = errors(backend, *case, dtype, device=device, sinks=sinks)  # type: ignore[arg-type]
            # float32 to rounding; 16-bit types no worse than SDPA's own rounding (+ slack for
            # the 16-bit softmax weights of P·V) and never by more than a few output ulps
            bound = 2e-5 if dtype == torch.float32 else max(slack * sdpa_err, 1e-2)
            assert err < bound, (make, dtype, case, err, sdpa_err)


def check_cpu_kernels() -> None:
    check_backend("cpu")


def quantized_errors(
    backend: AttentionBackend,
    heads: int,
    kv_heads: int,
    head_dim: int,
    bs: int,
    rows: list[tuple[int, int]],
    window: int | None,
    dtype: torch.dtype,
    kind: str,
    seed: int = 0,
    device: str = "cpu",
    sinks: bool = False,
) -> tuple[float, float]:
    """``errors`` over a quantized cache (``kind`` int8 / fp8) that ``backend`` reads as stored,
    against float32 masked SDPA over the whole cache dequantized after the step's writes. The
    pool's codes are random bytes (every value, e4m3's subnormals included; not e4m3's NaN) with
    the scales of random K/V; the slots it must not read hold NaN scales. The SDPA backend over
    the same cache (clean scales there) in ``dtype`` is the rounding yardstick. ``sinks``: as
    in ``errors``."""
    g = torch.Generator().manual_seed(seed)
    nb, spare, tables, layout = scattered(rows, bs, g)
    cache = QuantizedKVCache(nb + 1, bs, kv_heads, head_dim, kind, dtype, torch.device("cpu"))
    every = torch.arange((nb + 1) * bs)
    cache.write(every, *(torch.randn(len(every), kv_heads, head_dim, generator=g) for _ in "kv"))
    codes = torch.randint(0, 256, cache.codes.shape, generator=g, dtype=torch.uint8)
    if kind == "fp8":
        codes[(codes & 0x7F) == 0x7F] = 0  # NaN
    cache.codes.copy_(codes)
    unread = torch.zeros(nb + 1, bs, dtype=torch.bool)
    unread[spare] = True
    unread[nb] = True
    for table, (q_len, ctx) in zip(tables, rows, strict=True):
        unread[table[-1], (ctx - 1) % bs + 1 :] = True
        if window is not None:
            unread[table[: max(0, ctx - q_len - window + 1) // bs]] = True
    clean = cache.scales.clone()
    cache.scales[:, unread] = float("nan")
    total = sum(q for q, _ in rows)
    q, k, v = (
        torch.randn(total, h, head_dim, generator=g).to(dtype) for h in (heads, kv_heads, kv_heads)
    )
    sink = 2 * torch.randn(heads, generator=g) if sinks else None

    def run(be: AttentionBackend, dev: str) -> tuple[torch.Tensor, QuantizedKVCache]:
        pool = copy.deepcopy(cache)
        if be is not backend:
            pool.scales.copy_(clean)
        pool.codes, pool.scales = pool.codes.to(dev), pool.scales.to(dev)
        meta = be.build_metadata(layout, torch.device(dev))
        qd, kd, vd = (x.to(dev) for x in (q, k, v))
        sd = None if sink is None else sink.to(dev)
        out = be.forward(qd, kd, vd, pool, meta, head_dim**-0.5, window=window, sinks=sd)
        return out.float().cpu(), pool

    out, written = run(backend, device)
    assert not out.isnan().any(), "read a slot it must not"
    scales = torch.where(written.scales.cpu().isnan(), 1.0, written.scales.cpu())
    codes = written.codes.cpu().view(STORAGE_DTYPES[kind])
    ref = reference(q, dequantize_kv(codes, scales, torch.float32), tables, rows, bs, window, sink)
    sdpa, _ = run(TorchSDPABackend(), "cpu")
    return (out - ref).abs().max().item(), (sdpa - ref).abs().max().item()


def check_quantized(
    make: str,
    case_list: list[tuple[int, int, int, int, list[tuple[int, int]], int | None]],
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16),
    slack: float = 2.0,
    device: str = "cpu",
    sinks: bool = False,
) -> None:
    """Every case through the backend ``make`` names over int8 and fp8 caches, in each dtype
    (with random attention sinks where ``sinks``)."""
    from foudre.attention import get_backend

    backend = get_backend(make, torch.device(device))
    for kind in ("int8", "fp8"):
        for dtype in dtypes:
            for case in case_list:
                err, sdpa_err = quantized_errors(
                    backend,
                    *case,
                    dtype,
                    kind,
                    device=device,
                    sinks=sinks,  # type: ignore[arg-type]
                )
                bound = 2e-5 if dtype == torch.float32 else max(slack * sdpa_err, 1e-2)
                assert err < bound, (make, kind, dtype, case, err, sdpa_err)


def check_every_code(make: str, device: str = "cpu") -> None:
    """Each code value read exactly, by the decode and the prefill kernel: rows whose first key
    has every byte as V codes (e4m3's NaN aside) with scale 1. A query that sees that key alone
    gets weight 1, so its output is the codes' values, which float32 and bfloat16 hold."""
    from foudre.attention import get_backend

    backend = get_backend(make, torch.device(device))
    dim, bs = 128, 8
    for kind in ("int8", "fp8"):
        codes = torch.arange(256, dtype=torch.uint8)
        if kind == "fp8":
            codes[(codes & 0x7F) == 0x7F] = 0  # NaN
        want = dequantize_kv(codes.view(STORAGE_DTYPES[kind]), torch.ones(()), torch.float32)
        for dtype in (torch.float32, torch.bfloat16):
            cache = QuantizedKVCache(3, bs, 1, dim, kind, dtype, torch.device("cpu"))
            cache.codes[1, :2, 0] = codes.view(2, 1, dim)  # V of blocks 0 and 1: first keys
            cache.codes[0] = torch.randint(0, 100, cache.codes[0].shape, dtype=torch.uint8)
            cache.codes, cache.scales = cache.codes.to(device), cache.scales.to(device)
            for q_len in (1, 2):  # decode rows; rows of two queries (the first sees one key)
                # the step's own K/V go to block 2, which no row reads
                slots = torch.arange(2 * q_len) + 2 * bs
                layout = BatchLayout([q_len] * 2, [q_len] * 2, [[0], [1]], slots, bs)
                meta = backend.build_metadata(layout, torch.device(device))
                q = torch.randn(2 * q_len, 2, dim).to(dtype).to(device)
                k = torch.zeros(2 * q_len, 1, dim, dtype=dtype, device=device)
                out = backend.forward(q, k, k, cache, meta, dim**-0.5).cpu()
                got = out[::q_len].float()  # each row's first query: [2, heads, dim]
                expected = want.view(2, 1, dim).expand(2, 2, dim).to(dtype).float()
                assert torch.equal(got, expected), (make, kind, dtype, q_len)


def check_cpu_quantized() -> None:
    check_every_code("cpu")
    check_quantized("cpu", cases(every=2))


def check_sinks(make: str = "cpu", device: str = "cpu", slack: float = 2.0) -> None:
    """Attention sinks (gpt-oss) through the backend ``make`` names: every third case (mixed
    steps of decode rows and chunks, windows, GQA 1-8) over float caches in each dtype, and
    every sixth plus the decode-only steps over int8 and fp8 caches, against the explicit
    softmax with each head's sink logit in its denominator."""
    check_backend(make, every=3, slack=slack, device=device, sinks=True)
    dtypes = (torch.float32, torch.bfloat16)
    check_quantized(make, [*cases(every=6), *DECODE_STEPS], dtypes, slack, device, sinks=True)


# decode-only steps (the Triton backend's decode kernel; the others go to its prefill kernel)
DECODE_STEPS = [
    (6, 2, 32, 16, [(1, 1), (1, 17), (1, 40), (1, 33)], None),
    (8, 1, 64, 8, [(1, 16), (1, 129)], None),
    (10, 2, 80, 32, [(1, 2), (1, 50), (1, 99)], 20),
    (4, 4, 24, 8, [(1, 70), (1, 3)], 9),
]


def check_triton_quantized() -> None:
    check_every_code("triton")
    check_quantized("triton", [*cases(every=9), *DECODE_STEPS], (torch.float32, torch.bfloat16), 4)


needs_kernels = pytest.mark.skipif(not cpu_paged.available(), reason="no C++ compiler")


@pytest.fixture(scope="module")
def other_marches(
    request: pytest.FixtureRequest, march_cache: Callable[[str], Path]
) -> MarchChecks:
    """The checks of the prefill kernel's other paths: one process per -march runs them all."""
    module = "tests.engine.test_prefill_attention"
    tests = {
        "test_other_cpu_paths_match_masked_sdpa": f"{module}:check_cpu_kernels",
        "test_other_cpu_paths_read_a_quantized_cache": f"{module}:check_cpu_quantized",
        "test_other_cpu_paths_are_batch_invariant": f"{module}:check_batch_invariance",
        "test_other_cpu_paths_apply_attention_sinks": f"{module}:check_sinks",
    }
    return MarchChecks(tests, "cpu_paged_prefill", selected(request), march_cache)


@needs_kernels
def test_cpu_kernels_match_masked_sdpa() -> None:
    check_cpu_kernels()


@needs_kernels
def test_cpu_kernels_read_a_quantized_cache() -> None:
    """int8 and fp8 codes and scales read as stored by the decode and prefill kernels: every
    code value exactly, and every second case (GQA 1-8, block sizes 8/16/32, odd lengths,
    windows) against masked SDPA over the dequantized cache."""
    check_cpu_quantized()


@needs_kernels
@pytest.mark.parametrize("march", ["x86-64", "haswell", "skylake-avx512"])
def test_other_cpu_paths_read_a_quantized_cache(march: str, other_marches: MarchChecks) -> None:
    """The portable path, the AVX2 one and the AVX-512 one without AVX512-BF16 over quantized
    caches."""
    other_marches.run("test_other_cpu_paths_read_a_quantized_cache", march)


@needs_kernels
@pytest.mark.parametrize("march", ["x86-64", "haswell", "skylake-avx512"])
def test_other_cpu_paths_match_masked_sdpa(march: str, other_marches: MarchChecks) -> None:
    """The portable path, the AVX2 one and the AVX-512 one without AVX512-BF16, built for
    another -march."""
    other_marches.run("test_other_cpu_paths_match_masked_sdpa", march)


@needs_kernels
def test_cpu_kernels_apply_attention_sinks() -> None:
    """The decode and prefill kernels with each head's sink logit in its softmax denominator,
    over float and quantized caches."""
    check_sinks("cpu")


@needs_kernels
@pytest.mark.parametrize("march", ["x86-64", "haswell", "skylake-avx512"])
def test_other_cpu_paths_apply_attention_sinks(march: str, other_marches: MarchChecks) -> None:
    """The portable path, the AVX2 one and the AVX-512 one without AVX512-BF16."""
    other_marches.run("test_other_cpu_paths_apply_attention_sinks", march)


def test_sdpa_and_causal_backends_apply_attention_sinks() -> None:
    """The reference backend with sinks (an extra zero key whose score is the sink) against the
    explicit softmax, in float32, with windows; and the dense causal backend (training,
    evaluation) against the same over one row, differentiable in the sinks."""
    for case in cases(every=3):
        heads, kv_heads, head_dim, bs, rows, window = case
        err, _ = errors(
            TorchSDPABackend(), heads, kv_heads, head_dim, bs, rows, window, torch.float32,
            0, False, sinks=True,
        )  # fmt: skip
        assert err < 2e-5, (case, err)
    from foudre.attention.causal import CausalBackend

    g = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, t = 6, 2, 16, 20
    q, k, v = (torch.randn(2 * t, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    sinks = torch.randn(heads, generator=g).requires_grad_()
    for window in (None, 7):
        out = CausalBackend().forward(q, k, v, torch.empty(0), (2, t), dim**-0.5, window, sinks)
        for b in range(2):
            cache = torch.stack([k[b * t : (b + 1) * t], v[b * t : (b + 1) * t]]).unsqueeze(1)
            ref = reference(q[b * t : (b + 1) * t], cache, [[0]], [(t, t)], t, window, sinks)
            torch.testing.assert_close(out[b * t : (b + 1) * t], ref, atol=2e-5, rtol=0)
    out.sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().sum() > 0


def test_sdpa_backend_window_matches_masked_sdpa() -> None:
    """The reference backend itself: its windowed groups (gathering from the window's first
    block) against the dense masked SDPA."""
    for case in cases(every=3):
        heads, kv_heads, head_dim, bs, rows, window = case
        err, _ = errors(
            TorchSDPABackend(), heads, kv_heads, head_dim, bs, rows, window, torch.float32, 0, False
        )
        assert err < 2e-5, (case, err)


def check_batch_invariance() -> None:
    """A query's output is the same bits whether its prompt is computed whole, in chunks, or
    beside other rows: lanes never mix and the key tiles lie on a fixed grid. float32 with
    head_dim 64 on a plain cache, bfloat16 with head_dim 20 (a tail past the vectors) on an fp8
    cache, each with and without a window (tiles whose first keys the window hides)."""
    _check_batch_invariance(torch.float32, 64, None)
    _check_batch_invariance(torch.bfloat16, 20, "fp8")


def _check_batch_invariance(dtype: torch.dtype, dim: int, kind: str | None) -> None:
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, bs, ctx = 8, 2, 16, 150
    cache: torch.Tensor | QuantizedKVCache
    if kind is None:
        cache = torch.randn(2, 20, bs, kv_heads, dim, generator=g).to(dtype)
    else:
        cache = QuantizedKVCache(20, bs, kv_heads, dim, kind, dtype, torch.device("cpu"))
        every = torch.arange(20 * bs)
        cache.write(every, *(torch.randn(len(every), kv_heads, dim, generator=g) for _ in "kv"))
    q = torch.randn(ctx, heads, dim, generator=g).to(dtype)
    table = list(range(10))
    backend = cpu_paged.CPUPagedBackend()

    def attend(pieces: list[tuple[int, int]], other: bool, window: int | None) -> torch.Tensor:
        """Queries [start, end) of the prompt as one step's rows (with another row first)."""
        rows_q = [q[s:e] for s, e in pieces]
        lens, seqs, tables = (
            [e - s for s, e in pieces],
            [e for _, e in pieces],
            [table] * len(pieces),
        )
        if other:
            rows_q.insert(0, torch.randn(7, heads, dim, generator=g).to(dtype))
            lens, seqs, tables = [7, *lens], [40, *seqs], [[15, 16, 17], *tables]
        flat = torch.cat(rows_q)
        slots = torch.zeros(len(flat), dtype=torch.long) + 19 * bs  # K/V to a spare block
        layout = BatchLayout(lens, seqs, tables, slots, bs)
        meta = backend.build_metadata(layout, torch.device("cpu"))
        k = torch.zeros(len(flat), kv_heads, dim, dtype=dtype)
        pool = copy.deepcopy(cache)
        out = backend.forward(flat, k, k, pool, meta, dim**-0.5, window=window)
        return out[7:] if other else out

    for window in (None, 40):
        whole = attend([(0, ctx)], False, window)
        chunked = torch.cat([attend([(0, 37)], False, window), attend([(37, ctx)], True, window)])
        batched = attend([(0, 90), (90, ctx)], True, window)
        same = torch.equal(whole, chunked) and torch.equal(whole, batched)
        assert same, (dtype, dim, kind, window)


@needs_kernels
def test_cpu_prefill_is_batch_invariant() -> None:
    check_batch_invariance()


@needs_kernels
@pytest.mark.parametrize("march", ["x86-64", "haswell", "skylake-avx512"])
def test_other_cpu_paths_are_batch_invariant(march: str, other_marches: MarchChecks) -> None:
    """The portable path, the AVX2 one and the AVX-512 one without AVX512-BF16."""
    other_marches.run("test_other_cpu_paths_are_batch_invariant", march)


_TRITON_CHECK = """
import sys
from tests.engine.test_prefill_attention import check_backend
check_backend("triton", every=int(sys.argv[1]), slack=float(sys.argv[2]))
print("ok")
"""


@pytest.fixture(scope="module")
def interpreted(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Checks]:
    """The module's interpreter checks that this session runs, started together at the first
    of them, two processes at a time, the longest first (``start_triton_checks``): test name
    -> its process. The engine checks share one model: a Mistral with a window of 12."""
    pytest.importorskip("triton", reason="triton is not installed")
    model = "<model>"  # the engine checks' argument: the model, written if one of them runs
    checks = {
        "test_triton_kernels_interpreted": (_TRITON_CHECK, "3", "4"),
        "test_triton_kernels_read_a_quantized_cache_interpreted": (_TRITON_QUANTIZED,),
        "test_triton_kernels_apply_attention_sinks_interpreted": (_TRITON_SINKS,),
        "test_graphs_over_a_quantized_cache_interpreted[fp8]": (_GRAPHS_CHECK, model, "fp8"),
        "test_graphs_over_a_quantized_cache_interpreted[int8]": (_GRAPHS_CHECK, model, "int8"),
        "test_graphs_of_verification_and_mixed_steps_interpreted": (_GRAPHS_CHECK, model),
        "test_windowed_engine_with_triton_interpreted": (_TRITON_ENGINE, model),
        "test_graph_buffers_step_by_step_interpreted": (_GRAPH_STEPS, model),
    }
    run = selected(request)
    checks = {name: check for name, check in checks.items() if name in run}
    if any(model in check for check in checks.values()):
        path = str(make_hf_model(tmp_path_factory.mktemp("m"), "mistral", sliding_window=12))
        checks = {name: tuple(path if a == model else a for a in c) for name, c in checks.items()}
    started = start_triton_checks(checks)
    yield started
    for future in started.values():  # (an interrupted session: none left to start)
        future.cancel()


def _interpreted(request: pytest.FixtureRequest, interpreted: Checks) -> None:
    wait_triton_check(interpreted[request.node.name])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the Triton kernels for real")
def test_triton_kernels_interpreted(request: pytest.FixtureRequest, interpreted: Checks) -> None:
    """The varlen prefill kernel (every row of a step with a chunk, decode rows included, in one
    launch) and the windowed decode kernel, in Triton's interpreter. The interpreter rounds
    float32 to 16-bit floats towards zero where a GPU rounds to nearest: a wider slack."""
    _interpreted(request, interpreted)


_TRITON_QUANTIZED = """
from tests.engine.test_prefill_attention import check_triton_quantized
check_triton_quantized()
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the Triton kernels for real")
def test_triton_kernels_read_a_quantized_cache_interpreted(
    request: pytest.FixtureRequest, interpreted: Checks
) -> None:
    """Both Triton kernels over int8 and fp8 codes and scales read as stored (mixed steps,
    decode-only steps, windows, GQA 1-8, block sizes 8-32), in the interpreter, against masked
    SDPA over the dequantized cache."""
    _interpreted(request, interpreted)


_TRITON_SINKS = """
from tests.engine.test_prefill_attention import check_sinks
check_sinks("triton", slack=4.0)
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU runs the Triton kernels for real")
def test_triton_kernels_apply_attention_sinks_interpreted(
    request: pytest.FixtureRequest, interpreted: Checks
) -> None:
    """Both Triton kernels with attention sinks (``check_sinks``), in the interpreter."""
    _interpreted(request, interpreted)


def test_layer_windows_from_the_config() -> None:
    base = dict(
        architecture="qwen2",
        vocab_size=16,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
    )
    assert [ModelConfig(**base).layer_window(i) for i in range(3)] == [None] * 3  # type: ignore[arg-type]
    every = ModelConfig(**base, sliding_window=5)  # type: ignore[arg-type]
    assert [every.layer_window(i) for i in range(3)] == [5, 5, 5]
    types = ("full_attention", "sliding_attention", "full_attention")
    alternating = ModelConfig(**base, sliding_window=5, layer_types=types)  # type: ignore[arg-type]
    assert [alternating.layer_window(i) for i in range(3)] == [None, 5, None]
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig(**base, sliding_window=5, layer_types=types[:2])  # type: ignore[arg-type]


def test_hf_layer_types(tmp_path: Path) -> None:
    """Which layers slide, as transformers reads the same config.json."""
    from foudre.loading.hf import load_hf_config

    qwen = make_hf_model(
        tmp_path / "qwen2",
        "qwen2",
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=6,
        max_window_layers=1,
    )
    cfg = load_hf_config(qwen)
    assert [cfg.layer_window(i) for i in range(3)] == [None, 6, 6]
    mistral = load_hf_config(make_hf_model(tmp_path / "mistral", "mistral", sliding_window=6))
    assert [mistral.layer_window(i) for i in range(2)] == [6, 6]
    off = make_hf_model(tmp_path / "off", "qwen2", use_sliding_window=False, sliding_window=6)
    assert load_hf_config(off).sliding_window is None


WINDOW_PROMPTS = [
    [1, 5, 9, 33, 7],
    list(range(1, 40)),
    [1, 42],
    [1, 100, 101, 102, 103] * 8,
    list(range(1, 40)),  # a prefix-cache hit of the second prompt, past the window
]


@needs_kernels
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_windowed_engine_matches_the_sdpa_backend(tmp_path: Path, dtype: str) -> None:
    """Mistral with a window of 12 tokens, prompts up to 40, chunked prefill, decode past the
    window, a prefix hit: greedy tokens with the kernels as with gather + masked SDPA, and the
    context is not capped at the window."""
    path = make_hf_model(tmp_path / "m", "mistral", sliding_window=12)
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (30, 9, 25, 12, 9)
    ]
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(
            str(path),
            dtype=dtype,
            skip_tokenizer_init=True,
            num_kv_blocks=64,
            block_size=8,
            max_num_batched_tokens=16,
            attention_backend=backend,
        )
        assert llm.engine.runner.backend.name == backend
        assert llm.engine.max_model_len == 512  # max_position_embeddings, not the window
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(WINDOW_PROMPTS, params)]
        m = llm.metrics()
        assert m["num_free_blocks"] == m["num_total_blocks"]
    if dtype == "float32":
        assert outs["torch"] == outs["cpu"]
    else:  # bf16 rounding differs between the two; most tokens must still agree
        same = sum(a == b for x, y in zip(outs["torch"], outs["cpu"]) for a, b in zip(x, y))
        assert same >= 0.8 * sum(len(x) for x in outs["torch"]), outs


@needs_kernels
def test_long_prompt_matches_transformers(tmp_path: Path) -> None:
    """A 3,000-token prompt, prefilled in chunks of 512 by the CPU kernels, on a Qwen2 model
    whose context is raised to 4,096 by YaRN (positions past its original 1,024) and whose
    second layer slides a 700-token window (longer than a chunk, shorter than the prompt):
    the last logits and the greedy continuation of transformers."""
    import transformers

    path = make_hf_model(
        tmp_path / "m",
        "qwen2",
        max_position_embeddings=4096,
        use_sliding_window=True,
        sliding_window=700,
        max_window_layers=1,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    )
    prompt = torch.randint(3, 256, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    llm = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        num_kv_blocks=260,
        block_size=16,
        max_num_batched_tokens=512,
        attention_backend="cpu",
    )
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=5)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert out.token_ids == ref.sequences[0, len(prompt) :].tolist()
    assert out.logprobs is not None
    want = torch.log_softmax(ref.logits[0][0].float(), -1)
    for token, logprob in out.logprobs[0].items():
        assert abs(logprob - want[token].item()) < 1e-4, token


_TRITON_ENGINE = """
import sys
from foudre import LLM, SamplingParams
from tests.engine.test_prefill_attention import WINDOW_PROMPTS

params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (20, 9, 13, 6, 9)]
outs = {}
for backend in ("torch", "triton"):
    llm = LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
              block_size=8, max_num_batched_tokens=16, device="cpu", attention_backend=backend)
    outs[backend] = [o.outputs[0].token_ids for o in llm.generate(WINDOW_PROMPTS, params)]
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
assert outs["torch"] == outs["triton"], outs
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the engine for real")
def test_windowed_engine_with_triton_interpreted(
    request: pytest.FixtureRequest, interpreted: Checks
) -> None:
    """Mixed steps (chunks beside decode rows) through the varlen kernel, decode steps through
    the windowed decode kernel, in the interpreter: the SDPA backend's greedy tokens."""
    _interpreted(request, interpreted)


_GRAPHS_CHECK = """
import sys
from foudre import LLM, SamplingParams
from foudre.runner.cuda_graphs import DecodeGraphs
from tests.engine.test_prefill_attention import WINDOW_PROMPTS

class Replayed(DecodeGraphs):
    # CUDA graphs with the capture replaced by re-running the forward over the static buffers
    # (rows, tiles, padding row, slots), which checks them without a GPU
    def _capture_fn(self, forward):
        out = forward()
        class Graph:
            def replay(self):
                out.copy_(forward())
        return Graph(), out

prompts = [*WINDOW_PROMPTS, [1, 5, 6, 7, 8] * 6]
params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
          for n in (20, 9, 13, 6, 9, 16)]
kv = sys.argv[2] if len(sys.argv) > 2 else "auto"  # the KV cache's dtype
outs = {}
for name in ("torch", "graphs"):
    spec = {} if name == "torch" else dict(speculative_method="ngram", num_speculative_tokens=3)
    llm = LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, num_kv_blocks=96,
              block_size=8, max_num_batched_tokens=16, device="cpu", kv_cache_dtype=kv,
              attention_backend="torch" if name == "torch" else "triton", **spec)
    if name == "graphs":
        runner = llm.engine.runner
        cfg = runner.model.config
        tiles = runner.backend.tile_positions(cfg.num_attention_heads, cfg.num_key_value_heads)
        runner.decode_path = Replayed(runner.forward_hidden, runner.device, runner.block_size,
                                      runner.padding_block, 4, 512, tile_positions=tiles,
                                      max_tokens=32)
    outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
graphs = runner.decode_path
assert graphs.mixed_graphs and graphs.graphs, (graphs.mixed_graphs, graphs.graphs)
assert m["spec_draft_tokens"] > 0, m
assert outs["torch"] == outs["graphs"], outs
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the engine for real")
def test_graphs_of_verification_and_mixed_steps_interpreted(
    request: pytest.FixtureRequest, interpreted: Checks
) -> None:
    """Speculative verification and chunked prefill beside decode rows replayed over the
    static buffers of the token-bucket graphs (decode-only steps over the row-bucket ones), in
    the interpreter, with a sliding window: the eager SDPA engine's greedy tokens."""
    _interpreted(request, interpreted)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the engine for real")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_graphs_over_a_quantized_cache_interpreted(
    request: pytest.FixtureRequest, interpreted: Checks, kind: str
) -> None:
    """The CUDA-graph path (decode, verification and mixed steps replayed over the static
    buffers) over an int8 / fp8 cache that the Triton kernels read as stored: the greedy tokens
    of the eager SDPA engine over the same cache, dequantized."""
    _interpreted(request, interpreted)


_GRAPH_STEPS = """
import sys
import torch
from foudre import LLM
from foudre.attention import BatchLayout
from foudre.attention.torch_sdpa import TorchSDPABackend
from foudre.runner.cuda_graphs import DecodeGraphs
from foudre.runner.step import ForwardStep

class Replayed(DecodeGraphs):
    # the capture replaced by re-running the forward over the static buffers
    def _capture_fn(self, forward):
        out = forward()
        class Graph:
            def replay(self):
                out.copy_(forward())
        return Graph(), out

llm = LLM(sys.argv[1], dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64,
          block_size=8, device="cpu", attention_backend="triton", enforce_eager=True)
runner, sdpa = llm.engine.runner, TorchSDPABackend()
cfg = runner.model.config
per_tile = runner.backend.tile_positions(cfg.num_attention_heads, cfg.num_key_value_heads)
assert per_tile == 32, per_tile
g = torch.Generator().manual_seed(0)
blocks = {s: list(range(16 * i, 16 * i + 16)) for i, s in enumerate("ABCD")}
done = dict.fromkeys("ABCD", 0)

def check(graphs, rows, graphed=True):
    # rows: (sequence, new tokens); tables as wide as each sequence's blocks so far
    tables, starts, ids = [], [], []
    for name, n in rows:
        starts.append(done[name])
        done[name] += n
        tables.append(blocks[name][: -(-done[name] // 8)])
        ids.append(torch.randint(3, 256, (n,), generator=g).tolist())
    step = ForwardStep(tables, starts, ids, [1] * len(ids))
    assert graphs.can_run(step) == graphed, rows
    if not graphed:
        for name, n in rows:
            done[name] -= n
        return
    got = graphs.run(step).clone()
    # the oracle: the same model over the same cache through gather + masked SDPA
    slots = [t[p // 8] * 8 + p % 8 for t, st, i in zip(tables, starts, ids)
             for p in range(st, st + len(i))]
    lens = [st + len(i) for st, i in zip(starts, ids)]
    layout = BatchLayout([len(i) for i in ids], lens, tables, torch.tensor(slots), 8)
    flat = torch.tensor([t for i in ids for t in i])
    pos = torch.cat([torch.arange(st, st + len(i)) for st, i in zip(starts, ids)])
    meta = sdpa.build_metadata(layout, runner.device)
    want = runner.model(flat, pos, runner.kv_caches, sdpa, meta)
    assert got.shape == want.shape and (got - want).abs().max() < 1e-4, rows

graphs = Replayed(runner.forward_hidden, runner.device, 8, runner.padding_block, 4, 128,
                  tile_positions=per_tile, max_tokens=64)
assert graphs.token_sizes == [16, 32, 64] and graphs.max_blocks == 16
check(graphs, [("A", 21), ("B", 5)])  # bucket 32: a padding row of 6 tokens
check(graphs, [("A", 20), ("B", 1), ("C", 3)])  # a chunk past the window beside decode rows
check(graphs, [("A", 1), ("B", 1), ("C", 1)])  # decode only: row bucket 4, a padding row
check(graphs, [("A", 4), ("B", 4), ("C", 4), ("D", 4)])  # verification: 16, no padding row
check(graphs, [("D", 47), ("A", 1)])  # bucket 64: two tiles of D, a padding row of 16
check(graphs, [("B", 2), ("C", 1), ("D", 1)])  # narrower tables and fewer rows than before
check(graphs, [("A", 4), ("B", 4), ("C", 4), ("D", 4), ("B", 1)], graphed=False)  # 5 rows
check(graphs, [("A", 60), ("B", 10)], graphed=False)  # over max_tokens
done["A"] = 8 * 16 + 1  # a table wider than max_model_len's 16 blocks
blocks["A"] = list(range(64)) + [0]
check(graphs, [("A", 1)], graphed=False)
assert sorted(graphs.mixed_graphs) == [16, 32, 64] and sorted(graphs.graphs) == [4]

# a short max_model_len: the padding row's positions stay within it (the RoPE table's rows)
short = Replayed(runner.forward_hidden, runner.device, 8, runner.padding_block, 4, 12,
                 tile_positions=per_tile, max_tokens=64)
assert short.token_sizes == [12], short.token_sizes
done.update(C=0)
blocks["C"] = [40, 41]
check(short, [("C", 3)])
assert int(short.positions[:12].max()) < 12
print("ok")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run the engine for real")
def test_graph_buffers_step_by_step_interpreted(
    request: pytest.FixtureRequest, interpreted: Checks
) -> None:
    """The token-bucket and row-bucket graphs' static buffers (rows, tiles, the padding row
    and its slots, tables narrower than the last step's, buckets filled exactly), replayed
    step after step in the interpreter, against the same model over the same cache through
    masked SDPA; steps the buffers cannot hold run eagerly; a short ``max_model_len`` keeps
    the padding row's positions inside it."""
    _interpreted(request, interpreted)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@needs_cuda
def test_triton_kernels_on_gpu() -> None:
    pytest.importorskip("triton")
    check_backend("triton", device="cuda")


@needs_cuda
def test_triton_kernels_read_a_quantized_cache_on_gpu() -> None:
    pytest.importorskip("triton")
    check_every_code("triton", "cuda")
    check_quantized("triton", [*cases(every=3), *DECODE_STEPS], device="cuda")


@needs_cuda
def test_graphs_of_verification_match_eager_on_gpu(tmp_path: Path) -> None:
    """Speculative verification and chunked prefill in CUDA graphs (the default GPU engine)
    against the eager SDPA engine without speculation: the same greedy tokens (fp32)."""
    path = make_hf_model(tmp_path / "m", "mistral", sliding_window=12)
    prompts = [*WINDOW_PROMPTS, [1, 5, 6, 7, 8] * 6]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        for n in (20, 9, 13, 6, 9, 16)
    ]
    outs = {}
    for name, kwargs in (
        ("eager", dict(attention_backend="torch", enforce_eager=True)),
        ("graphs", dict(speculative_method="ngram", num_speculative_tokens=3)),
    ):
        llm = LLM(
            str(path),
            dtype="float32",
            skip_tokenizer_init=True,
            num_kv_blocks=96,
            block_size=8,
            max_num_batched_tokens=16,
            **kwargs,
        )
        outs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.runner.decode_path
        if name == "graphs":
            assert graphs is not None and graphs.mixed_graphs  # type: ignore[attr-defined]
    assert outs["eager"] == outs["graphs"], outs


_COMPILE_CHECK = """
import inspect
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from foudre.attention import triton_paged as tp

def compile_for(fn, types, consts):
    names = inspect.signature(fn.fn).parameters
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in names}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                          target=GPUTarget("cuda", 90, 32))

# (queries' dtype, the cache's: the same, or int8 / e4m3 codes read as bytes; CODES); attention
# sinks (gpt-oss) in every other combination
combos = (("bf16", "bf16", 0, (1, 7)), ("fp32", "fp32", 0, (4,)), ("bf16", "i8", 1, (4,)),
          ("bf16", "u8", 2, (4,)), ("fp32", "u8", 2, (1,)))
for i, (dt, cache, codes, groups) in enumerate(combos):
    sinks = i % 2 == 0
    ptr = "*" + dt
    kv = "*" + cache
    scales = kv if codes == 0 else "*fp32"
    types = dict(q_ptr=ptr, k_ptr=kv, v_ptr=kv, ks_ptr=scales, vs_ptr=scales, o_ptr=ptr,
                 tok_ptr="*i32", bt_ptr="*i32", len_ptr="*i32", scale="fp32", tile_ptr="*i32",
                 qs_ptr="*i32", ql_ptr="*i32", sinks_ptr="*fp32" if sinks else ptr)
    for per_kv in groups:
        positions, block_m = tp.prefill_tile(per_kv)
        compile_for(tp._paged_decode, types, dict(
            PER_KV=per_kv, PER_KV_P2=max(2, triton.next_power_of_2(per_kv)), HEAD_DIM=80,
            HEAD_DIM_P2=128, BLOCK_SIZE=16, CODES=codes, SINKS=sinks))
        compile_for(tp._paged_prefill, types, dict(
            PER_KV=per_kv, POS=positions, BLOCK_M=block_m, HEAD_DIM=80, HEAD_DIM_P2=128,
            BLOCK_SIZE=16, BLOCK_N=32, IEEE=dt == "fp32", UPCAST=False, CODES=codes,
            SINKS=sinks))
print("ok")
"""


@pytest.mark.slow
def test_triton_kernels_compile_for_the_gpu() -> None:
    """The interpreter does not type-check like the compiler: both kernels compiled to sm_90
    code (Triton's own ptxas, no GPU needed), for the dtypes and GQA groups the engine uses,
    over float caches and int8 / fp8 codes."""
    run_triton_check(
        _COMPILE_CHECK, interpret=False, timeout=600, env={"TRITON_DEFAULT_FP_FUSION": "1"}
    )


def test_yarn_without_its_lengths_is_refused() -> None:
    from foudre.layers.rotary import RotaryEmbedding

    for missing in ("factor", "original_max_position_embeddings"):
        scaling = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
        del scaling[missing]
        with pytest.raises(ValueError, match=missing):
            RotaryEmbedding(16, 256, 10000.0, scaling)
