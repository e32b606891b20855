"""Sliding-window layers return the blocks behind their window to the pool (issue #50).

The KV-cache manager alone: a window group's table holds at most ``ceil(W / block_size) + 1``
blocks per request in decode while the full-attention group grows, the rest back in the pool;
prefix hits serve a window group from the blocks of its last window only. The layer groups of
each kind of model. Then the engine on Gemma 3 (five sliding layers in six), gpt-oss (every other
one), Mistral (every layer) and Qwen2 (the upper half) random models against transformers' greedy
tokens, float32, with prompts several windows long and a pool that could not hold the window
layers' whole contexts (the old scheme preempts there, this one does not): cold, warm (prefix
hits), preempted, chunked, ``n=2``, n-gram speculation; every block free at the end, and after
every step each row's tables in the runner's persistent batch equal the manager's (``Watch``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.attention.cache_spec import FullAttentionSpec, KVCacheGroup, kv_cache_groups
from foudre.engine.kv_cache import KVCacheManager
from foudre.engine.request import Request
from foudre.runner.step import SchedulerOutput, StepOutput
from tests.conftest import make_hf_model

BS = 4
WINDOW = 8


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=100))


def _held(kv: KVCacheManager, rid: str, group: int) -> int:
    return sum(1 for b in kv.req_tables[rid][group] if b is not kv.null_block)


def _advance(kv: KVCacheManager, req: Request, n: int) -> None:
    assert kv.allocate_slots(req, n, num_final_tokens=req.num_tokens)
    req.num_computed_tokens += n


def test_window_group_holds_its_window_and_returns_the_rest() -> None:
    kv = KVCacheManager(64, BS, windows=[None, WINDOW])
    prompt = list(range(1, 41))
    req = _request("a", prompt)
    for _ in range(0, 40, 5):  # chunked prefill: blocks go back as the chunks advance
        _advance(kv, req, 5)
        assert _held(kv, "a", 1) <= -(-(WINDOW - 1 + 5) // BS) + 1
    bound = -(-WINDOW // BS) + 1
    for t in range(40):  # decode: the full group grows, the window group stays bounded
        req.output_token_ids.append(100 + t)
        _advance(kv, req, 1)
        assert _held(kv, "a", 0) == -(-req.num_computed_tokens // BS)
        assert _held(kv, "a", 1) <= bound
        held = kv.num_held_blocks("a")
        assert kv.num_free_blocks == 64 - held
    table = kv.group_block_ids("a")[0]
    assert len(table) == len(kv.block_ids("a"))  # positions still index it
    assert set(table[: len(table) - bound]) == {64}  # the placeholder: the padding block
    kv.free(req)
    assert kv.num_free_blocks == 64

    # a prefix hit: the full group's every block, the window group's last window only
    again = _request("b", prompt + [100 + t for t in range(40)] + [7])
    hits, num_cached = kv.get_computed_blocks(again)
    assert num_cached == 80
    assert [b.block_id for b in hits[1][:-3]] == [64] * 17
    assert all(b.block_id != 64 for b in hits[1][-2:])
    assert kv.allocate_slots(again, 1, hits)
    again.num_computed_tokens = num_cached
    _advance(kv, again, 1)
    assert _held(kv, "b", 1) <= bound
    kv.free(again)
    assert kv.num_free_blocks == 64


def test_prefix_hit_stops_where_the_window_group_lost_its_blocks() -> None:
    """The longest prefix every group serves: a window group that lost (evicted) the last
    block of a prefix's window cuts the hit back to the prefix whose window it still holds."""
    kv = KVCacheManager(12, BS, windows=[None, WINDOW])
    prompt = list(range(1, 25))
    req = _request("a", prompt)
    _advance(kv, req, 24)
    window_blocks = list(kv.req_tables["a"][1])
    kv.free(req)
    kv.pool.forget(window_blocks[5])  # as if handed out again
    hits, num_cached = kv.get_computed_blocks(_request("b", [*prompt, 1]))
    assert num_cached == 20  # 24 would need window block 5; 20 reads blocks 3 and 4
    assert len(hits[0]) == 5 and kv.null_block not in hits[0]
    assert hits[1][:3] == [kv.null_block] * 3 and hits[1][3:] == window_blocks[3:5]
    b = _request("b", [*prompt, 1])
    assert kv.allocate_slots(b, 5, hits)
    assert kv.num_free_blocks == 12 - (5 + 2) - (2 + 2)  # full: 5 hits, 2 new; window: 2, 2
    kv.free(b)
    assert kv.num_free_blocks == 12


def test_kv_cache_groups() -> None:
    full, window = FullAttentionSpec(2, 16), FullAttentionSpec(2, 16, WINDOW)
    assert kv_cache_groups([full] * 3) == [KVCacheGroup(None, (0, 1, 2))]
    assert kv_cache_groups([window] * 2) == [KVCacheGroup(WINDOW, (0, 1))]
    gemma = kv_cache_groups([window] * 5 + [full])
    assert gemma[0] == KVCacheGroup(None, (5,)) and len(gemma) == 6
    assert kv_cache_groups([window, full] * 2) == [
        KVCacheGroup(None, (1, 3)),
        KVCacheGroup(WINDOW, (0, 2)),
    ]
    # layers of other shapes cannot share pages: one group, the windows over whole contexts
    assert kv_cache_groups([window, FullAttentionSpec(1, 16)]) == [KVCacheGroup(None, (0, 1))]


# -- the engine against transformers --------------------------------------------------------------

MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "gemma3": (
        "gemma3_text",
        dict(num_hidden_layers=6, sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=24),
    ),
    "gpt_oss": (
        "gpt_oss",
        dict(
            num_hidden_layers=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            head_dim=16,
            sliding_window=WINDOW,
        ),
    ),
    "mistral": ("mistral", dict(num_hidden_layers=2, sliding_window=WINDOW)),
    # the layers from max_window_layers up slide
    "qwen2": (
        "qwen2",
        dict(
            num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2
        ),
    ),
}
# prompts of several windows, two sharing a 24-token prefix (the first three run together)
PROMPTS = [
    [1, *range(10, 57)],
    [1, *range(10, 33), *range(120, 140)],
    [1, *range(60, 110)],
    [1, *range(150, 190)],
    [1, *range(200, 245)],
]
MAX_TOKENS = 16


@cache
def _setup(name: str, root: str) -> tuple[Path, list[list[int]]]:
    import transformers

    arch, shape = MODELS[name]
    path = make_hf_model(Path(root) / name, arch, **shape)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        ref = [
            hf.generate(
                torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0
            )[0, len(p) :].tolist()
            for p in PROMPTS
        ]
    return path, ref


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("swa"))


class Watch:
    """Wraps an engine's ``runner.execute``: after each step, the runner's tables of every row
    against the KV manager's; counts the rows and the continued ones."""

    def __init__(self, llm: LLM) -> None:
        engine = llm.engine
        self.kv = engine.kv
        self.runner: Any = engine.runner
        self.runner.check_slots = True
        self.rows = self.continued = self.table_changes = 0
        inner: Callable[[SchedulerOutput], StepOutput] = self.runner.execute

        def execute(scheduled: SchedulerOutput) -> StepOutput:
            out = inner(scheduled)
            self.check(scheduled)
            return out

        self.runner.execute = execute

    def check(self, scheduled: SchedulerOutput) -> None:
        batch = self.runner.input_batch
        for row in scheduled.rows:
            slot = batch.slot_of[row.request_id]
            want = self.kv.req_table_ids[row.request_id]
            got = [batch.tables.table(slot, g) for g in range(len(want))]
            assert got == want, row.request_id
            self.rows += 1
            self.continued += row.continued
            self.table_changes += bool(row.block_ids)


def _greedy(llm: LLM, n: int = 1, num_prompts: int = 3) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)
    prompts = PROMPTS[:num_prompts]
    outs = [[list(c.token_ids) for c in o.outputs] for o in llm.generate(prompts, params)]
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    llm.engine.scheduler.check_invariants()
    return outs


# the memory of blocks of every layer (``num_kv_blocks``) for three requests of 64 tokens in
# flight, each 16 blocks of full context: 48 would be needed where windows keep whole contexts
POOLS = {"gemma3": 18, "gpt_oss": 32, "mistral": 18, "qwen2": 32}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_engine_frees_window_blocks_token_identical(root: str, name: str) -> None:
    path, ref = _setup(name, root)
    llm = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=72,
        block_size=BS,
        num_kv_blocks=POOLS[name],
        max_num_batched_tokens=7,  # every prompt chunked across the window's edge
        max_num_seqs=3,
    )
    watch = Watch(llm)
    assert llm.engine.kv.num_groups == {"gemma3": 6, "gpt_oss": 2, "mistral": 1, "qwen2": 2}[name]
    expected = [[r] for r in ref[:3]]
    assert _greedy(llm) == expected
    assert llm.metrics()["num_preemptions"] == 0  # the whole contexts would not fit
    assert _greedy(llm) == expected  # warm: prefix hits
    assert llm.metrics()["prefix_cache_hits"] > 0
    assert _greedy(llm, n=2) == [[r, r] for r in ref[:3]]  # forks share, then copy
    assert llm.metrics()["num_cow_copies"] > 0
    assert watch.continued > watch.rows // 3 and watch.table_changes > 0


# step budgets under which five requests in a pool of 18 blocks (of every layer) preempt
PREEMPTING_BUDGETS = {"gemma3": 16, "gpt_oss": 7, "mistral": 32, "qwen2": 16}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_engine_preempts_and_resumes_token_identical(root: str, name: str) -> None:
    path, ref = _setup(name, root)
    llm = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=72,
        block_size=BS,
        num_kv_blocks=18,
        max_num_batched_tokens=PREEMPTING_BUDGETS[name],
        max_num_seqs=5,
    )
    watch = Watch(llm)
    assert _greedy(llm, num_prompts=5) == [[r] for r in ref]
    assert llm.metrics()["num_preemptions"] > 0
    assert watch.continued > 0


@pytest.mark.parametrize("name", sorted(MODELS))
def test_engine_speculation_within_windows_token_identical(root: str, name: str) -> None:
    """n-gram drafts verified past the computed tokens (rejected ones rolled back) while the
    window groups give their blocks back: the same greedy ids."""
    path, ref = _setup(name, root)
    llm = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=72,
        block_size=BS,
        num_kv_blocks=POOLS[name],
        max_num_batched_tokens=16,
        max_num_seqs=3,
        speculative_method="ngram",
        ngram_min=1,
        ngram_max=3,
    )
    watch = Watch(llm)
    assert _greedy(llm) == [[r] for r in ref[:3]]
    m = llm.metrics()
    assert m["spec_draft_tokens"] > 0 and m["spec_accepted_tokens"] < m["spec_draft_tokens"]
    assert watch.continued > 0  # decode rows after verifications, laid out from the slots
