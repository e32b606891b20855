"""Oracle: stories260K greedy from BOS equals llama2.c (its published text and a port of run.c)."""

from __future__ import annotations

from pathlib import Path

from foudre import LLM, SamplingParams
from tests.oracles.llama2c_reference import Llama2cReference

PUBLISHED = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball. She wanted to play with it, but it was too high."
)


def test_greedy_200_steps_matches_llama2c(stories_paths: tuple[str, str]) -> None:
    model, tok = stories_paths
    llm = LLM(model, tokenizer=tok)
    out = llm.generate([[1]], SamplingParams(temperature=0.0, max_tokens=200))[0].outputs[0]
    reference = Llama2cReference(Path(model)).greedy(1, 200)
    assert out.token_ids == reference
    assert len(out.token_ids) == 200 and out.finish_reason == "length"
    assert out.text.startswith(PUBLISHED)
    assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]


def test_prompt_encoding_and_text_prompt(stories_paths: tuple[str, str]) -> None:
    model, tok = stories_paths
    llm = LLM(model, tokenizer=tok)
    assert llm.get_tokenizer().encode("Once upon a time") == [1, 403, 407, 261, 378]
    by_text = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=20))
    by_ids = llm.generate([1, 403, 407, 261, 378], SamplingParams(temperature=0.0, max_tokens=20))
    assert by_text[0].outputs[0].token_ids == by_ids[0].outputs[0].token_ids
    assert by_text[0].outputs[0].text.startswith(", there was a little girl")
