"""The CPU paged-attention kernel (``attention_backend="cpu"``) against the SDPA backend.

The kernel's four paths (AVX512-BF16, AVX-512, AVX2, portable) are each compiled and checked: the
one this machine takes in-process, the others in subprocesses built with ``FOUDRE_KERNEL_MARCH``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.attention import BatchLayout, cpu_paged, resolve_backend
from foudre.attention.torch_sdpa import TorchSDPABackend
from tests.conftest import make_hf_model
from tests.engine.march import MarchChecks
from tests.triton_check import selected

pytestmark = pytest.mark.skipif(not cpu_paged.available(), reason="no C++ compiler")


def attention_errors(
    num_heads: int,
    num_kv: int,
    head_dim: int,
    q_lens: list[int],
    ctx_lens: list[int],
    dtype: torch.dtype,
    block_size: int,
    seed: int = 0,
) -> tuple[float, float]:
    """Max errors against float32 SDPA over the same (rounded) values: of the CPU backend, and
    of the SDPA backend run in ``dtype`` (the yardstick for what rounding alone costs)."""
    g = torch.Generator().manual_seed(seed)
    nb = sum(-(-c // block_size) for c in ctx_lens) + 3
    perm = torch.randperm(nb, generator=g).tolist()  # blocks out of order, as a pool hands out
    tables, slots, used = [], [], 0
    for q, c in zip(q_lens, ctx_lens, strict=True):
        n = -(-c // block_size)
        table = perm[used : used + n]
        used += n
        tables.append(table)
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c - q, c)]
    layout = BatchLayout(list(q_lens), list(ctx_lens), tables, torch.tensor(slots), block_size)
    cache = torch.randn(2, nb + 1, block_size, num_kv, head_dim, generator=g).to(dtype)
    # the kernel sees NaN in every slot past each row's length (reading one poisons its output),
    # the SDPA runs zeros there (their masked gather multiplies them by 0: NaN would stay NaN);
    # beside multi-token rows, which go through SDPA in both backends, a huge value instead
    poisoned = cache.clone()
    poison = float("nan") if max(q_lens) == 1 else 1e4
    poisoned[:, perm[used:]] = poison
    poisoned[:, nb] = poison
    for table, c in zip(tables, ctx_lens, strict=True):
        poisoned[:, table[-1], (c - 1) % block_size + 1 :] = poison
    cache = torch.where(poisoned.isnan(), 0.0, poisoned)
    # the new tokens' slots too: the step writes them (the kernel itself, in a decode-only step)
    # before anything reads them
    poisoned.view(2, -1, num_kv, head_dim)[:, slots] = poison
    total = sum(q_lens)
    q, k, v = (
        torch.randn(total, h, head_dim, generator=g).to(dtype) for h in (num_heads, num_kv, num_kv)
    )

    def run(backend: object, dt: torch.dtype, pool: torch.Tensor) -> torch.Tensor:
        c = pool.to(dt, copy=True)
        meta = backend.build_metadata(layout, torch.device("cpu"))  # type: ignore[attr-defined]
        out = backend.forward(q.to(dt), k.to(dt), v.to(dt), c, meta, head_dim**-0.5)  # type: ignore[attr-defined]
        stored = c.view(2, -1, num_kv, head_dim)[:, slots]
        assert torch.equal(stored[0], k.to(dt)) and torch.equal(stored[1], v.to(dt)), backend
        return out.float()

    ref = run(TorchSDPABackend(), torch.float32, cache)
    kernel = run(cpu_paged.CPUPagedBackend(), dtype, poisoned)
    sdpa = run(TorchSDPABackend(), dtype, cache)
    assert not kernel.isnan().any()
    return (kernel - ref).abs().max().item(), (sdpa - ref).abs().max().item()


CASES = [
    # (heads, kv heads, head_dim, tokens per row (1: decode), context per row)
    (6, 2, 32, [1, 1, 5, 1], [1, 17, 40, 33]),  # GQA 3, a 5-token chunk through SDPA
    (4, 4, 24, [1, 3, 1], [70, 3, 16]),  # MHA, head_dim not a multiple of 16
    (8, 1, 64, [1, 1], [16, 129]),  # MQA
    (16, 4, 96, [1] * 5, [1, 15, 16, 17, 600]),  # the benchmark model's shape
    (28, 4, 128, [1] * 3, [31, 64, 333]),  # GQA 7: head groups of 4 and 3
    (10, 2, 80, [1] * 3, [2, 50, 99]),  # GQA 5, head_dim 80 (a partial 32-lane chunk)
    (12, 4, 256, [1] * 2, [7, 300]),  # head_dim 256: the runtime chunk count
    (6, 3, 20, [1] * 2, [5, 41]),  # head_dim 20: a partial last chunk (AVX2: 16 + 4)
]


def _check_all(dtypes: tuple[torch.dtype, ...]) -> None:
    for dtype in dtypes:
        for block_size in (16, 8, 32):
            for case in CASES:
                err, sdpa_err = attention_errors(*case, dtype, block_size)  # type: ignore[arg-type]
                # float32 to rounding; 16-bit types no worse than SDPA's own rounding (+ slack
                # for the bf16 softmax weights) and never wrong by more than a few output ulps
                bound = 1e-5 if dtype == torch.float32 else max(2 * sdpa_err, 1e-2)
                assert err < bound, (dtype, block_size, case, err, sdpa_err)


def check_all_dtypes() -> None:
    _check_all((torch.float32, torch.bfloat16, torch.float16))


def test_kernel_matches_sdpa_on_this_cpu() -> None:
    check_all_dtypes()


@pytest.fixture(scope="module")
def other_marches(
    request: pytest.FixtureRequest, march_cache: Callable[[str], Path]
) -> MarchChecks:
    """The checks of the kernel's other paths: one process per -march runs them all."""
    tests = {
        "test_other_paths_match_sdpa": "tests.engine.test_cpu_attention:check_all_dtypes",
        "test_other_paths_read_a_quantized_cache": (
            "tests.engine.test_cpu_attention:check_quantized_decode"
        ),
    }
    return MarchChecks(tests, "cpu_paged_decode", selected(request), march_cache)


@pytest.mark.parametrize("march", ["x86-64", "haswell", "skylake-avx512"])
def test_other_paths_match_sdpa(march: str, other_marches: MarchChecks) -> None:
    """The portable path, the AVX2 one and the AVX-512 one without AVX512-BF16, built for
    another -march."""
    other_marches.run("test_other_paths_match_sdpa", march)


def check_quantized_decode() -> None:
    """The decode shapes of ``CASES`` (head_dim 24-256, GQA 1-7) over int8 / fp8 caches, each
    block size, against masked SDPA over the dequantized cache (``quantized_errors``)."""
    from tests.engine.test_prefill_attention import check_quantized

    check_quantized(
        "cpu",
        [
            (heads, kv, dim, bs, list(zip(q_lens, ctx, strict=True)), None)
            for heads, kv, dim, q_lens, ctx in CASES
            for bs in (16, 8, 32)
        ],
    )


def test_kernel_reads_a_quantized_cache_on_this_cpu() -> None:
    check_quantized_decode()


@pytest.mark.parametrize("march", ["x86-64", "haswell", "skylake-avx512"])
def test_other_paths_read_a_quantized_cache(march: str, other_marches: MarchChecks) -> None:
    other_marches.run("test_other_paths_read_a_quantized_cache", march)


def test_auto_picks_the_kernel_on_cpu() -> None:
    cpu = torch.device("cpu")
    assert resolve_backend("auto", cpu) == "cpu"
    for kind in ("int8", "fp8"):  # it reads quantized caches too
        assert resolve_backend("auto", cpu, kind) == resolve_backend("cpu", cpu, kind) == "cpu"
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        resolve_backend("cpu", cpu, "int4")
    with pytest.raises(ValueError, match="CPU only"):
        resolve_backend("cpu", torch.device("cuda"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_outputs_match_the_sdpa_backend(tmp_path: Path, dtype: str) -> None:
    """Greedy continuations of a mixed batch (chunked prefill beside decode rows, several blocks
    per request) are the same with the kernel as with gather + SDPA."""
    path = make_hf_model(tmp_path / "m", "llama")
    prompts = [[1, 5, 9, 33, 7], list(range(1, 40)), [1, 42], [1, 100, 101, 102, 103] * 4]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 7, 25, 12)
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
        outs[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        m = llm.metrics()
        assert m["num_free_blocks"] == m["num_total_blocks"]
    if dtype == "float32":
        assert outs["torch"] == outs["cpu"]
    else:  # bf16 rounding differs between the two; most tokens must still agree
        same = sum(a == b for x, y in zip(outs["torch"], outs["cpu"]) for a, b in zip(x, y))
        assert same >= 0.8 * sum(len(x) for x in outs["torch"]), outs


@pytest.mark.parametrize("head_dim", [64, 20])
def test_decode_rows_are_the_same_bits_in_any_batch_and_threads(head_dim: int) -> None:
    """The decode kernel splits each row's keys in parts by the row's length alone (one task a
    part below as many rows as threads, one task a row above): a row gives the same bits alone,
    in a batch, and on one thread or two (a head size compiled as such, and one whose chunks
    are counted at run time, with a partial last one)."""
    heads, kv_heads, block_size = 8, 2, 16
    lens = [1, 16, 17, 40, 300]  # one block, a full one, a part of one key, uneven parts
    g = torch.Generator().manual_seed(3)
    blocks = sum(-(-n // block_size) for n in lens)
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        tables.append(perm[used : used + -(-n // block_size)])
        used += len(tables[-1])
    cache = torch.randn(2, blocks, block_size, kv_heads, head_dim, generator=g).bfloat16()
    q = torch.randn(len(lens), heads, head_dim, generator=g).bfloat16()
    backend = cpu_paged.CPUPagedBackend()

    def attend(rows: list[int]) -> torch.Tensor:
        table = [tables[r] for r in rows]
        layout = BatchLayout([1] * len(rows), [lens[r] for r in rows], table,
                             torch.tensor([0] * len(rows)), block_size)  # fmt: skip
        meta = backend.build_metadata(layout, torch.device("cpu"))
        out = torch.empty(len(rows), heads, head_dim, dtype=torch.bfloat16)
        backend.decode(q[rows], cache[0], cache[1], out, meta.decode_tokens, meta.block_tables,
                       meta.seq_lens, head_dim**-0.5, None)  # fmt: skip
        return out

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        batch = attend(list(range(len(lens))))
        for r in range(len(lens)):
            assert torch.equal(attend([r])[0], batch[r]), f"row {r} alone"
        torch.set_num_threads(1)
        one = attend(list(range(len(lens))))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, batch)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_row_reads_the_new_token_another_row_of_the_step_writes(threads: int) -> None:
    """A decode-only step (the kernel stores the new K/V itself) where row 0, a request admitted
    with a prefix-cache hit, reads block 1 in full while row 1 fills that block's last slot: row
    0 sees row 1's new token, as with the SDPA backend (which stores first), on any threads; a
    one-row step too (at 4 threads, its parts on different threads)."""
    torch.manual_seed(0)
    bs, kv, heads, d = 16, 2, 4, 64
    cases = [
        ([[0, 1, 2], [0, 1]], [33, 32], [2 * bs, bs + 15]),  # (the reader first)
        ([[3, 1, 0]], [40], [7]),
    ]
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for tables, lens, slots in cases:
            layout = BatchLayout([1] * len(lens), lens, tables, torch.tensor(slots), bs)
            cache = torch.randn(2, 4, bs, kv, d)
            cache.view(2, -1, kv, d)[:, slots] = float("nan")  # what no row may read
            q, k, v = (torch.randn(len(lens), h, d) for h in (heads, kv, kv))
            outs = []
            for backend in (TorchSDPABackend(), cpu_paged.CPUPagedBackend()):
                pool = cache.clone()
                meta = backend.build_metadata(layout, torch.device("cpu"))
                outs.append(backend.forward(q, k, v, pool, meta, d**-0.5))
            torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=0)
    finally:
        torch.set_num_threads(before)
