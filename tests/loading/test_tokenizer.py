"""Tokenizers: encode/decode oracles, special tokens, BOS handling, chat templates."""

from __future__ import annotations

import json
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

from .paths import LLAMA2_SP, TOK512, build_byte_level_bpe, shared_file


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
