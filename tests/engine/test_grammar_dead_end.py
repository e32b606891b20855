"""A grammar that the request's own ``allowed_token_ids`` let begin but not go on: the request
ends alone with a typed error (``RequestOutput.error_code``, ``error_params``), its samples with
it, and the requests beside it are served as if it had not been there."""

from __future__ import annotations

from typing import Any

import pytest

from foudre import LLM, SamplingParams
from foudre.outputs import ErrorCode
from foudre.sampling_params import StructuredOutput

PROMPTS = ["Once upon a time", "The cat sat"]


@pytest.fixture(scope="module")
def llm(stories_paths: tuple[str, str]) -> LLM:
    model, tok = stories_paths
    return LLM(model, tokenizer=tok, num_kv_blocks=64, max_num_batched_tokens=64)


def _all_free(llm: LLM) -> bool:
    m = llm.metrics()
    return m["num_free_blocks"] == m["num_total_blocks"]


def test_dead_end_is_a_typed_error_of_that_request_alone(llm: LLM) -> None:
    tok = llm.engine.tokenizer
    assert tok is not None
    y = tok.token_bytes().index(b"y")  # "yes" can begin with it, but nothing allowed follows
    spec = StructuredOutput(choice=["yes"])
    plain = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, plain)]
    engine = llm.engine
    failed_before = llm.metrics()["num_failed_requests"]
    dead = SamplingParams(structured_output=spec, allowed_token_ids=[y], max_tokens=8, n=2)
    engine.add_group("dead", [PROMPTS[0]], dead)
    good = [engine.add_group(f"r{i}", [p], plain)[0] for i, p in enumerate(PROMPTS)]
    finals: dict[str, Any] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                finals.setdefault(out.request_id, []).append(out)
    failed = [o for rid, outs in finals.items() if rid not in good for o in outs]
    assert len(failed) == 2  # both samples, the one forked and the one not yet
    for out in failed:
        assert out.outputs[0].finish_reason == "error"
        assert out.outputs[0].token_ids == [y]  # the grammar's first token was served
        assert out.error_code is ErrorCode.GRAMMAR_DEAD_END
        assert out.error_params == ("structured_output", "allowed_token_ids")
        assert "allowed_token_ids" in (out.error or "")
    assert [finals[rid][0].outputs[0].token_ids for rid in good] == reference
    assert _all_free(llm) and engine.healthy
    # the request's own doing, not the engine's: not counted as a failed request
    assert llm.metrics()["num_failed_requests"] == failed_before


def test_a_failed_step_is_step_failed(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises is the engine's failure: ``ErrorCode.STEP_FAILED``, no parameter."""
    engine = llm.engine

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("injected fault")

    monkeypatch.setattr(engine.runner, "execute", broken)
    [out] = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4))
    assert out.outputs[0].finish_reason == "error"
    assert out.error_code is ErrorCode.STEP_FAILED and out.error_params == ()
    monkeypatch.undo()
    assert _all_free(llm)
