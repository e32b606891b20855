"""End-to-end behaviour of the engine on stories260K: stops, aborts, errors, seeds, logprobs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from foudre import LLM, SamplingParams
from tests.conftest import make_hf_model


@pytest.fixture(scope="module")
def llm(stories_paths: tuple[str, str]) -> LLM:
    return LLM(stories_paths[0], tokenizer=stories_paths[1], max_model_len=128)


def _all_free(llm: LLM) -> bool:
    m = llm.metrics()
    return bool(m["num_free_blocks"] == m["num_total_blocks"] and m["kv_cache_usage"] == 0.0)


GREEDY_TEXT = ", there was a little girl named Lily. She loved to play outside in the park."


def test_stop_string_is_cut_and_ends_the_request(llm: LLM) -> None:
    out = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=60, stop=["girl na"])
    )[0].outputs[0]
    assert out.text == ", there was a little "
    assert out.finish_reason == "stop" and out.stop_reason == "girl na"
    full = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=60))
    assert full[0].outputs[0].text.startswith(GREEDY_TEXT)
    incl = llm.generate(
        "Once upon a time",
        SamplingParams(
            temperature=0, max_tokens=60, stop=["girl"], include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert incl.text == ", there was a little girl"
    assert _all_free(llm)


def test_stop_token_ids_eos_and_ignore_eos(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    first = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5))
    ids = first[0].outputs[0].token_ids
    stopped = llm.generate(
        "Once upon a time", SamplingParams(temperature=0, max_tokens=50, stop_token_ids=[ids[2]])
    )[0].outputs[0]
    assert stopped.token_ids == ids[:3] and stopped.finish_reason == "stop"
    assert stopped.stop_reason == ids[2]
    assert stopped.text == tok.decode(ids[:2])  # the stop token's text is not shown


def test_eos_from_the_model_config_stops_unless_ignored(tmp_path: Path) -> None:
    path = make_hf_model(tmp_path / "m", "llama")
    common = dict(dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)
    free_run = (
        LLM(str(path), **common)
        .generate(  # type: ignore[arg-type]
            [[1, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )[0]
        .outputs[0]
        .token_ids
    )
    eos = free_run[3]
    first = free_run.index(eos)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), **common)  # type: ignore[arg-type]
    out = llm.generate([[1, 7, 8]], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert out.token_ids == free_run[: first + 1] and out.finish_reason == "stop"
    ignoring = llm.generate(
        [[1, 7, 8]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    )[0].outputs[0]
    assert ignoring.token_ids == free_run and ignoring.finish_reason == "length"
    delayed = llm.generate(
        [[1, 7, 8]], SamplingParams(temperature=0, max_tokens=8, min_tokens=first + 2)
    )[0].outputs[0]
    assert len(delayed.token_ids) > first + 1 and eos not in delayed.token_ids[: first + 2]


def test_max_tokens_and_max_model_len(llm: LLM) -> None:
    out = llm.generate([[1]], SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 7 and out[0].outputs[0].finish_reason == "length"
    prompt = [1] + [300] * 120
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[
        0
    ].outputs[0]
    assert len(prompt) + len(out.token_ids) == 128 and out.finish_reason == "length"
    assert _all_free(llm)


def test_bad_requests_raise_clear_errors(llm: LLM) -> None:
    with pytest.raises(ValueError, match=r"129 tokens.*128"):
        llm.generate([[1] * 129], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 512]], SamplingParams())
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    # a bad prompt in the middle of a batch leaves nothing queued or held
    with pytest.raises(ValueError):
        llm.generate([[1, 5], [1] * 500], SamplingParams())
    assert not llm.engine.has_unfinished_requests() and _all_free(llm)


def test_abort_at_any_time_frees_blocks(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    reqs = [engine.add_request([1, 5, 6, 7] * (i + 1), params) for i in range(6)]
    for step in range(12):
        engine.step()
        if step % 2 == 0:
            victim = reqs[step // 2]
            out = engine.abort_request(victim.request_id)
            assert out is not None and out.outputs[0].finish_reason == "abort"
            engine.scheduler.check_invariants()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.abort_request(reqs[0].request_id) is None  # unknown/finished: no-op
    assert _all_free(llm)


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=1234, ignore_eos=True)
    alone = llm.generate("Once upon a time", seeded)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=10 + i, ignore_eos=True) for i in range(5)]
    batch = llm.generate(
        ["Tom had a dog", "Once upon a time", "The sun", "Lily", "A cat", "Once upon a time"],
        [others[0], seeded, others[1], others[2], others[3], others[4]],
    )
    assert batch[1].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=30, seed=99, ignore_eos=True)
    assert llm.generate("Once upon a time", other_seed)[0].outputs[0].token_ids != alone


def test_n_samples_share_the_prompt(llm: LLM) -> None:
    """The n samples fork from one computation of the prompt: one admission (one prefix-cache
    lookup), its blocks shared, the partly filled last one copied by all writers but the last."""
    before = llm.metrics()
    prompt = "Once upon a time, there was a little girl named Lily. She loved to play outside."
    out = llm.generate(prompt, SamplingParams(n=4, temperature=1.0, max_tokens=12, seed=7))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    after = llm.metrics()
    num_prompt = len(out.prompt_token_ids)
    assert after["prefix_cache_queries"] - before["prefix_cache_queries"] == num_prompt
    assert num_prompt % 16 != 0  # so the last prompt block is partly filled, then shared
    assert after["num_cow_copies"] - before["num_cow_copies"] == 3
    assert _all_free(llm) and after["num_shared_blocks"] == 0


def test_logprobs(llm: LLM) -> None:
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=5, logprobs=3))[
        0
    ].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    total = 0.0
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        ranked = list(entry.items())
        assert ranked[0][0] == token  # sampled first; greedy: it is also the top-1
        assert len(entry) == 3
        assert all(v <= 0 for v in entry.values())
        assert max(entry.values()) == entry[token]
        total += entry[token]
    assert out.cumulative_logprob is not None and math.isclose(out.cumulative_logprob, total)
