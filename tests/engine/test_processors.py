"""The engine's parts around its core: the stop rule (a pure function), the beams' sampling
parameters, and what the offline ``LLM`` leaves behind when a submission fails."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from foudre import LLM, BeamSearchParams, SamplingParams
from foudre.engine.request import Request, RequestStatus
from foudre.engine.stop import check_stop
from foudre.errors import InvalidParameterError
from foudre.sampling_params import MAX_LOGPROBS, BeamStepParams

EOS = frozenset({2})


def _request(params: SamplingParams, output: list[int]) -> Request:
    req = Request("r", [1, 5, 6], params, EOS)
    req.output_token_ids = list(output)
    return req


@pytest.mark.parametrize(
    ("params", "output", "expected"),
    [
        (SamplingParams(), [7, 2], (RequestStatus.FINISHED_STOPPED, 2)),  # end of sequence
        (SamplingParams(min_tokens=3), [7, 2], None),  # too early to stop on it
        (SamplingParams(ignore_eos=True), [7, 2], None),
        (SamplingParams(stop_token_ids=[7]), [9, 7], (RequestStatus.FINISHED_STOPPED, 7)),
        (SamplingParams(max_tokens=2), [9, 8], (RequestStatus.FINISHED_LENGTH, None)),
        (SamplingParams(max_tokens=3), [9, 8], None),
        (SamplingParams(max_tokens=None), [9] * 5, (RequestStatus.FINISHED_LENGTH, None)),
    ],
)
def test_check_stop_decides_and_changes_nothing(
    params: SamplingParams, output: list[int], expected: tuple[RequestStatus, int | None] | None
) -> None:
    req = _request(params, output)
    before = (list(req.output_token_ids), req.status, req.stop_reason)
    # max_model_len 8: the prompt's 3 tokens and 5 outputs reach it
    assert check_stop(req, output[-1], max_model_len=8) == expected
    assert (req.output_token_ids, req.status, req.stop_reason) == before


def test_beam_step_params_lift_only_the_logprobs_cap() -> None:
    with pytest.raises(InvalidParameterError, match="logprobs"):
        SamplingParams(logprobs=MAX_LOGPROBS + 1)
    params = BeamStepParams(temperature=0.0, max_tokens=None, logprobs=3 * MAX_LOGPROBS)
    assert params.logprobs == 3 * MAX_LOGPROBS
    with pytest.raises(InvalidParameterError, match="temperature"):
        BeamStepParams(temperature=-1.0, logprobs=3 * MAX_LOGPROBS)  # every other check runs
    for copied in (
        pickle.loads(pickle.dumps(params)),
        copy.deepcopy(params),
        dataclasses.replace(params, seed=3),
    ):
        assert type(copied) is BeamStepParams and copied.logprobs == params.logprobs


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=128)  # the embedded model


def test_a_refused_prompt_leaves_no_beam_behind(llm: LLM) -> None:
    params = BeamSearchParams(beam_width=2, max_tokens=4)
    with pytest.raises(InvalidParameterError, match="prompt"):
        llm.beam_search(["Once upon a time", [10**9]], params)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.metrics()["num_used_blocks"] == 0


def test_a_refused_prompt_leaves_no_best_of_sample_behind(llm: LLM) -> None:
    params = SamplingParams(n=1, best_of=2, max_tokens=4, seed=1)
    with pytest.raises(InvalidParameterError, match="prompt"):
        llm.generate(["Once upon a time", [10**9]], params)
    assert not llm.engine.has_unfinished_requests()
    # the next call runs only its own requests
    [out] = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out.outputs) == 1 and len(out.outputs[0].token_ids) == 4
    assert not llm.engine.has_unfinished_requests()


def test_stream_refuses_best_of(llm: LLM) -> None:
    with pytest.raises(InvalidParameterError, match="best_of"):
        next(llm.stream("Once upon a time", SamplingParams(best_of=3)))
    assert not llm.engine.has_unfinished_requests()


def test_closing_a_stream_early_frees_its_request(llm: LLM) -> None:
    stream = llm.stream("Once upon a time", SamplingParams(temperature=0.0, max_tokens=32))
    assert next(stream)
    stream.close()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.metrics()["num_used_blocks"] == 0


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=6, stop=[" the"]),  # stop strings
        SamplingParams(n=2, best_of=3, max_tokens=5, seed=4, logprobs=1),  # forks and best_of
    ],
)
def test_a_final_only_group_yields_only_its_final_outputs(
    llm: LLM, params: SamplingParams, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``final_only`` (what ``LLM.generate`` asks) builds no output before a request finishes
    (one a request); the final ones equal those of the same group stepped with every output
    built."""
    engine = llm.engine
    built = [0]
    output = engine.outputs.output

    def counted(*args: object) -> object:
        built[0] += 1
        return output(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.outputs, "output", counted)
    finals, counts = [], []
    for final_only in (False, True):
        built[0] = 0
        gid = f"g{final_only}"
        ids = engine.add_group(gid, ["Once upon a time"], params, final_only=final_only)
        seen = []
        while engine.has_unfinished_requests():
            seen += engine.step()
        assert sorted(o.request_id for o in seen if o.finished) == sorted(ids)
        assert all(o.finished for o in seen) or not final_only
        counts.append(built[0])
        finals.append({o.request_id.removeprefix(gid): o for o in seen if o.finished})
    assert counts[1] == params.num_samples < counts[0]  # one output a sample, against one a step
    plain, final = finals
    assert plain.keys() == final.keys()
    for key, out in plain.items():
        a, b = out.outputs[0], final[key].outputs[0]
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
        assert a.cumulative_logprob == b.cumulative_logprob
