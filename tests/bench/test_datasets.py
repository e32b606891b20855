"""Arrival processes and prompt sampling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from foudre.bench.datasets import (
    arrival_times,
    read_prompt_file,
    sample_file,
    sample_lengths,
    sample_random,
)
from tests.conftest import STORIES

N = 20000


def gaps(rate: float, burstiness: float, seed: int = 0) -> np.ndarray:
    times = np.array(arrival_times(N + 1, rate, burstiness, seed))
    assert times[0] == 0.0 and np.all(np.diff(times) >= 0)
    return np.diff(times)


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
def test_poisson_mean_and_cv(rate: float) -> None:
    g = gaps(rate, 1.0)
    # standard errors at n=20000: mean ~0.7 %, CV ~1 %; tolerances are >= 5 of them
    assert g.mean() == pytest.approx(1.0 / rate, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0, 16.0])
def test_gamma_cv_is_one_over_sqrt_burstiness(burstiness: float) -> None:
    g = gaps(10.0, burstiness, seed=1)
    assert g.mean() == pytest.approx(0.1, rel=0.05)
    assert g.std() / g.mean() == pytest.approx(1.0 / math.sqrt(burstiness), rel=0.1)


def test_infinite_rate_sends_all_at_once() -> None:
    assert arrival_times(50, math.inf, 1.0, 0) == [0.0] * 50
    assert arrival_times(5, math.inf, 3.0, 7) == [0.0] * 5
    assert arrival_times(0, 2.0) == []


def test_arrivals_are_reproducible() -> None:
    assert arrival_times(100, 3.0, 0.5, seed=42) == arrival_times(100, 3.0, 0.5, seed=42)
    assert arrival_times(100, 3.0, 0.5, seed=42) != arrival_times(100, 3.0, 0.5, seed=43)


def test_arrivals_reject_bad_arguments() -> None:
    for rate, b in ((0.0, 1.0), (-1.0, 1.0), (1.0, 0.0), (1.0, math.inf)):
        with pytest.raises(ValueError):
            arrival_times(3, rate, b)


def test_lengths_with_range_ratio() -> None:
    rng = np.random.default_rng(0)
    lens = sample_lengths(5000, 100, 0.5, rng)
    assert min(lens) == 50 and max(lens) == 150
    assert sample_lengths(10, 7, 0.0, rng) == [7] * 10
    assert min(sample_lengths(100, 1, 0.9, rng)) >= 1


def test_random_token_id_prompts() -> None:
    reqs = sample_random(20, 32, 8, range_ratio=0.25, seed=3, vocab_size=300)
    assert reqs == sample_random(20, 32, 8, range_ratio=0.25, seed=3, vocab_size=300)
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.input_len
        assert 24 <= r.input_len <= 40 and 6 <= r.output_len <= 10
        assert all(10 <= t < 300 for t in r.prompt)
        assert r.ignore_eos
    assert len({tuple(r.prompt[:8]) for r in reqs}) == 20  # type: ignore[index]


def test_random_text_prompts() -> None:
    reqs = sample_random(4, 16, 4, seed=0, as_text=True)
    assert all(isinstance(r.prompt, str) and len(r.prompt.split()) == 16 for r in reqs)


def test_random_prompts_with_tokenizer() -> None:
    path = STORIES / "tok512.bin"
    if not path.exists():
        pytest.skip("../shared/models/stories260K is not present")
    from foudre.loading.loader import load_tokenizer

    tok = load_tokenizer(path)
    for as_text in (False, True):
        for r in sample_random(3, 24, 4, seed=0, tokenizer=tok, as_text=as_text):
            assert isinstance(r.prompt, str)
            assert r.input_len == len(tok.encode(r.prompt, add_special_tokens=False))
            assert 0 < r.input_len <= (24 if as_text else 48)


def test_text_file_split_on_blank_lines_and_endoftext(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text("one two\nthree\n\n\nfour<|endoftext|>five six<|endoftext|>\n\n")
    assert read_prompt_file(path) == [("one two\nthree", None), ("four", None), ("five six", None)]
    reqs = sample_file(path, 5, output_len=7)
    assert [r.prompt for r in reqs] == [
        "one two\nthree",
        "four",
        "five six",
        "one two\nthree",
        "four",
    ]
    assert [r.input_len for r in reqs] == [3, 1, 2, 3, 1]
    assert all(r.output_len == 7 and not r.ignore_eos for r in reqs)


def test_jsonl_file(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [{"prompt": "hello there", "output_len": 3}, {"prompt": [5, 6, 7]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    reqs = sample_file(path, 2, output_len=9)
    assert [(r.prompt, r.input_len, r.output_len) for r in reqs] == [
        ("hello there", 2, 3),
        ([5, 6, 7], 3, 9),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2"):
        read_prompt_file(bad)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ValueError, match="no prompts"):
        read_prompt_file(empty)
