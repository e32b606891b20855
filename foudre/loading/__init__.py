"""Loading models and tokenizers: Hugging Face directories and Hub ids, GGUF, llama2.c."""

from __future__ import annotations

from foudre.loading.detokenizer import IncrementalDetokenizer
from foudre.loading.errors import ModelLoadError
from foudre.loading.gguf import load_gguf, load_gguf_tokenizer
from foudre.loading.hf import (
    iter_safetensors_weights,
    load_generation_config,
    load_hf_config,
    resolve_model_path,
)
from foudre.loading.llama2c import load_llama2c
from foudre.loading.loader import load_tokenizer
from foudre.loading.tokenizer import (
    HFTokenizer,
    Llama2cTokenizer,
    SentencePieceTokenizer,
    Tokenizer,
)

__all__ = [
    "HFTokenizer",
    "IncrementalDetokenizer",
    "Llama2cTokenizer",
    "ModelLoadError",
    "SentencePieceTokenizer",
    "Tokenizer",
    "iter_safetensors_weights",
    "load_generation_config",
    "load_gguf",
    "load_gguf_tokenizer",
    "load_hf_config",
    "load_llama2c",
    "load_tokenizer",
    "resolve_model_path",
]
