"""Every optimisation gives the same greedy fp32 tokens as the plain path (GUIDE section 5)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from foudre import LLM, SamplingParams
from tests.conftest import SHARED, make_hf_model

STORY_PREFIX = (
    "Once upon a time, in a small village, there lived a kind old man who loved to grow "
    "flowers. Every morning he watered them and sang a little song."
)
SUFFIXES = [
    " One day a bird",
    " His dog",
    " Then, a little girl named Sue came by and asked",
    " The sun",
    " It was a very windy day and",
    " He",
]


@pytest.fixture(scope="module")
def stories(stories_paths: tuple[str, str]) -> tuple[str, str]:
    return stories_paths


def _prompts(llm: LLM) -> list[list[int]]:
    tok = llm.get_tokenizer()
    return [tok.encode(STORY_PREFIX + s) for s in SUFFIXES] + [tok.encode("Tom and"), [1]]


def _params(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0.0, max_tokens=20 + 13 * i) for i in range(n)]


def _generate(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams] | None = None
) -> list[list[int]]:
    outs = llm.generate(prompts, params or _params(len(prompts)))
    _assert_all_free(llm)
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_free(llm: LLM) -> None:
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    assert m["kv_cache_usage"] == 0.0
    llm.engine.scheduler.check_invariants()


def _llm(model: tuple[str, str], **kwargs: Any) -> LLM:
    return LLM(model[0], tokenizer=model[1], dtype="float32", max_model_len=256, **kwargs)


@pytest.fixture(scope="module")
def baseline(stories: tuple[str, str]) -> tuple[list[list[int]], list[list[int]]]:
    """Reference outputs: no prefix caching, whole prompts, one request at a time."""
    llm = _llm(stories, enable_prefix_caching=False)
    prompts = _prompts(llm)
    params = _params(len(prompts))
    return prompts, [_generate(llm, [p], [s])[0] for p, s in zip(prompts, params, strict=True)]


def test_batch_equals_single_requests(stories: tuple[str, str], baseline: Any) -> None:
    prompts, expected = baseline
    llm = _llm(stories, enable_prefix_caching=False)
    assert _generate(llm, prompts) == expected


def test_prefix_caching_hits_and_matches_cold_runs(stories: tuple[str, str], baseline: Any) -> None:
    prompts, expected = baseline
    llm = _llm(stories, enable_prefix_caching=True)
    assert _generate(llm, prompts) == expected  # shared prefix hit within one batch
    hits_first = llm.metrics()["prefix_cache_hits"]
    assert hits_first > 0
    assert _generate(llm, prompts) == expected  # warm cache: whole prompts hit
    m = llm.metrics()
    assert m["prefix_cache_hits"] > hits_first
    assert m["prefix_cache_queries"] >= m["prefix_cache_hits"]


def test_preemption_matches_uninterrupted(stories: tuple[str, str], baseline: Any) -> None:
    prompts, expected = baseline
    for caching in (False, True):
        llm = _llm(stories, num_kv_blocks=18, enable_prefix_caching=caching)
        assert _generate(llm, prompts) == expected
        assert llm.metrics()["num_preemptions"] > 0


def test_chunked_prefill_matches_whole_prompts(stories: tuple[str, str], baseline: Any) -> None:
    prompts, expected = baseline
    for budget in (3, 7, 16):
        llm = _llm(stories, max_num_batched_tokens=budget, enable_prefix_caching=False)
        assert _generate(llm, prompts) == expected


def test_everything_at_once_on_random_hf_model(tmp_path: Path) -> None:
    """Small pool + tiny budget + prefix caching + few seats on a GQA model with head_dim 32."""
    path = make_hf_model(tmp_path / "m", "qwen2", head_dim=32, num_key_value_heads=1)
    common = dict(dtype="float32", skip_tokenizer_init=True, max_model_len=128, block_size=4)
    prompts = [[1, *range(10, 10 + k)] + [7] * (i + 1) for i, k in enumerate([30, 30, 12, 45, 3])]
    params = [
        SamplingParams(temperature=0.0, max_tokens=30 + 5 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    plain = LLM(str(path), enable_prefix_caching=False, **common)  # type: ignore[arg-type]
    expected = [plain.generate([p], [s])[0].outputs[0].token_ids for p, s in zip(prompts, params)]
    fancy = LLM(
        str(path),
        num_kv_blocks=32,
        max_num_batched_tokens=5,
        max_num_seqs=3,
        **common,  # type: ignore[arg-type]
    )
    got = [o.outputs[0].token_ids for o in fancy.generate(prompts, params)]
    assert got == expected
    m = fancy.metrics()
    assert m["num_preemptions"] > 0 and m["prefix_cache_hits"] > 0
    _assert_all_free(fancy)


def test_shared_data_present() -> None:
    # the suite relies on ../shared; make its absence loud rather than silently skipping
    assert (SHARED / "models" / "stories260K" / "stories260K.bin").exists()


def test_decode_bands_of_context_lengths(stories: tuple[str, str]) -> None:
    """Decode rows whose contexts span 2 to ~400 tokens run as several attention calls (bands
    within a factor of two); each request gets the tokens it gets alone."""
    from foudre.attention.torch_sdpa import decode_groups

    lens = [3, 400, 5, 9, 17, 33, 65, 129, 257, 4, 6, 8, 10, 12, 14, 16, 18, 20, 200, 300]
    bands = decode_groups(list(range(len(lens))), lens, min_rows=4)
    assert sorted(r for band in bands for r in band) == list(range(len(lens)))
    assert len(bands) > 2
    for band in bands:
        ctx = [lens[r] for r in band]
        assert ctx == sorted(ctx) and all(c <= 2 * ctx[0] for c in ctx[4:])
    assert all(len(band) >= 4 for band in bands[:-1])
    assert [lens[r] for r in bands[0]] == [3, 4, 5, 6]  # full: the next, 8, is over 2 x 3

    llm = LLM(stories[0], tokenizer=stories[1], max_model_len=512)
    words = (STORY_PREFIX + " " + " ".join(SUFFIXES)).split()
    tok = llm.get_tokenizer()
    prompts = [tok.encode(" ".join((words * 8)[: n // 2 + 1])) for n in lens]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    alone = [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert together == alone
    assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]
