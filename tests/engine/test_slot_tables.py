"""The runner's per-slot block tables, counts and tokens (``runner/slot_tables.py``), kept by
the scheduler's deltas: after every step each row's tables in the runner equal the KV manager's
(every cache group), and every continued decode row's gathered position and token equal the
row's own (``ModelRunner.check_slots``): through preemption, copy-on-write (``n`` samples),
sliding windows, prefix hits, chunked prefill and speculative decoding in
``test_sliding_window_cache``'s engine tests (its ``Watch``, on every model there), through beam
search here; the greedy tokens and beams still those of Hugging Face ``transformers``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from foudre import LLM, BeamSearchParams
from foudre.attention.base import BatchLayout
from foudre.attention.paged import PagedBackend
from foudre.attention.torch_sdpa import TorchSDPABackend
from foudre.runner.slot_tables import SlotTables
from tests.conftest import make_hf_model
from tests.engine.test_sliding_window_cache import Watch
from tests.oracles.test_beam_search import _hf_beams


def test_beam_search_matches_transformers(tmp_path: Path) -> None:
    """Beams fork (sharing blocks, copied on write) and take tokens the runner did not sample
    for them: those rows are not continued, and the beams are still ``transformers``'."""
    import transformers

    path = make_hf_model(tmp_path / "m", "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    watch = Watch(llm)
    prompts = [[1, 5, 9, 33, 7], list(range(1, 30))]
    out = llm.beam_search(prompts, BeamSearchParams(beam_width=4, max_tokens=10))
    for prompt, result in zip(prompts, out, strict=True):
        assert [s.token_ids for s in result.sequences] == _hf_beams(hf, prompt, 4, None)
    assert llm.metrics()["num_cow_copies"] > 0
    assert 0 < watch.continued < watch.rows


def test_slot_tables_apply_gather_and_refuse_a_lost_change() -> None:
    tables = SlotTables(2, 2, width=2)
    tables.apply(1, 0, 0, [4, 5, 6])  # widens
    tables.apply(1, 0, 1, [9])  # a copy replaced block 1; the table ends there
    tables.apply(0, 0, 0, [3])
    tables.apply(0, 1, 0, [7, 8])
    assert tables.table(1) == [4, 9] and tables.table(0) == [3] and tables.table(0, 1) == [7, 8]
    rows = tables.gather(0, torch.tensor([1, 0]), num_padding_rows=1, padding_block=99)
    assert rows[:, :1].tolist() == [[4], [3], [99]] and rows[0, :2].tolist() == [4, 9]
    tables.apply(1, 0, 2, [10, 11, 12])  # a long table: other steps' stay as wide as theirs
    assert tables.gather(0, np.array([0])).tolist() == [[3]]
    assert tables.gather(0, np.array([0, 1])).shape == (2, 5)
    tables.reset(1)
    assert tables.table(1) == []
    with pytest.raises(ValueError, match="table_start"):
        tables.apply(1, 0, 2, [1])
    tables.grow(5)
    assert tables.table(0) == [3] and tables.capacity == 5


LISTS = [[3, 1], [2], [5, 6, 7]]
# the same tables as the runner gathers them: entries past each row's blocks are stale ids
TENSOR = torch.tensor([[3, 1, 8], [2, 9, 9], [5, 6, 7]], dtype=torch.int32)
Q_LENS, SEQ_LENS = [1, 3, 2], [20, 12, 40]


def _layout(tables: Any) -> BatchLayout:
    slots = [t[p // 16] * 16 + p % 16 for t, q, c in zip(LISTS, Q_LENS, SEQ_LENS) for p in
             range(c - q, c)]  # fmt: skip
    return BatchLayout(Q_LENS, SEQ_LENS, tables, torch.tensor(slots), 16)


@pytest.mark.parametrize("window", [None, 8])
def test_sdpa_reads_the_same_from_tables_as_tensors(window: int | None) -> None:
    """The reference backend's attention over tables given as a tensor with stale entries
    equals its attention over the lists."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 10, 16, 2, 8, generator=gen)
    q, k, v = (torch.randn(6, h, 8, generator=gen) for h in (4, 2, 2))
    backend = TorchSDPABackend()
    outs = []
    for tables in (LISTS, TENSOR):
        meta = backend.build_metadata(_layout(tables), torch.device("cpu"))
        outs.append(backend.forward(q, k, v, cache.clone(), meta, 0.3, window))
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)


def test_paged_metadata_reads_the_same_blocks_from_tensors() -> None:
    """The paged kernels' tables from a tensor hold each row's blocks as the lists do (the
    entries a kernel reads: the first ``ceil(seq_len / block_size)``)."""
    backend = PagedBackend()
    a, b = (backend.build_metadata(_layout(t), torch.device("cpu")) for t in (LISTS, TENSOR))
    rows = [(a.block_tables, b.block_tables, [0]), (a.prefill.block_tables,
            b.prefill.block_tables, [1, 2])]  # fmt: skip
    for ta, tb, which in rows:
        for i, r in enumerate(which):
            n = -(-SEQ_LENS[r] // 16)
            assert ta[i, :n].tolist() == tb[i, :n].tolist() == LISTS[r][:n]
    assert torch.equal(a.slot_mapping, b.slot_mapping)


def test_worker_tables_follow_the_messages_changes() -> None:
    """A parallel worker keeps each request's table from the steps' changes (the engine's
    tables after each step: a growing table, a copy replacing a block, a request that left and
    came back whole), padding rows' tables whole."""
    from foudre.distributed.runner import StepMessage

    held: dict[str, list[int]] = {}

    def step(
        rows: list[tuple[str, int, list[int]]], removed: tuple[str, ...] = ()
    ) -> list[list[int]]:
        message = StepMessage(
            [ids for _, _, ids in rows] + [[99]],
            [0] * (len(rows) + 1),
            [[0]] * (len(rows) + 1),
            [1] * (len(rows) + 1),
            num_padding_rows=1,
            request_ids=[rid for rid, _, _ in rows],
            table_starts=[start for _, start, _ in rows],
            removed=list(removed),
        )
        return message.tables(held)

    assert step([("a", 0, [1, 2]), ("b", 0, [3])]) == [[1, 2], [3], [99]]
    assert step([("a", 2, []), ("b", 0, [7, 8])]) == [[1, 2], [7, 8], [99]]
    assert step([("a", 1, [5, 6])]) == [[1, 5, 6], [99]]
    assert step([("a", 0, [9])], removed=("a", "b")) == [[9], [99]] and "b" not in held
    with pytest.raises(ValueError, match="table_start"):
        step([("c", 2, [4])])
