"""The rejection sampler keeps the target's distribution: chi-squared goodness of fit.

Every test draws many thousand samples from a fixed seed and rejects at p < 1e-3 (so a correct
sampler fails with probability 1/1000 per test for a fresh seed, and never for the fixed one),
while a sampler that simply kept the draft's choice fails by hundreds of standard deviations.
"""

from __future__ import annotations

import torch

from foudre.sample.rejection import rejection_sample

P_THRESHOLD = 1e-3


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's goodness-of-fit p-value (bins with expected count 0 must have count 0)."""
    n = counts.sum()
    expected = probs.double() * n
    keep = expected > 0
    assert counts[~keep].sum() == 0, "samples where the distribution has no mass"
    stat = (((counts[keep].double() - expected[keep]) ** 2) / expected[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0), stat / 2.0))


def _dist(g: torch.Generator, vocab: int, sharp: float) -> torch.Tensor:
    return (torch.randn(vocab, generator=g) * sharp).softmax(dim=-1)


def _run(p: torch.Tensor, q: torch.Tensor, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw drafts from q, verify against p; ``p`` ``[k+1, V]``, ``q`` ``[k, V]``."""
    g = torch.Generator().manual_seed(seed)
    k, vocab = q.shape
    drafts = torch.stack(
        [torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1
    )
    uniform = torch.rand(n, k, generator=g)
    noise = torch.empty(n, vocab).exponential_(generator=g)
    return rejection_sample(
        p.expand(n, -1, -1), q.expand(n, -1, -1), drafts, torch.full((n,), k), uniform, noise
    )


def test_first_and_second_tokens_follow_target() -> None:
    g = torch.Generator().manual_seed(0)
    vocab, k, n = 12, 3, 40_000
    p = torch.stack([_dist(g, vocab, 1.5) for _ in range(k + 1)])
    q = torch.stack([_dist(g, vocab, 1.5) for _ in range(k)])
    p[0, 3] = 0.0  # a token the target never emits but the draft proposes
    p[0] /= p[0].sum()
    tokens, accepted = _run(p, q, n, seed=1)
    first = torch.bincount(tokens[:, 0], minlength=vocab)
    assert chi2_pvalue(first, p[0]) > P_THRESHOLD
    assert first[3] == 0
    # the second token, whenever emitted (first draft accepted), follows p_2
    second = torch.bincount(tokens[accepted >= 1, 1], minlength=vocab)
    assert second.sum() > 5000
    assert chi2_pvalue(second, p[1]) > P_THRESHOLD
    # acceptance rate of the first draft is sum_x min(p, q)
    expected_rate = torch.minimum(p[0], q[0]).sum().item()
    assert abs((accepted >= 1).float().mean().item() - expected_rate) < 0.015


def test_keeping_the_draft_would_fail_the_same_test() -> None:
    """The test has power: the draft's own distribution is rejected."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 12, 40_000
    p, q = _dist(g, vocab, 1.5).view(1, -1), _dist(g, vocab, 1.5).view(1, -1)
    drafts = torch.multinomial(q[0], n, replacement=True, generator=g)
    assert chi2_pvalue(torch.bincount(drafts, minlength=vocab), p[0]) < 1e-12


def test_one_hot_draft_ngram_style() -> None:
    """n-gram drafts are deterministic: q = one-hot; the output still follows p."""
    g = torch.Generator().manual_seed(2)
    vocab, n = 10, 30_000
    p = torch.stack([_dist(g, vocab, 1.0) for _ in range(2)])
    q = torch.zeros(1, vocab)
    q[0, 4] = 1.0
    tokens, accepted = _run(p, q, n, seed=3)
    assert chi2_pvalue(torch.bincount(tokens[:, 0], minlength=vocab), p[0]) > P_THRESHOLD
    assert abs(accepted.float().mean().item() - p[0, 4].item()) < 0.015


def test_draft_equal_target_accepts_everything() -> None:
    g = torch.Generator().manual_seed(4)
    p = torch.stack([_dist(g, 16, 2.0) for _ in range(5)])
    tokens, accepted = _run(p, p[:4].clone(), 5000, seed=5)
    assert bool((accepted == 4).all())
    assert chi2_pvalue(torch.bincount(tokens[:, 4], minlength=16), p[4]) > P_THRESHOLD


def test_greedy_one_hot_target_accepts_only_the_argmax() -> None:
    vocab = 8
    p = torch.zeros(3, vocab)
    p[0, 5] = p[1, 2] = p[2, 7] = 1.0  # greedy target: one-hot argmax at each position
    q = torch.full((2, vocab), 1.0 / vocab)
    drafts = torch.tensor([[5, 2], [5, 1], [0, 2]])
    tokens, accepted = rejection_sample(
        p.expand(3, -1, -1),
        q.expand(3, -1, -1),
        drafts,
        torch.tensor([2, 2, 2]),
        torch.rand(3, 2),
        torch.empty(3, vocab).exponential_(),
    )
    assert accepted.tolist() == [2, 1, 0]
    assert tokens[0].tolist() == [5, 2, 7]
    assert tokens[1, :2].tolist() == [5, 2]
    assert tokens[2, 0].item() == 5


def test_rows_with_fewer_drafts_and_none() -> None:
    vocab = 6
    p = torch.zeros(2, 3, vocab)
    p[:, :, 1] = 1.0
    q = torch.zeros(2, 2, vocab)
    q[:, :, 1] = 1.0
    tokens, accepted = rejection_sample(
        p,
        q,
        torch.ones(2, 2, dtype=torch.long),
        torch.tensor([1, 0]),
        torch.zeros(2, 2),
        torch.ones(2, vocab),
    )
    assert accepted.tolist() == [1, 0]  # padding beyond a row's drafts is never accepted
    assert tokens[0, :2].tolist() == [1, 1] and tokens[1, 0].item() == 1
