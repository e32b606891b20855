"""Padded vocabularies: a model with more rows than its tokenizer has pieces (Phi-3's 32,064
over 32,011) may sample an id past the tokenizer; it decodes to empty text (as llama.cpp and
vLLM do) in every tokenizer class, through ``LLM`` and through the server, instead of failing
the request (sentencepiece raised ``IndexError: piece id is out of range``)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from foudre import LLM, SamplingParams
from foudre.loading.loader import load_tokenizer
from foudre.loading.tokenizer import HFTokenizer, Tokenizer
from tests.conftest import STORIES, make_hf_model
from tests.loading.paths import LLAMA2_SP

LLAMA2C_TOK = STORIES / "tok512.bin"


def _word_level(path: Path) -> Path:
    """A tokenizer.json of 10 words (ids 0-9)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *"abcdefg"])}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.decoder = decoders.WordPiece()
    path.mkdir(parents=True, exist_ok=True)
    raw.save(str(path / "tokenizer.json"))
    return path / "tokenizer.json"


def _tokenizers(tmp_path: Path) -> list[Tokenizer]:
    out: list[Tokenizer] = [HFTokenizer(_word_level(tmp_path / "hf"))]
    for path in (LLAMA2_SP, LLAMA2C_TOK):
        if not path.exists():
            pytest.skip(f"{path} is not present")
        out.append(load_tokenizer(path))
    return out


def test_ids_past_the_tokenizer_decode_to_nothing(tmp_path: Path) -> None:
    for tok in _tokenizers(tmp_path):
        n = tok.vocab_size
        ids = [3, 4, 5]
        plain = tok.decode(ids)
        assert plain, type(tok).__name__
        for skip in (True, False):
            padded = [n + 7, 3, n, 4, n + 63, 5, n + 1]
            assert tok.decode(padded, skip_special_tokens=skip) == tok.decode(ids, skip), skip
            assert tok.decode([n + 3], skip_special_tokens=skip) == ""


def _padded_model(tmp_path: Path, vocab_size: int, tokenizer: Path) -> Path:
    """A random model of ``vocab_size`` rows with ``tokenizer`` beside it."""
    path = make_hf_model(
        tmp_path / "padded",
        "llama",
        vocab_size=vocab_size,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    (path / tokenizer.name).write_bytes(tokenizer.read_bytes())
    return path


@pytest.mark.parametrize("kind", ["sentencepiece", "llama2c", "hf"])
def test_llm_generates_padded_ids_as_empty_text(tmp_path: Path, kind: str) -> None:
    if kind == "hf":
        tokenizer = _word_level(tmp_path / "tok")
    else:
        tokenizer = LLAMA2_SP if kind == "sentencepiece" else LLAMA2C_TOK
        if not tokenizer.exists():
            pytest.skip(f"{tokenizer} is not present")
    pieces = load_tokenizer(tokenizer).vocab_size
    path = _padded_model(tmp_path, pieces + 64, tokenizer)  # 32,064 over 32,000 for llama2's
    llm = LLM(str(path), tokenizer=str(tokenizer), dtype="float32", num_kv_blocks=32)
    past = [pieces, pieces + 5, pieces + 63]
    params = SamplingParams(max_tokens=6, allowed_token_ids=past, ignore_eos=True, logprobs=2)
    out = llm.generate([[1, 3, 4]], params)[0].outputs[0]
    assert len(out.token_ids) == 6 and set(out.token_ids) <= set(past)
    assert out.text == ""
    # mixed with ids the tokenizer knows: the text is theirs alone
    mixed = SamplingParams(max_tokens=8, allowed_token_ids=[*past, 3, 4], ignore_eos=True)
    out = llm.generate([[1, 3, 4]], mixed)[0].outputs[0]
    known = [t for t in out.token_ids if t < pieces]
    tok = llm.get_tokenizer()
    assert out.text == tok.decode([1, 3, 4, *known])[len(tok.decode([1, 3, 4])) :]


def test_server_streams_padded_ids_as_empty_text(tmp_path: Path) -> None:
    """Completions, streamed and not, with logprobs (each token's text decoded alone)."""
    from tests.server.conftest import start_in_process, stop_in_process

    if not LLAMA2C_TOK.exists():
        pytest.skip(f"{LLAMA2C_TOK} is not present")
    path = _padded_model(tmp_path, 512 + 64, LLAMA2C_TOK)
    srv = start_in_process(
        engine={"model": str(path), "tokenizer": str(LLAMA2C_TOK), "num_kv_blocks": 32}
    )
    try:
        body = {
            "model": "stories",
            "prompt": "Once",
            "max_tokens": 5,
            "logit_bias": {"520": 100, "575": 100},
            "logprobs": 1,
            "ignore_eos": True,
        }
        with httpx.Client(timeout=60) as client:
            r = client.post(srv.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == ""
            assert choice["logprobs"]["tokens"] == [""] * 5
            with client.stream(
                "POST", srv.url + "/v1/completions", json={**body, "stream": True}
            ) as s:
                assert s.status_code == 200
                chunks = [
                    json.loads(line[6:])
                    for line in s.iter_lines()
                    if line.startswith("data: ") and line != "data: [DONE]"
                ]
            assert chunks and "".join(c["choices"][0]["text"] for c in chunks) == ""
    finally:
        stop_in_process(srv)
