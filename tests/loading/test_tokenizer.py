"""Tokenizers: encode/decode oracles, special tokens, BOS handling, chat templates."""

from __future__ import annotations

import gc
import json
import random
import struct
import time
from pathlib import Path

import jinja2
import pytest

from foudre.loading import (
    HFTokenizer,
    Llama2cTokenizer,
    ModelLoadError,
    SentencePieceTokenizer,
    load_tokenizer,
)
from foudre.loading.tokenizer import InvalidTextError, Tokenizer

from .paths import LLAMA2_SP, SHARED, TINYSTORIES, TOK512, build_byte_level_bpe, shared_file


def test_llama2c_oracle() -> None:
    tok = load_tokenizer(shared_file(TOK512))
    assert isinstance(tok, Llama2cTokenizer)
    ids = tok.encode("Once upon a time")
    assert ids == [1, 403, 407, 261, 378]
    assert tok.decode(ids) == "Once upon a time"
    assert tok.encode("Once upon a time", add_special_tokens=False) == [403, 407, 261, 378]
    assert tok.encode("") == [1] and tok.decode([]) == ""
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (512, 1, 2)
    assert tok.all_special_ids == {0, 1, 2}


def test_llama2c_byte_fallback_and_space_after_bos() -> None:
    tok = Llama2cTokenizer(shared_file(TOK512))
    text = "Zoë 日本 🙂"
    ids = tok.encode(text)
    assert any(3 <= i < 259 for i in ids)  # some characters fell back to bytes
    assert tok.decode(ids) == text
    assert tok.decode(ids[1:]) == " " + text  # no BOS before it: the dummy space stays
    assert tok.decode([3 + 0xE6]) == "\ufffd"
    assert "<s>" in tok.decode([1, 403], skip_special_tokens=False)


def test_llama2c_corrupt_file(tmp_path: Path) -> None:
    data = shared_file(TOK512).read_bytes()
    (tmp_path / "tok.bin").write_bytes(data[:-3])
    with pytest.raises(ModelLoadError, match=r"tok.bin"):
        load_tokenizer(tmp_path / "tok.bin")


def test_sentencepiece_llama2() -> None:
    tok = load_tokenizer(shared_file(LLAMA2_SP))
    assert isinstance(tok, SentencePieceTokenizer)
    ids = tok.encode("Hello world")
    assert ids == [1, 15043, 3186]
    assert tok.encode("Hello world", add_special_tokens=False) == [15043, 3186]
    assert tok.decode(ids) == "Hello world"
    assert tok.decode(ids, skip_special_tokens=False) == "<s>Hello world"
    assert (tok.vocab_size, tok.bos_token_id, tok.eos_token_id) == (32000, 1, 2)
    assert (tok.bos_token, tok.eos_token) == ("<s>", "</s>")
    assert {0, 1, 2} <= tok.all_special_ids
    assert tok.decode(tok.encode("héllo 日本 🙂")) == "héllo 日本 🙂"


def test_sentencepiece_config_can_disable_bos(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.model").symlink_to(shared_file(LLAMA2_SP))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False}))
    tok = load_tokenizer(tmp_path)
    assert tok.encode("Hello world") == [15043, 3186]


def test_hf_tokenizer_bos_from_config_not_doubled(tmp_path: Path) -> None:
    plain = build_byte_level_bpe(tmp_path / "plain")
    tok = load_tokenizer(plain)
    assert isinstance(tok, HFTokenizer)
    bos, eos = tok.bos_token_id, tok.eos_token_id
    assert bos is not None and eos is not None and bos != eos
    text = "Once upon a time, héllo 🙂"
    ids = tok.encode(text)
    assert bos not in ids  # no add_bos_token and no post-processor: no BOS
    assert tok.decode(ids) == text

    config = json.loads((plain / "tokenizer_config.json").read_text())
    (plain / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert load_tokenizer(plain).encode(text) == [bos, *ids]

    processed = build_byte_level_bpe(tmp_path / "processed", add_bos_post_processor=True)
    with_processor = load_tokenizer(processed)
    assert with_processor.encode(text) == [bos, *ids]
    assert with_processor.encode(text, add_special_tokens=False) == ids
    (processed / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": True}))
    assert load_tokenizer(processed / "tokenizer.json").encode(text) == [bos, *ids]
    (processed / "tokenizer_config.json").write_text(json.dumps({**config, "add_bos_token": False}))
    assert load_tokenizer(processed).encode(text) == ids

    assert {bos, eos} <= tok.all_special_ids
    assert tok.decode([bos, *ids, eos]) == text
    assert tok.decode([*ids, eos], skip_special_tokens=False) == text + "<|endoftext|>"


def test_chat_templates(tmp_path: Path) -> None:
    directory = build_byte_level_bpe(tmp_path)
    tok = load_tokenizer(directory)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok.has_chat_template
    assert tok.apply_chat_template(messages) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.apply_chat_template(messages, add_generation_prompt=False).endswith("<|im_end|>\n")

    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "tool_use", "template": "tools"},
        {
            "name": "default",
            "template": "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}",
        },
    ]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_tokenizer(directory).apply_chat_template(messages) == "<s>Hi<|endoftext|>"

    config["chat_template"] = "{{ raise_exception('no system role') }}"
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(jinja2.TemplateError, match=r"no system role"):
        load_tokenizer(directory).apply_chat_template(messages)

    (directory / "chat_template.jinja").write_text("{{ messages | length }}")
    assert load_tokenizer(directory).apply_chat_template(messages) == "1"


def test_fallback_chat_format() -> None:
    tok = load_tokenizer(shared_file(TOK512))
    assert not tok.has_chat_template
    messages = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(messages) == "system: Be kind.\nuser: Hi\nassistant:"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == (
        "system: Be kind.\nuser: Hi\n"
    )


def test_load_tokenizer_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ModelLoadError, match=r"missing.model"):
        load_tokenizer(tmp_path / "missing.model")
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match=r"tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "vocab.txt").write_text("a")
    with pytest.raises(ModelLoadError, match=r"unknown tokenizer format"):
        load_tokenizer(tmp_path / "vocab.txt")


# --- llama2.c encode: the heap-based merge against the old quadratic algorithm ---------------


class _QuadraticLlama2c:
    """The oracle: llama2.c's encode as foudre implemented it before the heap (O(n^2)).

    Reads the ``.bin`` itself; each round rescans every adjacent pair and merges the one whose
    concatenation is a token with the highest score (above -1e10), the leftmost on ties.
    """

    def __init__(self, path: Path) -> None:
        data = path.read_bytes()
        self.pieces: list[bytes] = []
        self.scores: list[float] = []
        offset = 4
        while offset < len(data):
            score, length = struct.unpack_from("<fi", data, offset)
            self.pieces.append(data[offset + 8 : offset + 8 + length])
            self.scores.append(score)
            offset += 8 + length
        self.lookup: dict[bytes, int] = {}
        for i, piece in enumerate(self.pieces):
            self.lookup.setdefault(piece, i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        tokens: list[int] = []
        if text:
            tokens.append(self.lookup.get(b" ", 0x20 + 3))
        for char in text:
            utf8 = char.encode("utf-8", errors="surrogatepass")
            found = self.lookup.get(utf8)
            if found is not None:
                tokens.append(found)
            else:
                tokens.extend(b + 3 for b in utf8)
        while True:
            best_score, best_id, best_at = -1e10, -1, -1
            for at in range(len(tokens) - 1):
                merged = self.lookup.get(self.pieces[tokens[at]] + self.pieces[tokens[at + 1]])
                if merged is not None and self.scores[merged] > best_score:
                    best_score, best_id, best_at = self.scores[merged], merged, at
            if best_at < 0:
                break
            tokens[best_at : best_at + 2] = [best_id]
        if add_special_tokens:
            tokens.insert(0, 1)
        return tokens


def _write_llama2c_bin(path: Path, pieces: list[bytes], scores: list[float]) -> Path:
    with path.open("wb") as f:
        f.write(struct.pack("<i", max(len(p) for p in pieces)))
        for piece, score in zip(pieces, scores, strict=True):
            f.write(struct.pack("<fi", score, len(piece)) + piece)
    return path


@pytest.fixture(scope="module")
def llama2c_bins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """llama2.c tokenizers: stories260K's tok512, Llama 2's 32000 exported as llama2.c's
    ``tokenizer.py`` does, and a small one made of ties and edge scores."""
    directory = tmp_path_factory.mktemp("llama2c")
    bins = {"tok512": shared_file(TOK512)}

    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor()
    sp.Load(str(shared_file(LLAMA2_SP)))
    pieces, scores = [], []
    for i in range(sp.get_piece_size()):
        piece = {sp.bos_id(): "\n<s>\n", sp.eos_id(): "\n</s>\n"}.get(i, sp.id_to_piece(i))
        pieces.append(piece.replace("\u2581", " ").encode("utf-8"))
        scores.append(sp.get_score(i))
    bins["llama2"] = _write_llama2c_bin(directory / "llama2.bin", pieces, scores)

    # Few distinct scores, so ties decide most merges; 0.0 and -0.0 tie too. A NaN score, and
    # -1e10 (run.c's starting best) or below, are never merged into.
    rng = random.Random(7)
    pieces = [b"<unk>", b"\n<s>\n", b"\n</s>\n"] + [b"<0x%02X>" % b for b in range(256)]
    scores = [0.0] * len(pieces)
    alphabet = ["a", "b", " ", "\u00e9"]
    grams = {"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(300)}
    choices = [0.0, -0.0, 1.0, 1.0, 2.5, -3.0, -1e10, float("-inf"), float("nan")]
    for gram in sorted(alphabet) + sorted(grams - set(alphabet)):
        pieces.append(gram.encode("utf-8"))
        scores.append(rng.choice(choices))
    bins["ties"] = _write_llama2c_bin(directory / "ties.bin", pieces, scores)
    return bins


def _corpus_slices() -> list[str]:
    texts = []
    for path in sorted((SHARED / "data").glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        for start in (0, len(text) // 3, len(text) - 2500):
            for size in (1, 2, 5, 17, 120, 700, 2500):
                texts.append(text[start : start + size])
    if not texts:
        pytest.skip(f"no shared corpora in {SHARED / 'data'}")
    return texts


def _random_texts(rng: random.Random, count: int) -> list[str]:
    pools = [
        "abcdefghijklmnopqrstuvwxyz",
        "ABCXYZ0123456789.,;:!?'\"-()",
        " \t\n\r",
        "\u00e9\u00e8\u00fc\u00f1\u00e7\u00df\u00f8\u00c5",  # accented Latin
        "\u65e5\u672c\u8a9e\u4e2d\u6587\ud55c\uad6d\uc5b4\u0416\u03a9\u05d0\u0627",
        "\U0001f642\U0001f600\U0001f680\U0001f44d\U0001f3fd\u200d\u2764\ufe0f",  # emoji, ZWJ
        "\x00\x01\x7f\u00ad\ufeff\ufffd\U0010fffd\U000e0001",  # controls, unassigned, private
    ]
    texts = []
    for _ in range(count):
        chosen = rng.sample(pools, rng.randint(1, len(pools)))
        alphabet = "".join(chosen)
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(0, 120))))
        # any code point outside the surrogates, mostly absent from the vocabularies
        texts.append(
            "".join(
                chr(c if not 0xD800 <= c <= 0xDFFF else c + 0x800)
                for c in (rng.randint(0, 0x10FFFF) for _ in range(rng.randint(1, 20)))
            )
        )
    return texts


def _run_texts() -> list[str]:
    """Runs where ties (the same pair at overlapping places) decide: leftmost must win."""
    texts = ["", " ", "  ", "\n", "\t", " \n\t ", "\n\n\n", " " * 33, "\u3000 \u00a0"]
    for unit in ("a", "e", "l", " ", "ab", "aab", "ba ", "\u00e9", "\U0001f642", "!", "\n"):
        texts += [unit * k for k in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 31, 64, 97)]
    texts += ["a" * k + " " + "a" * j for k in range(1, 7) for j in range(1, 7)]
    texts += ["b" + "a" * k + "b" for k in range(12)]
    return texts


@pytest.mark.parametrize("name", ["tok512", "llama2", "ties"])
def test_llama2c_encode_matches_quadratic_reference(
    name: str, llama2c_bins: dict[str, Path]
) -> None:
    tok = Llama2cTokenizer(llama2c_bins[name])
    oracle = _QuadraticLlama2c(llama2c_bins[name])
    rng = random.Random(name)
    texts = _run_texts() + _random_texts(rng, 150)
    if name == "ties":
        letters = "ab \u00e9"
        texts += [
            "".join(rng.choice(letters) for _ in range(rng.randint(0, 60))) for _ in range(400)
        ]
    else:
        texts += _corpus_slices()
    for text in texts:
        expected = oracle.encode(text, add_special_tokens=False)
        assert tok.encode(text, add_special_tokens=False) == expected, repr(text[:80])
        assert tok.encode(text) == [1, *expected]
    if name != "ties":  # round trip: BOS strips the dummy space
        assert tok.decode(tok.encode(texts[-1])) == texts[-1]


def test_llama2c_encode_near_linear_time() -> None:
    """200k characters cost about 10x 20k (the old rescan: 100x, and minutes)."""
    tok = Llama2cTokenizer(shared_file(TOK512))
    text = shared_file(TINYSTORIES).read_text(encoding="utf-8")

    def best_time(chars: int, runs: int) -> float:
        times = []
        for _ in range(runs):
            gc.collect()
            start = time.perf_counter()
            ids = tok.encode(text[:chars])
            times.append(time.perf_counter() - start)
        assert tok.decode(ids) == text[:chars]
        return min(times)

    small = best_time(20_000, 5)
    large = best_time(200_000, 3)
    # n log n with cache effects measures 12-17x; a quadratic algorithm would be 100x
    assert large < 40 * small + 0.05, f"20k chars: {small:.3f} s, 200k chars: {large:.3f} s"


# --- lone surrogates: every tokenizer class rejects them the same way -----------------------

_SURROGATE_TEXTS = [
    "a\ud800b",
    json.loads('"\\ud800"'),
    "\udfff",
    "x" * 50 + "\udc00",
    "\U0001f642 \ud83d",
    "\ud83d\ude42",  # a surrogate pair as two code points is not a character either
]


def _tokenizers_for_surrogates(tmp_path: Path) -> list[Tokenizer]:
    embedded = Path(__file__).resolve().parents[2] / "foudre/assets/models/target"
    return [
        Llama2cTokenizer(shared_file(TOK512)),
        SentencePieceTokenizer(shared_file(LLAMA2_SP)),
        load_tokenizer(embedded),
        load_tokenizer(build_byte_level_bpe(tmp_path)),
    ]


def test_lone_surrogates_raise_invalid_text_error(tmp_path: Path) -> None:
    tokenizers = _tokenizers_for_surrogates(tmp_path)
    assert {type(t) for t in tokenizers} == {
        Llama2cTokenizer,
        SentencePieceTokenizer,
        HFTokenizer,
    }
    for tok in tokenizers:
        for text in _SURROGATE_TEXTS:
            for add_special_tokens in (True, False):
                with pytest.raises(InvalidTextError, match=r"lone surrogate.*not valid Unicode"):
                    tok.encode(text, add_special_tokens=add_special_tokens)
        assert issubclass(InvalidTextError, ValueError)
        with pytest.raises(ValueError, match=r"U\+D800 at index 1"):
            tok.encode("a\ud800b")
        # valid text just around the surrogate block still encodes
        assert tok.encode("\ud7ff\ue000 h\u00e9llo \U0001f642", add_special_tokens=False)
