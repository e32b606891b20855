"""Batched sampling: penalties, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

The sampler is a small function of a ``SamplingBatch``: the step's per-row parameters as
tensors (the runner's persistent batch gathers them from its slots, ``runner/input_batch.py``),
so the whole batch is warped in a handful of vectorised ops and a row costs Python work only
where it asks for something rare (allowed token ids, a logit bias, ``min_tokens``, a seed,
logprobs, a grammar). Sampling uses the exponential race (``argmax(p / E)`` with
``E ~ Exp(1)``), which draws exactly from ``p`` and lets a seeded request take its noise from
its own generator: the same seed gives the same tokens whatever the batch.

The stages are separate so that speculative verification (``sample/rejection.py``) warps the
target's logits exactly as plain sampling does: ``process_logits`` (grammar masks,
allowed ids and bias, min_tokens, penalties) -> ``warp`` (temperature, top-k, top-p, min-p) ->
``draw``. ``batch_of_rows`` builds a batch from request-like rows (``SamplingRow``), for callers
that hold such objects (tests, the draft model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from foudre.sampling_params import SamplingParams
from foudre.structured.grammar import GrammarMasks, GrammarMatcher, fill_masks


class SamplingRow(Protocol):
    """What sampling reads of a request-like object (``Request`` is one)."""

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
class Penalties:
    """Repetition (prompt and output, multiplicative), presence and frequency (output only) of
    the batch rows ``rows`` (the others have none): per such row its parameters and its token
    counts over the whole vocabulary."""

    rows: torch.Tensor  # int64 [P]: batch rows
    repetition: torch.Tensor  # float32 [P]
    presence: torch.Tensor  # float32 [P]
    frequency: torch.Tensor  # float32 [P]
    output_counts: torch.Tensor  # float32 [P, vocab]: occurrences in the output
    seen: torch.Tensor  # bool [P, vocab]: in the prompt or the output


@dataclass(slots=True)
class SamplingBatch:
    """One step's sampling parameters, one row per logits row.

    ``temperature`` is 1 on greedy rows (they take the argmax); ``top_k`` / ``top_p`` /
    ``min_p`` are None when no row uses them, ``generators`` when no row is seeded, ``logprobs``
    when no row asks for them. ``allowed``, ``bias`` and ``banned`` list the rows that restrict
    tokens (allowed ids, a logit bias, end tokens banned until ``min_tokens``)."""

    greedy: torch.Tensor  # bool [N]
    all_greedy: bool
    temperature: torch.Tensor  # float32 [N]
    top_k: torch.Tensor | None = None  # int64 [N], <= 0: off
    top_p: torch.Tensor | None = None  # float32 [N]
    min_p: torch.Tensor | None = None  # float32 [N]
    penalties: Penalties | None = None
    allowed: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    bias: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    banned: list[tuple[int, list[int]]] = field(default_factory=list)
    generators: list[torch.Generator | None] | None = None
    logprobs: list[int | None] | None = None
    grammars: GrammarMasks | None = None

    def __len__(self) -> int:
        return int(self.greedy.shape[0])


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # per row: {token id: logprob} with the sampled token first, then the top-n; None if unasked
    logprobs: list[dict[int, float] | None]


def banned_until_min_tokens(
    params: SamplingParams, eos_token_ids: frozenset[int], num_output: int
) -> list[int]:
    """The tokens a row may not sample while its output (``num_output`` tokens) is shorter
    than ``min_tokens``: its stop token ids and, unless ``ignore_eos``, its end tokens."""
    if not params.min_tokens or num_output >= params.min_tokens:
        return []
    return list(params.stop_token_ids) + ([] if params.ignore_eos else list(eos_token_ids))


def token_rules(
    params: SamplingParams, device: torch.device
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
    """A row's ``allowed_token_ids`` and ``logit_bias`` (ids, values) as tensors (None: none)."""
    allowed = None
    if params.allowed_token_ids is not None:
        allowed = torch.tensor(params.allowed_token_ids, device=device)
    bias = None
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=device)
        bias = ids, torch.tensor(list(params.logit_bias.values()), device=device)
    return allowed, bias


def penalize(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """``logits`` with the rows ``p.rows`` penalised (the others untouched, as bits)."""
    x = logits[p.rows]
    rep = p.repetition.view(-1, 1)
    penalised = torch.where(x > 0, x / rep, x * rep)
    x = torch.where(p.seen, penalised, x)
    x = (
        x
        - p.frequency.view(-1, 1) * p.output_counts
        - p.presence.view(-1, 1) * (p.output_counts > 0)
    )
    logits[p.rows] = x
    return logits


def penalties_of_rows(rows: Sequence[SamplingRow], vocab: int, device: torch.device) -> Penalties:
    """The ``Penalties`` of every row of ``rows`` (counts from their token lists)."""
    n = len(rows)
    counts = torch.zeros(n, vocab + 1, device=device)
    seen = torch.zeros(n, vocab + 1, dtype=torch.bool, device=device)
    max_out = max(len(r.output_token_ids) for r in rows)
    if max_out:
        ids = torch.full((n, max_out), vocab, dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, : len(r.output_token_ids)] = torch.tensor(r.output_token_ids)
        counts.scatter_add_(1, ids.to(device), torch.ones(ids.shape, device=device))
    ids = torch.full((n, max(r.num_tokens for r in rows)), vocab, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : r.num_tokens] = torch.tensor(r.all_token_ids)
    seen.scatter_(1, ids.to(device), True)
    params = [r.sampling_params for r in rows]
    return Penalties(
        torch.arange(n, device=device),
        torch.tensor([p.repetition_penalty for p in params], device=device),
        torch.tensor([p.presence_penalty for p in params], device=device),
        torch.tensor([p.frequency_penalty for p in params], device=device),
        counts[:, :vocab],
        seen[:, :vocab],
    )


def apply_penalties(logits: torch.Tensor, requests: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition (prompt and output, multiplicative), presence and frequency (output only)."""
    return penalize(logits, penalties_of_rows(requests, logits.shape[-1], logits.device))


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


def process_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Grammar masks (structured output), ``allowed_token_ids`` and ``logit_bias``, min_tokens
    (end-of-sequence tokens banned until reached, unless the grammar allows nothing else) and
    penalties, in place where possible. The result's argmax is the greedy token. Token ids must
    lie in the vocabulary (the engine checks them at admission)."""
    grammars = batch.grammars
    if grammars is not None:
        grammars.apply(logits)
    for i, keep in batch.allowed:
        masked = torch.full_like(logits[i], float("-inf"))
        masked[keep] = logits[i, keep]
        logits[i] = masked
    for i, ids, values in batch.bias:
        logits[i, ids] += values.to(logits.dtype)
    for i, banned in batch.banned:
        if not (grammars is not None and grammars.allows_only(i, banned)):
            logits[i, banned] = float("-inf")
    if batch.penalties is not None:
        logits = penalize(logits, batch.penalties)
    return logits


def warp(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """The distribution each row draws from: temperature, top-k, top-p, min-p. Greedy rows get
    temperature 1 (callers take their argmax instead)."""
    x = logits / batch.temperature.view(-1, 1)
    if batch.top_k is not None and batch.top_p is not None:
        x = _top_k_top_p(x, batch.top_k, batch.top_p)
    probs = x.softmax(dim=-1)
    if batch.min_p is not None:
        min_p = batch.min_p.view(-1, 1)
        probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0)
    return probs


def warp_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``warp`` for rows of these parameters."""
    return warp(logits, _params_batch(params, logits.device))


def _params_batch(params: Sequence[SamplingParams], device: torch.device) -> SamplingBatch:
    """The tensors of a batch of rows of these parameters (no penalties, rules nor seeds)."""
    greedy = [p.greedy for p in params]
    batch = SamplingBatch(
        torch.tensor(greedy, device=device),
        all(greedy),
        torch.tensor([p.temperature if p.temperature > 0 else 1.0 for p in params]).to(device),
    )
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        batch.top_k = torch.tensor([p.top_k for p in params], device=device)
        batch.top_p = torch.tensor([p.top_p for p in params], device=device)
    if any(p.min_p > 0 for p in params):
        batch.min_p = torch.tensor([p.min_p for p in params], device=device)
    if any(p.logprobs is not None for p in params):
        batch.logprobs = [p.logprobs for p in params]
    return batch


def batch_of_rows(
    rows: Sequence[SamplingRow],
    vocab: int,
    device: torch.device,
    drafts: Sequence[Sequence[int]] | None = None,
) -> SamplingBatch:
    """The ``SamplingBatch`` of request-like ``rows`` (one logits row each; with ``drafts``,
    the grammar masks of a verification, see ``structured.fill_masks``)."""
    params = [r.sampling_params for r in rows]
    batch = _params_batch(params, device)
    for i, (r, p) in enumerate(zip(rows, params, strict=True)):
        allowed, bias = token_rules(p, device)
        if allowed is not None:
            batch.allowed.append((i, allowed))
        if bias is not None:
            batch.bias.append((i, *bias))
        banned = banned_until_min_tokens(p, r.eos_token_ids, len(r.output_token_ids))
        if banned:
            batch.banned.append((i, banned))
    if any(p.has_penalties for p in params):
        batch.penalties = penalties_of_rows(rows, vocab, device)
    if any(r.generator is not None for r in rows):
        batch.generators = [r.generator for r in rows]
    if any(r.grammar is not None for r in rows):
        drafts = drafts if drafts is not None else [()] * len(rows)
        batch.grammars = fill_masks(
            [(r.grammar, d) for r, d in zip(rows, drafts, strict=True)], vocab
        )
    return batch


def exponential_noise(
    shape: tuple[int, int],
    generators: Sequence[torch.Generator | None] | None,
    device: torch.device,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``Exp(1)`` noise ``[rows, vocab]``; a row with its own generator draws only from it."""
    noise = torch.empty(shape, device=device).exponential_(generator=generator)
    for i, g in enumerate(generators or ()):
        if g is not None:
            # a request's generator lives on the CPU (requests do not know the device)
            noise[i] = torch.empty(shape[1]).exponential_(generator=g).to(device)
    return noise


def draw(
    probs: torch.Tensor,
    generators: Sequence[torch.Generator | None] | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of (possibly unnormalised) ``probs`` by the exponential race."""
    noise = exponential_noise((probs.shape[0], probs.shape[1]), generators, probs.device, generator)
    return (probs / noise).argmax(dim=-1)


def gather_logprobs(
    raw_logprobs: torch.Tensor, tokens: list[int], wanted: Sequence[int | None]
) -> list[dict[int, float] | None]:
    """Per row: the chosen token's logprob, then the top-n (None where logprobs were not asked:
    ``wanted[i]`` is None)."""
    rows: list[dict[int, float] | None] = [None] * len(tokens)
    token_t = torch.tensor(tokens, device=raw_logprobs.device).view(-1, 1)
    chosen = raw_logprobs.gather(1, token_t).view(-1).tolist()
    max_n = max(n or 0 for n in wanted)
    top_vals, top_ids = raw_logprobs.topk(max_n, dim=-1) if max_n else (None, None)
    for i, n in enumerate(wanted):
        if n is None:
            continue
        entry: dict[int, float] = {tokens[i]: chosen[i]}
        if n and top_vals is not None and top_ids is not None:
            for tid, val in zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist(), strict=True):
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
    batch: SamplingBatch | Sequence[SamplingRow],
    generator: torch.Generator | None = None,
) -> SamplerOutput:
    """Pick one token per row of ``logits`` (float32 ``[N, vocab]``); ``batch`` gives the rows'
    parameters (or request-like rows, gathered into one with ``batch_of_rows``)."""
    if not isinstance(batch, SamplingBatch):
        batch = batch_of_rows(batch, logits.shape[-1], logits.device)
    raw_logprobs = logits.log_softmax(dim=-1) if batch.logprobs is not None else None
    logits = process_logits(logits, batch)
    greedy_tokens = logits.max(dim=-1).indices  # argmax's (the first maximum), in half the time
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        sampled = draw(warp(logits, batch), batch.generators, generator)
        tokens = torch.where(batch.greedy, greedy_tokens, sampled)
    token_list = tokens.tolist()
    logprob_rows: list[dict[int, float] | None] = [None] * len(token_list)
    if raw_logprobs is not None and batch.logprobs is not None:
        logprob_rows = gather_logprobs(raw_logprobs, token_list, batch.logprobs)
    return SamplerOutput(token_ids=token_list, logprobs=logprob_rows)
