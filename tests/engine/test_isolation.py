"""One request never fails another: admission checks against the vocabulary, a step that raises
fails only the request that causes it, prefix-cache namespaces (cache_salt), request groups."""

from __future__ import annotations

from typing import Any

import pytest

from foudre import LLM, SamplingParams
from foudre.errors import InvalidParameterError, PromptTooLongError
from foudre.runner.step import SchedulerOutput, StepOutput

PROMPTS = [[1, 403, 407, 261], [1, 50, 60, 70, 80, 90] * 5, [1, 7, 8], [1, 300, 301] * 7]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(stories_paths: tuple[str, str]) -> LLM:
    model, tok = stories_paths
    return LLM(model, tokenizer=tok, num_kv_blocks=64, max_num_batched_tokens=64)


def _all_free(llm: LLM) -> bool:
    m = llm.metrics()
    return m["num_free_blocks"] == m["num_total_blocks"]


@pytest.mark.parametrize(
    ("field", "params"),
    [
        ("stop_token_ids", dict(stop_token_ids=[512])),
        ("stop_token_ids", dict(stop_token_ids=[10**30])),
        ("logit_bias", dict(logit_bias={512: 1.0})),
        ("allowed_token_ids", dict(allowed_token_ids=[3, 9000])),
        ("top_k", dict(top_k=513)),
    ],
)
def test_token_ids_outside_the_vocabulary_are_refused_at_admission(
    llm: LLM, field: str, params: dict[str, Any]
) -> None:
    with pytest.raises(InvalidParameterError) as info:
        llm.generate("Once", SamplingParams(max_tokens=8, min_tokens=2, **params))
    assert info.value.param == field
    assert _all_free(llm) and not llm.engine.has_unfinished_requests()


def test_typed_admission_errors(llm: LLM) -> None:
    with pytest.raises(PromptTooLongError) as info:
        llm.generate([[5] * 600])
    assert (info.value.num_tokens, info.value.max_model_len, info.value.param) == (
        600,
        512,
        "prompt",
    )
    with pytest.raises(InvalidParameterError) as bad:
        llm.generate([[1, 512]])
    assert bad.value.param == "prompt"
    with pytest.raises(InvalidParameterError) as seed:
        SamplingParams(seed=2**64)
    assert seed.value.param == "seed"
    for name in ("temperature", "top_p", "repetition_penalty", "presence_penalty"):
        with pytest.raises(InvalidParameterError) as inf:
            SamplingParams(**{name: float("inf")})
        assert inf.value.param == name


def test_a_group_is_added_all_or_none(llm: LLM) -> None:
    engine = llm.engine
    # the third child's seed overflows: nothing of the group may stay queued
    with pytest.raises(InvalidParameterError) as info:
        engine.add_group("g", ["Once"], SamplingParams(n=3, seed=2**63 - 2, max_tokens=4))
    assert info.value.param == "seed"
    with pytest.raises(InvalidParameterError):  # a bad prompt among good ones
        engine.add_group("g", ["Once", [1, 99999]], SamplingParams(n=2, max_tokens=4))
    assert not engine.has_unfinished_requests() and _all_free(llm)
    ids = engine.add_group("g", ["Once", [1, 50]], SamplingParams(n=2, max_tokens=4))
    assert ids == ["g-0", "g-1", "g-2", "g-3"]
    with pytest.raises(InvalidParameterError):
        engine.add_group("g", ["x"], SamplingParams())  # the id is taken while it runs
    engine.step()
    aborted = engine.abort_group("g")
    assert sorted(o.request_id for o in aborted) == ids
    assert all(o.outputs[0].finish_reason == "abort" for o in aborted)
    assert engine.abort_group("g") == [] and not engine.has_unfinished_requests()
    assert _all_free(llm)


def test_stream_yields_the_generated_text(llm: LLM) -> None:
    [ref] = llm.generate(["Once upon a time"], GREEDY)
    pieces = list(llm.stream("Once upon a time", GREEDY))
    assert "".join(pieces) == ref.outputs[0].text and len(pieces) > 1
    stream = llm.stream("Once upon a time", GREEDY)
    next(stream)
    stream.close()  # closing early aborts it
    assert not llm.engine.has_unfinished_requests() and _all_free(llm)


class Poisoned:
    """``runner.execute`` that raises whenever a step contains ``poison``."""

    def __init__(self, execute: Any, poison: str) -> None:
        self.execute = execute
        self.poison = poison
        self.failed_steps: list[list[str]] = []

    def __call__(self, scheduled: SchedulerOutput) -> StepOutput:
        ids = [row.request_id for row in scheduled.rows]
        if self.poison in ids:
            self.failed_steps.append(ids)
            raise RuntimeError("injected fault")
        result: StepOutput = self.execute(scheduled)
        return result


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_failing_request_fails_alone(
    stories_paths: tuple[str, str], monkeypatch: pytest.MonkeyPatch, prefix_caching: bool
) -> None:
    model, tok = stories_paths
    llm = LLM(model, tokenizer=tok, num_kv_blocks=64, enable_prefix_caching=prefix_caching)
    engine = llm.engine
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    engine.reset_prefix_cache()
    for cache in engine.runner.kv_caches:  # K/V a failed step leaves unwritten is garbage
        cache.normal_()
    poisoned = Poisoned(engine.runner.execute, "bad")
    monkeypatch.setattr(engine.runner, "execute", poisoned)
    good = [engine.add_group(f"r{i}", [p], GREEDY)[0] for i, p in enumerate(PROMPTS)]
    engine.add_group("bad", [PROMPTS[0]], GREEDY)
    finals: dict[str, Any] = {}
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
        engine.scheduler.check_invariants()
    assert finals["bad"].outputs[0].finish_reason == "error"
    assert "injected fault" in (finals["bad"].error or "")
    assert [finals[rid].outputs[0].token_ids for rid in good] == reference
    assert all(finals[rid].outputs[0].finish_reason == "length" for rid in good)
    assert len(poisoned.failed_steps[0]) > 1 and poisoned.failed_steps[-1] == ["bad"]
    m = llm.metrics()
    assert m["num_step_failures"] == len(poisoned.failed_steps) and m["num_failed_requests"] == 1
    assert _all_free(llm) and engine.healthy
    # nothing the failed steps hashed is served from the prefix cache: same outputs again
    monkeypatch.setattr(engine.runner, "execute", poisoned.execute)
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)] == reference


def test_an_engine_that_cannot_step_turns_unhealthy(
    llm: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(scheduled: SchedulerOutput) -> StepOutput:
        raise RuntimeError("device lost")

    monkeypatch.setattr(llm.engine.runner, "execute", broken)
    outs = llm.generate(PROMPTS * 3, GREEDY)  # every request fails, each alone; none hangs
    assert {o.outputs[0].finish_reason for o in outs} == {"error"}
    assert not llm.engine.healthy and _all_free(llm)
    monkeypatch.undo()
    llm.generate(PROMPTS[:1], GREEDY)
    assert llm.engine.healthy


def test_cache_salt_separates_prefix_caches(llm: LLM) -> None:
    engine = llm.engine
    prompt = [1, *range(20, 80)]  # 61 tokens: 3 full blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=2)

    def cached(group: str, salt: str | None) -> int:
        engine.add_group(group, [prompt], params, cache_salt=salt)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    hit = out.num_cached_tokens
        return hit

    assert cached("a1", "tenant-a") == 0
    assert cached("a2", "tenant-a") == 48  # same tenant: its blocks are hits
    assert cached("b1", "tenant-b") == 0  # another tenant never hits them
    assert cached("n1", None) == 0  # nor does an unsalted request
    assert cached("n2", None) == 48


def test_n_samples_fit_where_copies_would_not(stories_paths: tuple[str, str]) -> None:
    """256 prompt tokens, n=8, 16 new tokens each, prefix caching off: shared, it takes 16 + 8
    blocks of 16 tokens; a copy per sample would need 8 * 17 = 136. A pool of 48 serves it
    without a preemption."""
    model, tok = stories_paths
    llm = LLM(model, tokenizer=tok, num_kv_blocks=48, enable_prefix_caching=False)
    prompt = [1, *[(7 * i) % 500 + 3 for i in range(255)]]
    params = SamplingParams(n=8, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)
    [out] = llm.generate([prompt], params)
    assert len(out.outputs) == 8 and all(len(c.token_ids) == 16 for c in out.outputs)
    m = llm.metrics()
    assert m["num_preemptions"] == 0 and m["peak_kv_cache_usage"] <= 24 / 48
    assert _all_free(llm)
    # the same samples as eight independent requests with the seeds the group gives them
    solo = LLM(model, tokenizer=tok, num_kv_blocks=200, enable_prefix_caching=False)
    alone = [
        solo.generate([prompt], SamplingParams(temperature=1.0, seed=3 + j, max_tokens=16,
                                               ignore_eos=True))[0].outputs[0].token_ids
        for j in range(8)
    ]  # fmt: skip
    assert [c.token_ids for c in out.outputs] == alone


def test_best_of_returns_the_n_most_likely(llm: LLM) -> None:
    params = SamplingParams(n=2, best_of=5, temperature=1.0, seed=11, max_tokens=10)
    [out] = llm.generate(["Once upon a time"], params)
    assert [c.index for c in out.outputs] == [0, 1]
    assert all(c.logprobs is None and c.cumulative_logprob is None for c in out.outputs)
    every = llm.generate(
        ["Once upon a time"],
        SamplingParams(n=5, temperature=1.0, seed=11, max_tokens=10, logprobs=0),
    )[0].outputs
    ranked = sorted(every, key=lambda c: -(c.cumulative_logprob or 0.0))
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in ranked[:2]]
    with pytest.raises(InvalidParameterError) as info:
        SamplingParams(n=3, best_of=2)
    assert info.value.param == "best_of"
    assert _all_free(llm)


def test_more_samples_than_seats_is_refused(stories_paths: tuple[str, str]) -> None:
    model, tok = stories_paths
    llm = LLM(model, tokenizer=tok, num_kv_blocks=64, max_num_seqs=4)
    for params, name in ((SamplingParams(n=5), "n"), (SamplingParams(n=2, best_of=5), "best_of")):
        with pytest.raises(InvalidParameterError) as info:
            llm.generate(["Once"], params)
        assert info.value.param == name
    assert not llm.engine.has_unfinished_requests()
    assert len(llm.generate(["Once"], SamplingParams(n=4, max_tokens=3))[0].outputs) == 4


def test_samples_with_speculative_decoding(stories_paths: tuple[str, str]) -> None:
    model, tok = stories_paths
    params = SamplingParams(n=3, temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["Once upon a time", [1, 50, 60, 50, 60, 50, 60, 50, 60, 50, 60, 50]]
    plain = LLM(model, tokenizer=tok, num_kv_blocks=64).generate(prompts, params)
    # budget 7: prompt chunks leave one token now and then, where drafts would be proposed
    spec = LLM(model, tokenizer=tok, num_kv_blocks=64, speculative_method="ngram",
               max_num_batched_tokens=7)  # fmt: skip
    got = spec.generate(prompts, params)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in plain
    ]
    assert _all_free(spec)


def test_a_failing_prompt_fails_its_unforked_samples_with_it(
    stories_paths: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    model, tok = stories_paths
    llm = LLM(model, tokenizer=tok, num_kv_blocks=64)
    engine = llm.engine
    poisoned = Poisoned(engine.runner.execute, "bad-0")
    monkeypatch.setattr(engine.runner, "execute", poisoned)
    good = engine.add_group("good", [PROMPTS[1]], GREEDY)
    bad = engine.add_group("bad", [PROMPTS[0]], SamplingParams(n=3, max_tokens=5))
    finals = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert {finals[rid].outputs[0].finish_reason for rid in bad} == {"error"}
    assert finals[good[0]].outputs[0].finish_reason == "length"
    assert llm.metrics()["num_step_failures"] == 2  # the batch, then the culprit alone
    assert _all_free(llm)
