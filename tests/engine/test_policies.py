"""Batching policies and the non-paged baseline: same tokens, different batching."""

from __future__ import annotations

import time
from typing import Any

import pytest

from foudre import LLM, SamplingParams
from foudre.engine.policies import BatchPolicy, make_policy

PROMPTS = [[1, 403, 407, 261, 378], [1, 300, 301], [1, 5, 6, 7, 8, 9], [1, 42], [1, 77, 78]]


def _params() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=8 + 9 * i) for i in range(len(PROMPTS))]


def _llm(stories: tuple[str, str], **kw: Any) -> LLM:
    return LLM(stories[0], tokenizer=stories[1], max_model_len=128, **kw)


@pytest.fixture(scope="module")
def expected(stories_paths: tuple[str, str]) -> list[list[int]]:
    llm = _llm(stories_paths)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _params())]


@pytest.mark.parametrize("policy", ["static", "dynamic"])
def test_batch_policies_give_the_same_tokens(
    stories_paths: tuple[str, str], expected: list[list[int]], policy: str
) -> None:
    llm = _llm(stories_paths, scheduling_policy=policy, max_num_seqs=2, batch_wait_ms=0)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, _params())] == expected
    assert isinstance(llm.engine.scheduler.policy, BatchPolicy)
    assert llm.engine.scheduler.policy.num_batches == 3  # 5 requests in batches of 2, 2, 1
    # rectangular batches: the member that finishes first keeps a computed row until its partner
    # is done: (17 - 8) + (35 - 26) throw-away tokens for outputs of 8, 17 | 26, 35 | 44 tokens
    assert llm.metrics()["num_padding_tokens"] == 18
    assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]


def test_continuous_batching_computes_no_padding(stories_paths: tuple[str, str]) -> None:
    llm = _llm(stories_paths, max_num_seqs=2)
    llm.generate(PROMPTS, _params())
    assert llm.metrics()["num_padding_tokens"] == 0


def test_static_batch_runs_to_completion_before_admitting(stories_paths: tuple[str, str]) -> None:
    llm = _llm(stories_paths, scheduling_policy="static", max_num_seqs=2)
    engine = llm.engine
    reqs = [engine.add_request(p, s) for p, s in zip(PROMPTS, _params(), strict=True)]
    engine.set_draining(True)  # the last batch of one must not wait for a partner
    first_batch = {reqs[0].request_id, reqs[1].request_id}
    running_sets = []
    while engine.has_unfinished_requests():
        engine.step()
        running_sets.append({r.request_id for r in engine.scheduler.running})
    # request 0 finishes early (8 tokens); request 2 still waits until request 1 is done too
    first_done = next(i for i, s in enumerate(running_sets) if reqs[0].request_id not in s)
    assert running_sets[first_done] == {reqs[1].request_id}
    assert all(s <= first_batch for s in running_sets[: first_done + 1])
    assert any(reqs[2].request_id in s for s in running_sets)


def test_static_waits_for_a_full_batch_unless_flushed(stories_paths: tuple[str, str]) -> None:
    llm = _llm(stories_paths, scheduling_policy="static", max_num_seqs=3)
    engine = llm.engine
    engine.add_request(PROMPTS[0], _params()[0])
    for _ in range(3):
        assert engine.step() == [] and engine.stalled
    engine.add_request(PROMPTS[1], _params()[1])
    engine.add_request(PROMPTS[2], _params()[2])
    engine.step()
    assert engine.metrics()["num_scheduled_last_step"] == 3
    for _ in range(200):
        engine.step()
    assert not engine.has_unfinished_requests()


def test_dynamic_batches_what_arrived_within_the_window() -> None:
    from foudre.engine.request import Request

    policy = make_policy("dynamic", 4, batch_wait_ms=50)
    now = time.monotonic()
    old = Request("a", [1], SamplingParams(), arrival_time=now - 1.0)
    fresh = Request("b", [1], SamplingParams(), arrival_time=now)
    assert policy.admissible([fresh], 0, now) == 0  # the window is still open
    assert policy.admissible([old, fresh], 0, now) == 2  # the oldest waited long enough
    late = Request("c", [1], SamplingParams(), arrival_time=now - 1.0)
    assert policy.admissible([late], 2, now) == 0  # batch running: the newcomer waits
    policy.on_finish(old)
    policy.on_finish(fresh)
    assert policy.admissible([late], 0, now) == 1


def test_non_paged_baseline_same_tokens_fewer_concurrent(
    stories_paths: tuple[str, str], expected: list[list[int]]
) -> None:
    # 40 blocks of 16 = 640 tokens: 5 requests of max_model_len 128 fit contiguously, so use 24
    paged = _llm(stories_paths, num_kv_blocks=24)
    contiguous = _llm(stories_paths, num_kv_blocks=24, kv_allocation="contiguous")
    peak = {}
    for name, llm in (("paged", paged), ("contiguous", contiguous)):
        engine = llm.engine
        for p, s in zip(PROMPTS, _params(), strict=True):
            engine.add_request(p, s)
        peak[name] = 0
        outs = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = o.outputs[0].token_ids
            peak[name] = max(peak[name], len(engine.scheduler.running))
        assert sorted(outs.values()) == sorted(expected)
        assert llm.metrics()["num_free_blocks"] == 24
    assert peak["contiguous"] == 24 // 8  # each request reserves 128 / 16 = 8 blocks
    assert peak["paged"] == len(PROMPTS)
