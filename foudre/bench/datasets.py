"""Benchmark workloads: prompts with their asked output lengths, and request arrival times.

Everything here is a pure function of its arguments and ``seed``: the same call gives the same
workload, so two servers can be compared on identical traffic.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from foudre.loading.tokenizer import Tokenizer

DEFAULT_RANDOM_VOCAB = 500
"""Without a tokenizer, random token ids are drawn from ``[10, DEFAULT_RANDOM_VOCAB)``: valid for
any vocabulary of at least that size (even tiny test models) and clear of the low ids where
special tokens usually live."""

_FIRST_RANDOM_ID = 10

_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her they this have not are "
    "but had one all were when there can been an which their said if do will each about how up "
    "out them then she many some so these would other into has more two time could go see no "
    "way my than first water long down day did get come made may part over new sound take only "
    "little work know place year live me back give most very after thing our just name good "
    "man think say great where help through much before line right too mean old any same tell "
    "boy follow came want show also around form three small set put end does another well large "
    "must big even such because turn here why ask went men read need land different home us "
    "move try kind hand picture again change off play spell air away animal house point page "
    "letter mother answer found study still learn should world high every near add food between "
    "own below country plant last school father keep tree never start city earth eye light "
    "thought head under story saw left few while along might close something seem next hard "
    "open example begin life always those both paper together got group often run important"
)
_WORDS = tuple(_WORD_TEXT.split())
"""Common English words, each a single token in most BPE vocabularies."""

_TEXT_SEPARATOR = "<|endoftext|>"


@dataclass(slots=True, frozen=True)
class SampledRequest:
    """One prompt to send. ``prompt`` is text or a list of token ids (completions only).

    ``input_len`` is the prompt's length in tokens as far as the client knows it (exact for token
    ids or with a tokenizer, a word count otherwise); the server's usage report supersedes it.
    ``ignore_eos`` asks the server to generate exactly ``output_len`` tokens.
    """

    prompt: str | list[int]
    input_len: int
    output_len: int
    ignore_eos: bool = False


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send times of ``n`` requests, in seconds from the start; the first is 0.

    Inter-arrival gaps are gamma-distributed with shape ``burstiness`` and mean ``1 / rate``, so
    their coefficient of variation is ``1 / sqrt(burstiness)``: ``burstiness == 1`` is a Poisson
    process, larger is more regular, smaller is burstier. ``rate == inf`` sends everything at
    once (all zeros). The result is non-decreasing and depends only on the arguments.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a positive number, got {burstiness}")
    if n == 0:
        return []
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


def sample_lengths(n: int, length: int, range_ratio: float, rng: np.random.Generator) -> list[int]:
    """``n`` lengths uniform over the integers in ``[length*(1-r), length*(1+r)]``, each >= 1."""
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    low = max(1, math.floor(length * (1.0 - range_ratio)))
    high = max(low, math.ceil(length * (1.0 + range_ratio)))
    return [int(x) for x in rng.integers(low, high + 1, size=n)]


def _random_text(num_tokens: int, rng: np.random.Generator, tokenizer: Tokenizer | None) -> str:
    """Random words; with a tokenizer, trimmed so that it encodes to at most ``num_tokens``."""
    words = [_WORDS[i] for i in rng.integers(0, len(_WORDS), size=num_tokens)]
    text = " ".join(words)
    if tokenizer is None:
        return text
    while len(words) > 1 and len(tokenizer.encode(text, add_special_tokens=False)) > num_tokens:
        excess = len(tokenizer.encode(text, add_special_tokens=False)) - num_tokens
        words = words[: max(1, len(words) - excess)]
        text = " ".join(words)
    return text


def sample_random(
    n: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    *,
    tokenizer: Tokenizer | None = None,
    as_text: bool = False,
    vocab_size: int = DEFAULT_RANDOM_VOCAB,
) -> list[SampledRequest]:
    """``n`` random prompts, all with ``ignore_eos`` so that outputs have the asked lengths.

    Input and output lengths are drawn by ``sample_lengths``. With ``as_text`` (chat), prompts are
    random words. Otherwise prompts are random token ids: drawn from the tokenizer's vocabulary
    minus its special ids and decoded to text when a tokenizer is given, else sent as id lists
    drawn from ``[10, vocab_size)``. Distinct prompts share no deliberate prefix.
    """
    rng = np.random.default_rng(seed)
    in_lens = sample_lengths(n, input_len, range_ratio, rng)
    out_lens = sample_lengths(n, output_len, range_ratio, rng)
    pool: np.ndarray | None = None
    if tokenizer is not None and not as_text:
        special = tokenizer.all_special_ids
        pool = np.array([i for i in range(tokenizer.vocab_size) if i not in special])
    elif not as_text and vocab_size <= _FIRST_RANDOM_ID:
        raise ValueError(f"vocab size must be > {_FIRST_RANDOM_ID}, got {vocab_size}")

    requests = []
    for in_len, out_len in zip(in_lens, out_lens):
        prompt: str | list[int]
        if as_text:
            prompt = _random_text(in_len, rng, tokenizer)
            if tokenizer is not None:
                in_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        elif pool is not None:
            assert tokenizer is not None
            prompt = tokenizer.decode(rng.choice(pool, size=in_len).tolist())
            in_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        else:
            prompt = rng.integers(_FIRST_RANDOM_ID, vocab_size, size=in_len).tolist()
        requests.append(SampledRequest(prompt, in_len, out_len, ignore_eos=True))
    return requests


def read_prompt_file(path: str | Path) -> list[tuple[str | list[int], int | None]]:
    """Prompts of a file, in file order, each with its output length if the file gives one.

    A ``.jsonl`` file (or any file whose first non-blank line is a JSON object) holds one object
    per line with ``"prompt"`` (text or token ids) and optionally ``"output_len"``. Any other file
    is text split into prompts on ``<|endoftext|>`` markers and blank lines; empty pieces are
    dropped. Raises ``ValueError`` naming the file and line for a malformed JSONL line, and when
    the file holds no prompt.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    first = next((line.strip() for line in text.splitlines() if line.strip()), "")
    prompts: list[tuple[str | list[int], int | None]] = []
    if path.suffix == ".jsonl" or first.startswith("{"):
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                prompt = obj["prompt"]
                out_len = obj.get("output_len")
                if not (isinstance(prompt, str) or _is_id_list(prompt)):
                    raise TypeError("prompt must be a string or a list of token ids")
                if out_len is not None and not (isinstance(out_len, int) and out_len >= 1):
                    raise TypeError("output_len must be a positive integer")
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                raise ValueError(f"{path}:{lineno}: bad JSONL prompt line: {exc}") from exc
            prompts.append((prompt, out_len))
    else:
        for piece in text.split(_TEXT_SEPARATOR):
            for block in piece.replace("\r\n", "\n").split("\n\n"):
                if block.strip():
                    prompts.append((block.strip(), None))
    if not prompts:
        raise ValueError(f"{path}: no prompts in file")
    return prompts


def _is_id_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(x) is int for x in value)


def sample_file(
    path: str | Path,
    n: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    *,
    tokenizer: Tokenizer | None = None,
) -> list[SampledRequest]:
    """``n`` prompts from ``path`` (see ``read_prompt_file``), in file order, cycling if the file
    has fewer. A prompt without its own output length gets one drawn by ``sample_lengths``.
    ``ignore_eos`` is off: file prompts are real text and may end early."""
    entries = read_prompt_file(path)
    rng = np.random.default_rng(seed)
    out_lens = sample_lengths(n, output_len, range_ratio, rng)
    requests = []
    for i in range(n):
        prompt, own_len = entries[i % len(entries)]
        requests.append(
            SampledRequest(prompt, _prompt_len(prompt, tokenizer), own_len or out_lens[i])
        )
    return requests


def _prompt_len(prompt: str | Sequence[int], tokenizer: Tokenizer | None) -> int:
    if not isinstance(prompt, str):
        return len(prompt)
    if tokenizer is not None:
        return len(tokenizer.encode(prompt, add_special_tokens=False))
    return len(prompt.split())
