"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023).

For draft tokens ``d_1..d_k`` drawn from the proposer's distributions ``q_j`` and the target's
warped distributions ``p_j`` at the same positions (plus ``p_{k+1}`` after the last draft)::

    accept d_j with probability min(1, p_j(d_j) / q_j(d_j)), in order, until the first rejection
    at the first rejected position j: emit a token from norm(max(0, p_j - q_j))
    if all k are accepted:           emit a bonus token from p_{k+1}

Every emitted token is then distributed exactly as the target alone would have sampled it.
Greedy requests use ``p_j = one-hot(argmax)``, so they accept while the draft equals the target's
argmax and then emit that argmax: their output is identical with and without speculation. An
n-gram proposer has no distribution: ``q_j = one-hot(d_j)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from foudre.sample.sampler import (
    SamplingBatch,
    exponential_noise,
    gather_logprobs,
    process_logits,
    warp,
)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft_tokens: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vectorised over a batch padded to ``K`` drafts.

    ``target_probs`` ``[B, K+1, V]``, ``draft_probs`` ``[B, K, V]`` (rows need not be
    normalised), ``draft_token_ids`` ``[B, K]``, ``num_draft_tokens`` ``[B]`` (``<= K``; padding
    beyond it is ignored), ``uniform`` ``[B, K]`` in [0, 1), ``noise`` ``[B, V]`` ~ Exp(1).
    Returns ``tokens`` ``[B, K+1]`` and ``num_accepted`` ``[B]``: row ``b`` emits
    ``tokens[b, : num_accepted[b] + 1]``.
    """
    b, k1, _ = target_probs.shape
    k = k1 - 1
    rows = torch.arange(b, device=target_probs.device)
    valid = torch.arange(k, device=target_probs.device).view(1, -1) < num_draft_tokens.view(-1, 1)
    ids = draft_token_ids.unsqueeze(-1)
    p_d = target_probs[:, :k].gather(-1, ids).squeeze(-1)
    q_d = draft_probs.gather(-1, ids).squeeze(-1)
    accept = (uniform * q_d < p_d) & valid  # u < p/q without dividing by zero
    num_accepted = accept.to(torch.long).cumprod(dim=-1).sum(dim=-1)
    p_next = target_probs[rows, num_accepted]
    rejected = num_accepted < num_draft_tokens
    q_next = draft_probs[rows, num_accepted.clamp(max=max(k - 1, 0))] if k else p_next
    residual = torch.where(rejected.view(-1, 1), (p_next - q_next).clamp(min=0), p_next)
    # p == q where q > 0 leaves no residual mass; then rejection had probability zero anyway
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    residual = torch.where(empty, p_next, residual)
    extra = (residual / noise).argmax(dim=-1)
    tokens = torch.zeros(b, k1, dtype=torch.long, device=target_probs.device)
    tokens[:, :k] = draft_token_ids
    tokens[rows, num_accepted] = extra
    return tokens, num_accepted


@dataclass(slots=True)
class VerifyOutput:
    token_ids: list[list[int]]  # per request: accepted drafts then one target token
    logprobs: list[list[dict[int, float]] | None]
    num_draft_tokens: list[int]
    num_accepted: list[int]


@dataclass(slots=True)
class DraftRows:
    """The requests of a verification, one entry each: its draft tokens (possibly none), the
    proposer's distributions they were drawn from (``[k, vocab]``; None: one-hot), its own
    generator (a seed), whether it is greedy, and the logprobs it asks for (None: none)."""

    drafts: list[list[int]]
    draft_probs: list[torch.Tensor | None]
    generators: list[torch.Generator | None]
    greedy: list[bool]
    logprobs: list[int | None]


def verify(
    logits: torch.Tensor,
    batch: SamplingBatch,
    rows: DraftRows,
    generator: torch.Generator | None = None,
) -> VerifyOutput:
    """Accept or reject each request's drafts against the target's ``logits``.

    ``logits`` holds ``len(drafts) + 1`` consecutive rows per request (the positions of the
    last computed token and of each draft); ``batch`` their parameters, one row per position (a
    draft position's penalties, min_tokens and grammar mask count the drafts before it).
    Requests without drafts simply sample one token.
    """
    device = logits.device
    counts = [len(d) for d in rows.drafts]
    k = max(counts)
    raw_logprobs = logits.log_softmax(dim=-1) if batch.logprobs is not None else None
    logits = process_logits(logits, batch)
    vocab = logits.shape[-1]
    one_hot = torch.zeros_like(logits).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    if batch.all_greedy:
        probs = one_hot
    else:
        probs = torch.where(batch.greedy.view(-1, 1), one_hot, warp(logits, batch))

    b = len(counts)
    target = torch.zeros(b, k + 1, vocab, device=device)
    draft = torch.zeros(b, k, vocab, device=device)
    draft_ids = torch.zeros(b, k, dtype=torch.long, device=device)
    uniform = torch.zeros(b, k, device=device)
    start = 0
    for i, n in enumerate(counts):
        target[i, : n + 1] = probs[start : start + n + 1]
        start += n + 1
        if n == 0:
            continue
        ids = torch.tensor(rows.drafts[i], device=device)
        draft_ids[i, :n] = ids
        spec_probs = rows.draft_probs[i]
        if spec_probs is None or rows.greedy[i]:
            draft[i, :n] = torch.zeros(n, vocab, device=device).scatter_(1, ids.view(-1, 1), 1.0)
        else:
            draft[i, :n] = spec_probs[:, :vocab].to(device)
        own = rows.generators[i]
        if own is not None:
            uniform[i, :n] = torch.rand(n, generator=own).to(device)
        else:
            uniform[i, :n] = torch.rand(n, generator=generator, device=device)
    noise = exponential_noise((b, vocab), rows.generators, device, generator)
    tokens, accepted = rejection_sample(
        target, draft, draft_ids, torch.tensor(counts, device=device), uniform, noise
    )
    token_rows = tokens.tolist()
    accepted_list = accepted.tolist()
    out_tokens = [row[: a + 1] for row, a in zip(token_rows, accepted_list, strict=True)]
    out_logprobs: list[list[dict[int, float]] | None] = [None] * b
    if raw_logprobs is not None:
        start = 0
        for i, n in enumerate(counts):
            toks = out_tokens[i]
            wanted = rows.logprobs[i]
            if wanted is not None:
                lp_rows = raw_logprobs[start : start + len(toks)]
                entries = gather_logprobs(lp_rows, toks, [wanted] * len(toks))
                out_logprobs[i] = [e for e in entries if e is not None]
            start += n + 1
    return VerifyOutput(out_tokens, out_logprobs, counts, accepted_list)
