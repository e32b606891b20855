"""Perplexity and bits per byte of a model on documents of a text file.

Each document is its own sequence, ``[BOS] + tokens(text)``; every token after BOS is predicted
and counted (BOS itself and any EOS are not). A document longer than ``max_length`` tokens is
scored in windows of ``max_length`` that advance by half a window, so every token is predicted
once, with at least half a window of context. Bits per byte are total nats / ln 2 / the UTF-8
bytes of the documents' text, which makes them comparable across tokenizers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from foudre.compress.model import full_sequence_logits
from foudre.loading.tokenizer import Tokenizer
from foudre.models.llama import LlamaForCausalLM


@dataclass(slots=True)
class PerplexityResult:
    nats: float
    tokens: int
    bytes: int

    @property
    def nats_per_token(self) -> float:
        return self.nats / max(1, self.tokens)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nats_per_token)

    @property
    def bits_per_byte(self) -> float:
        return self.nats / math.log(2) / max(1, self.bytes)

    def line(self) -> str:
        """The summary line: ``perplexity=<x> bits_per_byte=<y> tokens=<n> bytes=<m>``."""
        return (
            f"perplexity={self.perplexity:.4f} bits_per_byte={self.bits_per_byte:.4f} "
            f"tokens={self.tokens} bytes={self.bytes}"
        )


@torch.no_grad()
def sequence_nats(
    model: LlamaForCausalLM, ids: Sequence[int], max_length: int, kv_cache_dtype: str = "auto"
) -> float:
    """Summed negative log-likelihood (nats) of ``ids[1:]`` given their prefixes."""
    if max_length < 2:
        raise ValueError(f"max_length must be at least 2, got {max_length}")
    n = len(ids)
    stride = max(1, max_length // 2)
    total = 0.0
    next_pred = 1  # index of the next token to predict
    while next_pred < n:
        end = min(n, max_length) if next_pred == 1 else min(n, next_pred + stride)
        start = max(0, end - max_length)
        window = torch.tensor(ids[start:end], dtype=torch.long)
        # logits[i] predicts window[i + 1]
        logits = full_sequence_logits(model, window, kv_cache_dtype)
        first = next_pred - start - 1
        pred_logits = logits[first : end - start - 1]
        targets = window[first + 1 :].to(pred_logits.device)
        total += float(F.cross_entropy(pred_logits, targets, reduction="sum"))
        next_pred = end
    return total


def perplexity(
    model: LlamaForCausalLM,
    tokenizer: Tokenizer,
    docs: Sequence[str],
    max_length: int | None = None,
    kv_cache_dtype: str = "auto",
) -> PerplexityResult:
    """Token perplexity and bits per byte of ``model`` over ``docs`` (see the module doc);
    ``kv_cache_dtype`` int8 / fp8 evaluates with K and V rounded as the quantized cache stores
    them."""
    bos = tokenizer.bos_token_id
    if bos is None:
        raise ValueError("the tokenizer has no BOS token; each document must start with one")
    limit = max_length or model.config.max_position_embeddings
    limit = min(limit, model.model.rotary.max_positions)
    model.eval()
    nats, tokens, n_bytes = 0.0, 0, 0
    for doc in docs:
        ids = [bos, *tokenizer.encode(doc, add_special_tokens=False)]
        nats += sequence_nats(model, ids, limit, kv_cache_dtype)
        tokens += len(ids) - 1
        n_bytes += len(doc.encode("utf-8"))
    return PerplexityResult(nats=nats, tokens=tokens, bytes=n_bytes)
