"""Tiny corpora and one tiny trained model, shared by the compression tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foudre.compress.data import SEPARATOR

TINYSTORIES = (
    Path(__file__).resolve().parents[2].parent / "shared/data/tinystories_v2_train_first2MiB.txt"
)

TINY_MODEL = {
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
}
TINY_TRAIN = {
    "steps": 40,
    "batch_size": 8,
    "seq_len": 64,
    "lr": 3e-3,
    "warmup_steps": 5,
    "autocast": "fp32",
    "eval_every": 20,
    "eval_batches": 2,
    "checkpoint_every": 20,
}


def write_config(path: Path, model: dict | None = None, **train: object) -> Path:
    path.write_text(json.dumps({"model": model or TINY_MODEL, "train": {**TINY_TRAIN, **train}}))
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~16 KB of TinyStories: complete stories, separators, and a cut-off last story."""
    if not TINYSTORIES.is_file():
        pytest.skip(f"missing {TINYSTORIES}")
    text = TINYSTORIES.read_text(encoding="utf-8")[:16_000]
    assert text.count(SEPARATOR) >= 10
    path = tmp_path_factory.mktemp("data") / "stories.txt"
    path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def trained(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """A tiny model trained through the CLI (tokenizer trained too): the shared test subject."""
    from foudre.cli import main

    root = tmp_path_factory.mktemp("trained")
    config = write_config(root / "config.json")
    out = root / "model"
    rc = main(
        [
            "train",
            "--config",
            str(config),
            "--data",
            str(corpus),
            "--train-tokenizer",
            "300",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    return out
