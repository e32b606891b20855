"""Shared paths for the loading tests; files in ../shared are read where they are."""

from __future__ import annotations

from pathlib import Path

import pytest

SHARED = (Path(__file__).resolve().parents[2] / "../shared").resolve()
STORIES_DIR = SHARED / "models/stories260K"
STORIES_BIN = STORIES_DIR / "stories260K.bin"
STORIES_Q8 = STORIES_DIR / "stories260K_q8_gs4.bin"
TOK512 = STORIES_DIR / "tok512.bin"
LLAMA2_SP = SHARED / "models/llama2-tokenizer/tokenizer.model"
TINYSTORIES = SHARED / "data/tinystories_v2_train_first2MiB.txt"


def shared_file(path: Path) -> Path:
    """``path`` if it exists, else skip the calling test."""
    if not path.is_file():
        pytest.skip(f"shared file missing: {path}")
    return path


def build_byte_level_bpe(directory: Path, add_bos_post_processor: bool = False) -> Path:
    """Train a small byte-level BPE (GPT-2 style) on a few KB of TinyStories into ``directory``.

    Writes ``tokenizer.json`` and a ``tokenizer_config.json`` with ``<|endoftext|>`` as EOS and
    ``<s>`` as BOS (added by the post-processor when asked), and a ChatML-like template.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    text = shared_file(TINYSTORIES).read_text(encoding="utf-8")[:8000]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text, "héllo wörld 日本語 🙂"], trainer)
    if add_bos_post_processor:
        bos = tok.token_to_id("<s>")
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", bos)]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
        "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "<|endoftext|>",
        "chat_template": template,
    }
    import json

    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
