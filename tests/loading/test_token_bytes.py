"""``Tokenizer.token_bytes``: the bytes each token adds to decoded text (what grammars are matched
against in structured output), checked against ``decode`` for every tokenizer kind."""

from __future__ import annotations

from pathlib import Path

import pytest

from foudre.loading import HFTokenizer, Llama2cTokenizer, SentencePieceTokenizer, load_tokenizer
from foudre.loading.loader import default_model
from foudre.loading.tokenizer import Tokenizer

from .paths import LLAMA2_SP, TOK512, build_byte_level_bpe, shared_file

TEXTS = ["Once upon a time", 'He said "héllo" to 日本 🙂!', "x = {'a': [1, 2]};\n\ttab"]


def _joined(tok: Tokenizer, text: str) -> str:
    table = tok.token_bytes()
    assert len(table) == tok.vocab_size
    return b"".join(table[i] for i in tok.encode(text, add_special_tokens=False)).decode()


def test_byte_level_bpe(tmp_path: Path) -> None:
    for tok in (load_tokenizer(default_model()[0]), load_tokenizer(build_byte_level_bpe(tmp_path))):
        assert isinstance(tok, HFTokenizer)
        for text in TEXTS:
            assert _joined(tok, text) == text == tok.decode(tok.encode(text))
        for special in tok.all_special_ids:
            assert tok.token_bytes()[special] == b""


@pytest.mark.parametrize("kind", ["sentencepiece", "llama2c"])
def test_sentencepiece_and_llama2c_pieces(kind: str) -> None:
    if kind == "sentencepiece":
        tok: Tokenizer = SentencePieceTokenizer(shared_file(LLAMA2_SP))
    else:
        tok = Llama2cTokenizer(shared_file(TOK512))
    for text in TEXTS:
        # both add a dummy space in front, which decode drops at the start of a text
        assert _joined(tok, text) == " " + text
    table = tok.token_bytes()
    assert all(table[i] == b"" for i in tok.all_special_ids)
    assert b"\xe6" in table  # byte-fallback pieces are single bytes


def test_sentencepiece_style_tokenizer_json_and_added_tokens() -> None:
    from tokenizers import AddedToken, decoders, models
    from tokenizers import Tokenizer as RustTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    vocab |= {"▁": 259, "a": 260, "▁a": 261, "ab": 262, "b": 263}
    rust = RustTokenizer(models.BPE(vocab, [("▁", "a"), ("a", "b")], byte_fallback=True))
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    rust.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    rust.add_tokens([AddedToken("<tool_call>", special=False)])
    tok = HFTokenizer(rust, {"eos_token": "</s>", "bos_token": "<s>"})
    table = tok.token_bytes()
    assert table[261] == b" a" and table[262] == b"ab" and table[3 + 0xE6] == b"\xe6"
    assert table[1] == table[2] == b""
    assert table[rust.token_to_id("<|im_end|>")] == b""
    assert table[rust.token_to_id("<tool_call>")] == b"<tool_call>"
