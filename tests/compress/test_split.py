"""The held-out split: the last 10% of complete stories; the cut-off last story is dropped."""

from __future__ import annotations

from pathlib import Path

from foudre.compress.data import SEPARATOR, complete_documents, read_split, split_documents

from .conftest import TINYSTORIES


def _text(n: int, cut: str = "and then the sto") -> str:
    return "".join(f"Story {i}.\n{SEPARATOR}\n" for i in range(n)) + cut


def test_last_tenth_heldout_and_cut_story_dropped() -> None:
    split = split_documents(_text(20))
    assert split.train == [f"Story {i}." for i in range(18)]
    assert split.heldout == ["Story 18.", "Story 19."]
    assert not any("sto" in d and "Story" not in d for d in split.train + split.heldout)


def test_rounding_up_and_no_overlap() -> None:
    split = split_documents(_text(25))
    assert len(split.heldout) == 3  # ceil(2.5)
    assert not set(split.train) & set(split.heldout)
    assert split.train + split.heldout == complete_documents(_text(25))


def test_file_ending_with_separator_and_plain_text() -> None:
    assert split_documents(_text(10, cut="\n")).heldout == ["Story 9."]
    plain = split_documents("To be, or not to be.\n")
    assert plain.train == ["To be, or not to be."] and plain.heldout == []


def test_real_file(tmp_path: Path) -> None:
    if not TINYSTORIES.is_file():
        import pytest

        pytest.skip("shared data missing")
    text = TINYSTORIES.read_text(encoding="utf-8")
    n = text.count(SEPARATOR)
    split = read_split([TINYSTORIES])
    assert len(split.train) + len(split.heldout) == n
    assert len(split.heldout) == -(-n // 10)
    last_cut = text.split(SEPARATOR)[-1].strip()
    assert last_cut not in split.heldout and last_cut not in split.train
    assert split.heldout[-1] == text.split(SEPARATOR)[-2].strip()
    assert not set(split.train) & set(split.heldout)
