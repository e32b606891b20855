"""Incremental detokenization: deltas add up to the full decode, and stop strings stop it.

The property tests run over three kinds of tokenizer: llama2.c (byte fallback), Llama 2's
sentencepiece (byte fallback, leading-space handling) and a byte-level BPE (GPT-2 style).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from foudre.loading import IncrementalDetokenizer, Tokenizer, load_tokenizer

from .paths import LLAMA2_SP, TOK512, build_byte_level_bpe, shared_file

PROMPT_ALPHABET = [*"ab yz,.\n", "é", "日", "本", "🙂", "Ω"]


@pytest.fixture(scope="module", params=["llama2c", "sentencepiece", "bytebpe"])
def tokenizer(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Tokenizer:
    if request.param == "llama2c":
        return load_tokenizer(shared_file(TOK512))
    if request.param == "sentencepiece":
        return load_tokenizer(shared_file(LLAMA2_SP))
    return load_tokenizer(build_byte_level_bpe(tmp_path_factory.mktemp("bpe")))


def _ids(vocab_size: int) -> st.SearchStrategy[int]:
    # Byte-fallback ids (3..258 in llama2.c and Llama 2) are rare in a 32k vocab: favour them.
    return st.one_of(st.integers(0, vocab_size - 1), st.integers(3, min(258, vocab_size - 1)))


def _run(
    detok: IncrementalDetokenizer, output: list[int], chunks: list[int]
) -> tuple[list[str], str]:
    deltas: list[str] = []
    at = 0
    for size in chunks:
        if at >= len(output):
            break
        deltas.append(detok.add_tokens(output[at : at + size]))
        at += size
    if at < len(output):
        deltas.append(detok.add_tokens(output[at:]))
    return deltas, detok.flush()


def _expected(tok: Tokenizer, prompt: list[int], output: list[int], skip: bool) -> str:
    full = tok.decode(prompt + output, skip_special_tokens=skip)
    prompt_text = tok.decode(prompt, skip_special_tokens=skip)
    assert full.startswith(prompt_text)
    return full[len(prompt_text) :]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_deltas_add_up_to_full_decode(tokenizer: Tokenizer, data: st.DataObject) -> None:
    prompt_text = data.draw(st.text(alphabet=st.sampled_from(PROMPT_ALPHABET), max_size=12))
    prompt = tokenizer.encode(prompt_text, add_special_tokens=data.draw(st.booleans()))
    output = data.draw(st.lists(_ids(tokenizer.vocab_size), max_size=30))
    chunks = data.draw(st.lists(st.integers(1, 4), max_size=30))
    skip = data.draw(st.booleans())
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=skip)
    deltas, last = _run(detok, output, chunks)
    expected = _expected(tokenizer, prompt, output, skip)
    assert "".join(deltas) + last == detok.text == expected
    released = ""
    for delta in deltas:
        assert not delta.endswith("\ufffd")  # a broken character is never released early
        released += delta
        assert expected.startswith(released)  # so any U+FFFD is one the full text has too
    assert detok.stopped_by is None


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.data())
def test_stop_strings(tokenizer: Tokenizer, data: st.DataObject) -> None:
    prompt = tokenizer.encode("Once upon", add_special_tokens=True)
    words = st.sampled_from([" a", " time", " there", " was", ",", ".", " little", " girl"])
    output_text = "".join(data.draw(st.lists(words, min_size=1, max_size=12)))
    output = tokenizer.encode(output_text, add_special_tokens=False)
    output += data.draw(st.lists(_ids(tokenizer.vocab_size), max_size=5))
    expected = _expected(tokenizer, prompt, output, True)
    stops = data.draw(
        st.lists(
            st.one_of(
                st.sampled_from(["time", "e, ", ". ", "girl", "a t", "zzz", "\ufffd"]),
                st.integers(0, max(len(expected) - 1, 0)).flatmap(
                    lambda i: st.integers(i + 1, i + 6).map(lambda j: expected[i:j])
                ),
            ),
            max_size=3,
        )
    )
    include = data.draw(st.booleans())
    chunks = data.draw(st.lists(st.integers(1, 3), max_size=40))
    detok = IncrementalDetokenizer(
        tokenizer, prompt, stop=stops, include_stop_str_in_output=include
    )
    deltas, last = _run(detok, output, chunks)

    hits = [(expected.find(s) + len(s), expected.find(s), s) for s in stops if s and s in expected]
    if hits:
        end, start, stop = min(hits)
        assert detok.stopped_by == stop
        assert detok.text == expected[: end if include else start]
    else:
        assert detok.stopped_by is None and detok.text == expected
    # Every delta is a piece of the final text: no part of the stop string leaks out early.
    assert "".join(deltas) + last == detok.text


def test_stop_string_split_across_tokens() -> None:
    tok = load_tokenizer(shared_file(TOK512))
    prompt = tok.encode("")
    output = tok.encode("Once upon a time, there was", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, stop=["a time,"])
    deltas = [detok.add_tokens([i]) for i in output]
    assert detok.stopped_by == "a time,"
    assert detok.text == "".join(deltas) == "Once upon "
    assert detok.add_tokens([403]) == "" and detok.flush() == ""


def test_held_text_released_by_flush() -> None:
    tok = load_tokenizer(shared_file(TOK512))
    output = tok.encode("Once upon a ti", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1], stop=["a time"])
    streamed = "".join(detok.add_tokens([i]) for i in output)
    assert streamed == "Once upon "
    assert detok.flush() == "a ti" and detok.text == "Once upon a ti"
    assert detok.stopped_by is None


def test_incomplete_utf8_is_held(tmp_path: Path) -> None:
    tok = load_tokenizer(shared_file(TOK512))
    snake = [3 + b for b in "🐍".encode()]  # four byte-fallback ids
    detok = IncrementalDetokenizer(tok, [1])
    assert [detok.add_tokens([i]) for i in snake] == ["", "", "", "🐍"]
    detok.add_tokens([3 + 0xF0])
    assert detok.text == "🐍" and detok.flush() == "\ufffd"


def test_work_per_call_is_bounded() -> None:
    """Each call decodes a window of a few tokens, not the whole output."""
    tok = load_tokenizer(shared_file(TOK512))
    lengths: list[int] = []

    class Counting(type(tok)):  # type: ignore[misc]
        def decode(self, ids, skip_special_tokens=True):  # type: ignore[no-untyped-def]
            lengths.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    counting = Counting(shared_file(TOK512))
    text = "Once upon a time, there was a little girl named Lily. " * 20
    detok = IncrementalDetokenizer(counting, tok.encode(text), stop=["zebra"])
    for i in tok.encode(text, add_special_tokens=False):
        detok.add_tokens([i])
    assert detok.flush() == "" and detok.text == " " + text  # llama2.c's dummy prefix space
    assert max(lengths) <= 10
