"""``foudre eval perplexity``: equals a direct transformers computation; the summary line."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from foudre.cli import main
from foudre.compress.data import read_documents
from foudre.compress.eval import perplexity, sequence_nats
from foudre.compress.model import full_sequence_logits, load_for_eval


def test_perplexity_matches_transformers(trained: Path, corpus: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model, tok = load_for_eval(str(trained))
    docs = read_documents(corpus, "heldout")
    assert docs
    ours = perplexity(model, tok, docs)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.float32)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(trained))
    nats, tokens, n_bytes = 0.0, 0, 0
    for doc in docs:
        ids = torch.tensor([hf_tok(doc)["input_ids"]])  # BOS + tokens
        with torch.no_grad():
            loss = hf(ids, labels=ids).loss  # mean over the predicted tokens
        nats += float(loss) * (ids.shape[1] - 1)
        tokens += ids.shape[1] - 1
        n_bytes += len(doc.encode())
    assert ours.tokens == tokens and ours.bytes == n_bytes
    assert ours.nats == pytest.approx(nats, rel=1e-5)
    assert ours.bits_per_byte == pytest.approx(nats / math.log(2) / n_bytes, rel=1e-5)


def test_windows_predict_every_token_once(trained: Path) -> None:
    model, tok = load_for_eval(str(trained))
    ids = tok.encode("One day, a girl named Sue found a shiny stone near the river bank.")
    whole = sequence_nats(model, ids, 128)
    windowed = sequence_nats(model, ids, 6)
    assert windowed != whole and abs(windowed - whole) < 0.5 * whole
    logits = full_sequence_logits(model, ids[:6])
    first = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:6]), reduction="sum")
    assert sequence_nats(model, ids[:6], 6) == pytest.approx(float(first), rel=1e-6)


def test_cli_last_line_and_quantization_flag(
    trained: Path, corpus: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "eval",
                "perplexity",
                "--model",
                str(trained),
                "--data",
                str(corpus),
                "--split",
                "heldout",
            ]
        )
        == 0
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    fields = dict(kv.split("=") for kv in last.split())
    assert list(fields) == ["perplexity", "bits_per_byte", "tokens", "bytes"]
    assert float(fields["perplexity"]) > 1 and int(fields["tokens"]) > 0
    base = float(fields["bits_per_byte"])
    args = ["eval", "perplexity", "--model", str(trained), "--data", str(corpus)]
    assert main([*args, "--split", "heldout", "--quantization", "int8"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    quantized = float(dict(kv.split("=") for kv in last.split())["bits_per_byte"])
    assert quantized == pytest.approx(base, rel=0.02)
