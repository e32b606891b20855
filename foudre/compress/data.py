"""Text files to documents, the held-out split, and token streams for training.

The held-out split is defined once, here, and shared by training and evaluation::

    file:   story 0 <|endoftext|> story 1 <|endoftext|> ... story n-1 <|endoftext|> cut-off...
    complete stories: the n pieces followed by a separator (stripped; empty pieces dropped)
    train:   complete[: n - n_heldout]      held-out: complete[n - n_heldout :]
    n_heldout = ceil(n / 10)

The text after the last separator is a story cut off by the file's end and belongs to neither
part. A file without any separator holds one document, which is all training text.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from foudre.loading.tokenizer import Tokenizer

SEPARATOR = "<|endoftext|>"
HELDOUT_FRACTION = 0.1


@dataclass(slots=True)
class Split:
    train: list[str]
    heldout: list[str]


def complete_documents(text: str) -> list[str]:
    """The stripped, non-empty documents of ``text`` that are followed by a separator.

    Without any separator the whole (stripped) text is the one document.
    """
    if SEPARATOR not in text:
        doc = text.strip()
        return [doc] if doc else []
    pieces = text.split(SEPARATOR)[:-1]  # the last piece is cut off (or empty)
    return [p.strip() for p in pieces if p.strip()]


def split_documents(text: str) -> Split:
    """Train and held-out documents of ``text``: the held-out part is the last
    ``ceil(10%)`` of its complete stories; the two parts never share a story.

    A text without separators has no held-out part.
    """
    docs = complete_documents(text)
    if SEPARATOR not in text:
        return Split(train=docs, heldout=[])
    n_heldout = math.ceil(len(docs) * HELDOUT_FRACTION)
    cut = len(docs) - n_heldout
    return Split(train=docs[:cut], heldout=docs[cut:])


def read_split(paths: Iterable[str | Path]) -> Split:
    """The train and held-out documents of every file, in order."""
    train: list[str] = []
    heldout: list[str] = []
    for path in paths:
        split = split_documents(Path(path).read_text(encoding="utf-8"))
        train += split.train
        heldout += split.heldout
    return Split(train, heldout)


def read_documents(path: str | Path, split: str = "all") -> list[str]:
    """Documents of one file: ``all`` complete ones, or only the ``heldout`` / ``train`` part."""
    text = Path(path).read_text(encoding="utf-8")
    if split == "all":
        return complete_documents(text)
    if split == "heldout":
        return split_documents(text).heldout
    if split == "train":
        return split_documents(text).train
    raise ValueError(f"unknown split {split!r}; expected all, train or heldout")


def document_ids(tokenizer: Tokenizer, doc: str) -> list[int]:
    """``[BOS] + tokens(doc)``, plus EOS when the tokenizer's EOS differs from its BOS."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    if bos is None:
        raise ValueError("the tokenizer has no BOS token; documents need one to start")
    ids = [bos, *tokenizer.encode(doc, add_special_tokens=False)]
    if eos is not None and eos != bos:
        ids.append(eos)
    return ids


def token_stream(tokenizer: Tokenizer, docs: Sequence[str]) -> torch.Tensor:
    """All documents as one int64 stream, each starting with BOS (see ``document_ids``)."""
    ids: list[int] = []
    for doc in docs:
        ids += document_ids(tokenizer, doc)
    return torch.tensor(ids, dtype=torch.long)


def random_batch(
    stream: torch.Tensor, batch_size: int, seq_len: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` ``[B, T]`` from random windows of ``stream``; the same ``seed``
    always gives the same batch (so a resumed run sees exactly the batches it would have)."""
    if len(stream) < seq_len + 2:
        raise ValueError(
            f"only {len(stream)} training tokens; need more than seq_len + 1 = {seq_len + 1}"
        )
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=generator)
    idx = starts.view(-1, 1) + torch.arange(seq_len + 1).view(1, -1)
    window = stream[idx]
    return window[:, :-1], window[:, 1:]


def fixed_batches(
    stream: torch.Tensor, batch_size: int, seq_len: int, max_batches: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Consecutive non-overlapping windows of ``stream`` as at most ``max_batches`` batches
    (the evaluation set: the same every time it is asked for)."""
    n_windows = min((len(stream) - 1) // seq_len, batch_size * max_batches)
    batches = []
    for start in range(0, n_windows, batch_size):
        rows = range(start, min(start + batch_size, n_windows))
        window = torch.stack([stream[r * seq_len : r * seq_len + seq_len + 1] for r in rows])
        batches.append((window[:, :-1], window[:, 1:]))
    return batches
