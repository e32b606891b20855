"""Oracle: beam search against Hugging Face ``transformers`` ``generate(num_beams=B)`` on the same
random weights: every returned hypothesis, in order, token for token."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, BeamSearchParams
from foudre.errors import InvalidParameterError
from tests.conftest import make_hf_model

PROMPTS = [[1, 5, 9, 33, 7], [1, 42], list(range(1, 30)), [1, 100, 101, 102, 103, 104, 3]]
MAX_NEW = 10
ARCHS = {"llama-gqa": ("llama", {}), "qwen2": ("qwen2", {}), "mistral": ("mistral", {})}


def _hf_beams(
    hf: Any, prompt: list[int], width: int, eos: int | None, **kw: Any
) -> list[list[int]]:
    hf.generation_config.eos_token_id = eos
    hf.generation_config.pad_token_id = 0
    out = hf.generate(
        torch.tensor([prompt]),
        num_beams=width,
        num_return_sequences=width,
        do_sample=False,
        max_new_tokens=MAX_NEW,
        **kw,
    )
    beams = []
    for seq in out.tolist():
        gen = seq[len(prompt) :]
        if eos is not None and eos in gen:  # what follows the end of sequence is padding
            gen = gen[: gen.index(eos) + 1]
        beams.append(gen)
    return beams


@pytest.fixture(scope="module", params=sorted(ARCHS))
def models(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import transformers

    arch, overrides = ARCHS[request.param]
    path = make_hf_model(tmp_path_factory.mktemp(request.param), arch, **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # an end-of-sequence token that beams actually produce: the most common generated token
    counts: Counter[int] = Counter()
    for p in PROMPTS:
        for beam in _hf_beams(hf, p, 4, None):
            counts.update(beam)
    eos = counts.most_common(1)[0][0]
    # the engine reads its end-of-sequence id from the checkpoint, as transformers does
    path = make_hf_model(
        tmp_path_factory.mktemp(request.param), arch, eos_token_id=eos, **overrides
    )
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=256)
    return hf, llm, eos


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize(
    ("length_penalty", "early_stopping"), [(1.0, False), (0.0, True), (2.0, "never"), (-1.0, False)]
)
@pytest.mark.parametrize("use_eos", [False, True])
def test_beams_match_transformers(
    models: Any, width: int, length_penalty: float, early_stopping: bool | str, use_eos: bool
) -> None:
    hf, llm, eos = models
    params = BeamSearchParams(
        beam_width=width,
        max_tokens=MAX_NEW,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
        ignore_eos=not use_eos,
    )
    ours = llm.beam_search(PROMPTS, params)  # every prompt in one continuous batch
    stopped = 0
    for prompt, out in zip(PROMPTS, ours, strict=True):
        ref = _hf_beams(
            hf,
            prompt,
            width,
            eos if use_eos else None,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        )
        assert [s.token_ids for s in out.sequences] == ref, (prompt, width)
        scores = [s.score for s in out.sequences]
        assert scores == sorted(scores, reverse=True)
        for s in out.sequences:
            assert s.finish_reason == ("stop" if use_eos and s.token_ids[-1] == eos else "length")
            stopped += s.finish_reason == "stop"
    if use_eos and width >= 4 and length_penalty <= 1.0:
        assert stopped > 0  # the end-of-sequence path was exercised
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"] and m["num_shared_blocks"] == 0


def test_beams_share_blocks_and_copy_on_write(models: Any) -> None:
    _, llm, _ = models
    before = llm.metrics()["num_cow_copies"]
    llm.beam_search([list(range(1, 30))], BeamSearchParams(beam_width=4, max_tokens=8))
    assert llm.metrics()["num_cow_copies"] > before


def test_bad_beam_parameters(models: Any) -> None:
    _, llm, _ = models
    for kwargs, param in [
        (dict(beam_width=0), "beam_width"),
        (dict(beam_width=2, temperature=0.7), "temperature"),
        (dict(beam_width=2, early_stopping="sometimes"), "early_stopping"),
        (dict(beam_width=2, max_tokens=0), "max_tokens"),
    ]:
        with pytest.raises(InvalidParameterError) as info:
            BeamSearchParams(**kwargs)
        assert info.value.param == param
    with pytest.raises(InvalidParameterError) as info:
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=10_000))
    assert info.value.param == "beam_width"


def test_beam_search_refuses_speculative_decoding(tmp_path: Path) -> None:
    path = make_hf_model(tmp_path / "m", "llama")
    llm = LLM(str(path), skip_tokenizer_init=True, num_kv_blocks=64, speculative_method="ngram")
    with pytest.raises(InvalidParameterError, match="speculative") as info:
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=2))
    assert info.value.param == "beam_width"


def test_beams_survive_preemption(tmp_path: Path) -> None:
    """A pool too small for every search at once: cohorts are preempted and recomputed
    together, and the hypotheses are the same as with room to spare."""
    path = make_hf_model(tmp_path / "m", "llama")
    params = BeamSearchParams(beam_width=4, max_tokens=MAX_NEW, ignore_eos=True)
    roomy = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=256)
    tight = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=32,
                block_size=4, max_num_seqs=12, max_model_len=128)  # fmt: skip
    prompts = [list(range(1, 21)), [1, 5, 9, 33, 7] * 4, [1, 42] * 6]
    want = [[s.token_ids for s in o.sequences] for o in roomy.beam_search(prompts, params)]
    got = [[s.token_ids for s in o.sequences] for o in tight.beam_search(prompts, params)]
    assert got == want
    m = tight.metrics()
    assert m["num_preemptions"] > 0 and m["num_free_blocks"] == m["num_total_blocks"]
    with pytest.raises(InvalidParameterError, match="KV blocks"):
        tight.beam_search([list(range(1, 60))], BeamSearchParams(beam_width=4, max_tokens=60))
