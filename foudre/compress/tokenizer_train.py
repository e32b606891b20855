"""Training a byte-level BPE tokenizer whose one special token is ``<|endoftext|>``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from foudre.compress.data import SEPARATOR

# A minimal template: one "role: content" line per message, BOS first (the chat command encodes
# the rendered prompt without adding special tokens).
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def train_tokenizer(
    docs: Sequence[str], vocab_size: int, output: str | Path, model_max_length: int = 2048
) -> Path:
    """Train a byte-level BPE of ``vocab_size`` tokens on ``docs`` into ``output``.

    Writes ``tokenizer.json`` and ``tokenizer_config.json``. ``<|endoftext|>`` (id 0) is both BOS
    and EOS; encoding with special tokens prepends it, in foudre and in transformers alike.
    Every byte is in the alphabet, so any text encodes without unknown tokens.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        raise ValueError(f"vocab_size must be at least {len(alphabet) + 1}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[SEPARATOR],
        initial_alphabet=alphabet,
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer, length=len(docs))
    eot = tok.token_to_id(SEPARATOR)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SEPARATOR} $A",
        pair=f"{SEPARATOR} $A {SEPARATOR} $B",
        special_tokens=[(SEPARATOR, eot)],
    )
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SEPARATOR,
        "eos_token": SEPARATOR,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
