"""Batched sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Every request of the batch has its own parameters; they are gathered into tensors so the whole
batch is warped in a handful of vectorised ops. Sampling uses the exponential race
(``argmax(p / E)`` with ``E ~ Exp(1)``), which draws exactly from ``p`` and lets a seeded request
take its noise from its own generator: the same seed gives the same tokens whatever the batch.

The stages are separate so that speculative verification (``foudre/speculative``) warps the target's
logits exactly as plain sampling does: ``process_logits`` (grammar masks, min_tokens,
penalties) -> ``warp_probs`` (temperature, top-k, top-p, min-p) -> ``draw``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from foudre.sampling_params import SamplingParams
from foudre.structured.grammar import GrammarMasks, GrammarMatcher, fill_masks


class SamplingRow(Protocol):
    """What sampling reads of a request (``Request`` is one; speculation adds draft views)."""

    @property
    def sampling_params(self) -> SamplingParams: ...
    @property
    def output_token_ids(self) -> list[int]: ...
    @property
    def eos_token_ids(self) -> frozenset[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def generator(self) -> torch.Generator | None: ...
    @property
    def grammar(self) -> GrammarMatcher | None: ...


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # per row: {token id: logprob} with the sampled token first, then the top-n; None if unasked
    logprobs: list[dict[int, float] | None]


def apply_penalties(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt and output, multiplicative), presence and frequency (output only)."""
    n, vocab = logits.shape
    device = logits.device
    rep = torch.tensor([r.sampling_params.repetition_penalty for r in requests], device=device)
    pres = torch.tensor([r.sampling_params.presence_penalty for r in requests], device=device)
    freq = torch.tensor([r.sampling_params.frequency_penalty for r in requests], device=device)
    out_counts = torch.zeros(n, vocab + 1, device=device)
    seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=device)
    max_out = max(len(r.output_token_ids) for r in requests)
    max_all = max(r.num_tokens for r in requests)
    if max_out:
        ids = torch.full((n, max_out), vocab, dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, : len(r.output_token_ids)] = torch.tensor(r.output_token_ids)
        out_counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    ids = torch.full((n, max_all), vocab, dtype=torch.long)
    for i, r in enumerate(requests):
        ids[i, : r.num_tokens] = torch.tensor(r.all_token_ids)
    seen.scatter_(1, ids.to(device), True)
    out_counts, seen = out_counts[:, :vocab], seen[:, :vocab]
    rep = rep.view(-1, 1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    logits = logits - freq.view(-1, 1) * out_counts - pres.view(-1, 1) * (out_counts > 0)
    return logits


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    vocab = logits.shape[-1]
    ranks = torch.arange(vocab, device=logits.device).view(1, -1)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).view(-1, 1)
    remove = ranks >= k
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
    remove |= before >= top_p.view(-1, 1)  # the top token always stays (its "before" is 0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def process_logits(
    logits: torch.Tensor, requests: Sequence[SamplingRow], grammars: GrammarMasks | None = None
) -> torch.Tensor:
    """Grammar masks (structured output), ``allowed_token_ids`` and ``logit_bias``, min_tokens
    (end-of-sequence tokens banned until reached, unless the grammar allows nothing else) and
    penalties, in place where possible. The result's argmax is the greedy token. Token ids must
    lie in the vocabulary (the engine checks them at admission)."""
    if grammars is not None:
        grammars.apply(logits)
    for i, r in enumerate(requests):
        p = r.sampling_params
        if p.allowed_token_ids is not None:
            keep = torch.tensor(p.allowed_token_ids, device=logits.device)
            masked = torch.full_like(logits[i], float("-inf"))
            masked[keep] = logits[i, keep]
            logits[i] = masked
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), device=logits.device)
            logits[i, ids] += bias.to(logits.dtype)
        if p.min_tokens and len(r.output_token_ids) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
            if banned and not (grammars is not None and grammars.allows_only(i, banned)):
                logits[i, banned] = float("-inf")
    if any(r.sampling_params.has_penalties for r in requests):
        logits = apply_penalties(logits, requests)
    return logits


def warp_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distribution a sampled request draws from: temperature, top-k, top-p, min-p.
    Greedy rows get temperature 1 (callers take their argmax instead)."""
    device = logits.device
    temps = torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params])
    x = logits / temps.view(-1, 1).to(device)
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        top_k = torch.tensor([p.top_k for p in params], device=device)
        top_p = torch.tensor([p.top_p for p in params], device=device)
        x = _top_k_top_p(x, top_k, top_p)
    probs = x.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device).view(-1, 1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0)
    return probs


def exponential_noise(
    shape: tuple[int, int],
    generators: Sequence[torch.Generator | None],
    device: torch.device,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``Exp(1)`` noise ``[rows, vocab]``; a row with its own generator draws only from it."""
    noise = torch.empty(shape, device=device).exponential_(generator=generator)
    for i, g in enumerate(generators):
        if g is not None:
            # a request's generator lives on the CPU (Request does not know the device)
            noise[i] = torch.empty(shape[1]).exponential_(generator=g).to(device)
    return noise


def draw(
    probs: torch.Tensor,
    rows: Sequence[SamplingRow],
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of (possibly unnormalised) ``probs`` by the exponential race."""
    noise = exponential_noise(
        (probs.shape[0], probs.shape[1]), [r.generator for r in rows], probs.device, generator
    )
    return (probs / noise).argmax(dim=-1)


def gather_logprobs(
    raw_logprobs: torch.Tensor, tokens: list[int], params: Sequence[SamplingParams]
) -> list[dict[int, float] | None]:
    """Per row: the chosen token's logprob, then the top-n (None where logprobs were not asked)."""
    rows: list[dict[int, float] | None] = [None] * len(tokens)
    token_t = torch.tensor(tokens, device=raw_logprobs.device).view(-1, 1)
    chosen = raw_logprobs.gather(1, token_t).view(-1).tolist()
    max_n = max(p.logprobs or 0 for p in params)
    top_vals, top_ids = raw_logprobs.topk(max_n, dim=-1) if max_n else (None, None)
    for i, p in enumerate(params):
        if p.logprobs is None:
            continue
        entry: dict[int, float] = {tokens[i]: chosen[i]}
        if p.logprobs and top_vals is not None and top_ids is not None:
            for tid, val in zip(
                top_ids[i, : p.logprobs].tolist(), top_vals[i, : p.logprobs].tolist(), strict=True
            ):
                entry.setdefault(tid, val)
        rows[i] = entry
    return rows


def grammar_masks(
    logits: torch.Tensor, requests: Sequence[SamplingRow], drafts: Sequence[Sequence[int]]
) -> GrammarMasks | None:
    """The grammar bitmasks of the constrained rows (``structured.fill_masks``), None when no
    request is constrained: unconstrained batches do no grammar work at all."""
    if all(r.grammar is None for r in requests):
        return None
    rows = [(r.grammar, d) for r, d in zip(requests, drafts, strict=True)]
    return fill_masks(rows, logits.shape[-1])


def sample(
    logits: torch.Tensor,
    requests: Sequence[SamplingRow],
    generator: torch.Generator | None = None,
) -> SamplerOutput:
    """Pick one token per row of ``logits`` (float32 ``[N, vocab]``) for ``requests``."""
    params = [r.sampling_params for r in requests]
    want_logprobs = any(p.logprobs is not None for p in params)
    raw_logprobs = logits.log_softmax(dim=-1) if want_logprobs else None
    grammars = grammar_masks(logits, requests, [()] * len(requests))
    logits = process_logits(logits, requests, grammars)
    greedy_tokens = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        tokens = greedy_tokens
    else:
        sampled = draw(warp_probs(logits, params), requests, generator)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        tokens = torch.where(is_greedy, greedy_tokens, sampled)
    token_list = tokens.tolist()
    logprob_rows: list[dict[int, float] | None] = [None] * len(requests)
    if raw_logprobs is not None:
        logprob_rows = gather_logprobs(raw_logprobs, token_list, params)
    return SamplerOutput(token_ids=token_list, logprobs=logprob_rows)
