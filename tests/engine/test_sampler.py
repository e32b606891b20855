"""Unit tests of ``foudre.sample.sampler`` and ``SamplingParams`` validation.

Distribution tests are χ² goodness-of-fit tests against probabilities computed independently in
float64 from the definitions (softmax(logits / T), renormalised top-k set, top-p nucleus, min-p).
The p-value is ``Q(df / 2, stat / 2)`` (the χ² survival function), computed with
``torch.special.gammaincc``; a test fails when p < 1e-3. Draws use fixed generators, so every test
is deterministic: the threshold only guards against an unlucky choice of seed, not flakiness.
"""

from __future__ import annotations

import math

import pytest
import torch

from foudre.engine.request import Request
from foudre.sample.sampler import apply_penalties, sample
from foudre.sampling_params import SamplingParams

P_REJECT = 1e-3
NUM_DRAWS = 20_000
BATCH = 2_000

# eight tokens with known probabilities, deliberately not in sorted order in the vocabulary
PROBS = [0.05, 0.35, 0.01, 0.15, 0.25, 0.03, 0.10, 0.06]
LOGITS = [math.log(p) for p in PROBS]
VOCAB = len(PROBS)


def make_req(params: SamplingParams, rid: str = "r0", **kw: object) -> Request:
    return Request(rid, [1, 2, 3], params, eos_token_ids=frozenset({2}), **kw)  # type: ignore[arg-type]


# -- reference distributions (float64, straight from the definitions) ------------------------------
def softmax(xs: list[float]) -> list[float]:
    m = max(x for x in xs if x != -math.inf)
    e = [math.exp(x - m) if x != -math.inf else 0.0 for x in xs]
    s = sum(e)
    return [v / s for v in e]


def renorm(probs: list[float], keep: set[int]) -> list[float]:
    s = sum(probs[i] for i in keep)
    return [probs[i] / s if i in keep else 0.0 for i in range(len(probs))]


def ref_top_k(probs: list[float], k: int) -> list[float]:
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    return renorm(probs, set(order[:k]))


def ref_top_p(probs: list[float], p: float) -> list[float]:
    """The smallest set of most likely tokens whose mass is at least p (top token always kept)."""
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    keep: set[int] = set()
    mass = 0.0
    for i in order:
        keep.add(i)
        mass += probs[i]
        if mass >= p:
            break
    return renorm(probs, keep)


def ref_min_p(probs: list[float], min_p: float) -> list[float]:
    top = max(probs)
    return renorm(probs, {i for i, q in enumerate(probs) if q >= min_p * top})


# -- χ² machinery ---------------------------------------------------------------------------------
def chi2_pvalue(counts: list[int], expected: list[float]) -> float:
    """Goodness-of-fit p-value of ``counts`` against probabilities ``expected`` (support only)."""
    n = sum(counts)
    support = [i for i, q in enumerate(expected) if q > 0]
    stat = sum((counts[i] - n * expected[i]) ** 2 / (n * expected[i]) for i in support)
    df = len(support) - 1
    if df == 0:
        return 1.0
    a = torch.tensor(df / 2, dtype=torch.float64)
    return float(torch.special.gammaincc(a, torch.tensor(stat / 2, dtype=torch.float64)))


def draw(
    configs: list[tuple[list[float], SamplingParams]], n: int = NUM_DRAWS, seed: int = 0
) -> list[list[int]]:
    """Sample ``n`` tokens for each config; rows of different configs are mixed in each batch."""
    gen = torch.Generator().manual_seed(seed)
    reqs = [make_req(params, f"r{j}") for j, (_, params) in enumerate(configs)]
    rows_per = BATCH // len(configs)
    logits = torch.tensor([row for row, _ in configs], dtype=torch.float32)
    logits = logits.repeat_interleave(rows_per, dim=0)
    batch_reqs = [r for r in reqs for _ in range(rows_per)]
    counts = torch.zeros(len(configs), len(configs[0][0]), dtype=torch.long)
    for _ in range(-(-n // rows_per)):
        out = sample(logits.clone(), batch_reqs, gen)
        toks = torch.tensor(out.token_ids).view(len(configs), rows_per)
        for j in range(len(configs)):
            counts[j] += torch.bincount(toks[j], minlength=counts.shape[1])
    return counts.tolist()


def assert_follows(counts: list[int], expected: list[float]) -> None:
    for i, q in enumerate(expected):
        if q == 0:
            assert counts[i] == 0, f"token {i} has probability 0 but was sampled {counts[i]} times"
    p = chi2_pvalue(counts, expected)
    assert p >= P_REJECT, f"χ² p-value {p:.2e}: counts {counts} vs expected {expected}"


def test_chi2_machinery() -> None:
    # Q(1/2, x/2) is the χ²(1) survival function: 3.841 is its 5% critical value
    p = chi2_pvalue([5000 + 98, 5000 - 98], [0.5, 0.5])  # stat = 2 * 98²/5000 = 3.8416
    assert p == pytest.approx(0.05, abs=1e-3)
    # and the tests have power: T=1 draws are rejected as draws from T=0.8
    (counts,) = draw([(LOGITS, SamplingParams(temperature=1.0))])
    assert chi2_pvalue(counts, softmax([x / 0.8 for x in LOGITS])) < P_REJECT
    assert chi2_pvalue(counts, PROBS) >= P_REJECT


# -- greedy ---------------------------------------------------------------------------------------
def test_greedy_picks_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 100, generator=gen)
    reqs = [make_req(SamplingParams(temperature=0.0), f"r{i}") for i in range(64)]
    out = sample(logits.clone(), reqs, gen)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 64


def test_greedy_rows_in_mixed_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(32, 50, generator=gen)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0, top_k=5) for i in range(32)]
    reqs = [make_req(p, f"r{i}") for i, p in enumerate(params)]
    out = sample(logits.clone(), reqs, gen)
    argmax = logits.argmax(dim=-1).tolist()
    for i in range(1, 32, 2):
        assert out.token_ids[i] == argmax[i]
    top5 = logits.topk(5, dim=-1).indices.tolist()
    for i in range(0, 32, 2):
        assert out.token_ids[i] in top5[i]


# -- distributions --------------------------------------------------------------------------------
CASES: dict[str, tuple[SamplingParams, list[float]]] = {
    "T=1": (SamplingParams(temperature=1.0), PROBS),
    "T=0.5": (SamplingParams(temperature=0.5), softmax([x / 0.5 for x in LOGITS])),
    "T=2": (SamplingParams(temperature=2.0), softmax([x / 2.0 for x in LOGITS])),
    "top_k=3": (SamplingParams(top_k=3), ref_top_k(PROBS, 3)),
    "top_k=1": (SamplingParams(top_k=1), ref_top_k(PROBS, 1)),
    "top_k=-1": (SamplingParams(top_k=-1), PROBS),
    # cumulative mass in order: 0.35, 0.60, 0.75 -> three tokens reach 0.7
    "top_p=0.7": (SamplingParams(top_p=0.7), ref_top_p(PROBS, 0.7)),
    "top_p=0.9": (SamplingParams(top_p=0.9), ref_top_p(PROBS, 0.9)),
    # the top token alone already has mass >= p: it is kept, nothing else
    "top_p=0.3": (SamplingParams(top_p=0.3), ref_top_p(PROBS, 0.3)),
    # threshold 0.3 * 0.35 = 0.105: keeps 0.35, 0.25, 0.15
    "min_p=0.3": (SamplingParams(min_p=0.3), ref_min_p(PROBS, 0.3)),
    "min_p=0.1": (SamplingParams(min_p=0.1), ref_min_p(PROBS, 0.1)),
    # temperature is applied before the truncations
    "T=2,top_k=4": (
        SamplingParams(temperature=2.0, top_k=4),
        ref_top_k(softmax([x / 2 for x in LOGITS]), 4),
    ),
    # top-p acts on the renormalised top-k set: top-4 = .35,.25,.15,.10 (cum .41,.71,.88 of .85)
    "top_k=4,top_p=0.8": (SamplingParams(top_k=4, top_p=0.8), ref_top_p(ref_top_k(PROBS, 4), 0.8)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_distribution(name: str) -> None:
    params, expected = CASES[name]
    (counts,) = draw([(LOGITS, params)], seed=list(CASES).index(name))
    assert_follows(counts, expected)


def test_reference_sets() -> None:
    """The hand-computed truncation sets the distribution tests rely on."""
    support = lambda ps: {i for i, q in enumerate(ps) if q > 0}  # noqa: E731
    assert support(ref_top_k(PROBS, 3)) == {1, 4, 3}
    assert support(ref_top_p(PROBS, 0.7)) == {1, 4, 3}
    assert support(ref_top_p(PROBS, 0.3)) == {1}
    assert support(ref_min_p(PROBS, 0.3)) == {1, 4, 3}
    assert support(ref_top_p(ref_top_k(PROBS, 4), 0.8)) == {1, 4, 3}


def test_exact_mass_boundaries() -> None:
    """Four tied tokens have exactly representable probabilities 0.25, so the boundaries of the
    definitions are exact: top_p=0.5 keeps exactly two tokens (mass 0.5 >= p), min_p=1 keeps all
    four (none is *below* the max)."""
    gen = torch.Generator().manual_seed(8)
    logits = torch.zeros(1, 4)

    def seen(params: SamplingParams) -> set[int]:
        req = make_req(params)
        # one row per call: ties are broken the same way every call, whatever the sort does
        return {sample(logits.clone(), [req], gen).token_ids[0] for _ in range(300)}

    assert len(seen(SamplingParams(top_p=0.5))) == 2
    assert len(seen(SamplingParams(top_p=0.75))) == 3
    assert len(seen(SamplingParams(top_p=1.0))) == 4
    assert len(seen(SamplingParams(min_p=1.0))) == 4
    assert len(seen(SamplingParams(top_k=2))) == 2


def test_mixed_batch_each_row_follows_its_own_params() -> None:
    names = ["T=0.5", "top_k=3", "top_p=0.7", "min_p=0.1", "T=2"]
    # different logits per config too, so that rows cannot borrow each other's distribution
    configs = []
    for j, name in enumerate(names):
        perm = [(i + 3 * j) % VOCAB for i in range(VOCAB)]
        configs.append(([LOGITS[perm[i]] for i in range(VOCAB)], CASES[name][0]))
    all_counts = draw(configs, seed=7)
    for j, name in enumerate(names):
        perm = [(i + 3 * j) % VOCAB for i in range(VOCAB)]
        expected = CASES[name][1]
        assert_follows(all_counts[j], [expected[perm[i]] for i in range(VOCAB)])


def test_excluded_tokens_never_sampled_with_large_vocab() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 1000, generator=gen).repeat(500, 1)
    top10 = set(logits[0].topk(10).indices.tolist())
    for params in (SamplingParams(top_k=10), SamplingParams(top_k=10, temperature=5.0)):
        reqs = [make_req(params)] * 500
        for _ in range(4):
            assert set(sample(logits.clone(), reqs, gen).token_ids) <= top10


# -- per-request seeds ----------------------------------------------------------------------------
def _seeded_run(layout: list[SamplingParams], target: int, steps: int, gen_seed: int) -> list[int]:
    """Tokens produced at batch position ``target`` over ``steps`` sampling steps."""
    vocab = 64
    target_logits = torch.randn(vocab, generator=torch.Generator().manual_seed(11))
    gen = torch.Generator().manual_seed(gen_seed)
    reqs = [make_req(p, f"r{i}") for i, p in enumerate(layout)]
    toks = []
    for _ in range(steps):
        logits = torch.randn(len(reqs), vocab, generator=gen) * 3  # neighbours change every step
        logits[target] = target_logits
        out = sample(logits, reqs, gen)
        for r, t in zip(reqs, out.token_ids):
            r.output_token_ids.append(t)
        toks.append(out.token_ids[target])
    return toks


def test_seed_reproducible_whatever_the_batch() -> None:
    seeded = SamplingParams(temperature=1.0, seed=123)
    alone = _seeded_run([seeded], 0, steps=8, gen_seed=0)
    batch_b = _seeded_run(
        [SamplingParams(), SamplingParams(seed=7), seeded, SamplingParams(temperature=0.0)],
        2,
        steps=8,
        gen_seed=1,
    )
    batch_c = _seeded_run(
        [SamplingParams(top_k=3)] * 5 + [seeded] + [SamplingParams(seed=123)],
        5,
        steps=8,
        gen_seed=2,
    )
    assert alone == batch_b == batch_c
    assert len(set(alone)) > 1  # it really samples


def test_different_seeds_differ() -> None:
    a = _seeded_run([SamplingParams(seed=123)], 0, steps=8, gen_seed=0)
    b = _seeded_run([SamplingParams(seed=124)], 0, steps=8, gen_seed=0)
    assert a != b


def test_unseeded_requests_follow_the_global_generator() -> None:
    a = _seeded_run([SamplingParams()] * 3, 1, steps=8, gen_seed=5)
    b = _seeded_run([SamplingParams()] * 3, 1, steps=8, gen_seed=5)
    c = _seeded_run([SamplingParams()] * 3, 1, steps=8, gen_seed=6)
    assert a == b != c


# -- penalties ------------------------------------------------------------------------------------
def reference_penalties(logits: list[float], req: Request) -> list[float]:
    p = req.sampling_params
    seen = set(req.prompt_token_ids) | set(req.output_token_ids)
    out = []
    for v, x in enumerate(logits):
        if v in seen:  # HF repetition penalty: prompt and output
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        c = req.output_token_ids.count(v)  # OpenAI presence/frequency: output only
        x -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
        out.append(x)
    return out


PENALTY_PARAMS = [
    SamplingParams(repetition_penalty=1.3),
    SamplingParams(repetition_penalty=0.7),
    SamplingParams(presence_penalty=0.5),
    SamplingParams(frequency_penalty=0.25),
    SamplingParams(presence_penalty=-0.4, frequency_penalty=1.5),
    SamplingParams(repetition_penalty=1.8, presence_penalty=1.0, frequency_penalty=-0.3),
    SamplingParams(),  # no penalty in the same batch
]


def _penalty_batch() -> tuple[torch.Tensor, list[Request]]:
    gen = torch.Generator().manual_seed(4)
    vocab = 16
    logits = torch.randn(len(PENALTY_PARAMS), vocab, generator=gen) * 2
    reqs = []
    for i, p in enumerate(PENALTY_PARAMS):
        prompt = torch.randint(0, vocab, (3 + i,), generator=gen).tolist()
        r = Request(f"r{i}", prompt, p, eos_token_ids=frozenset({2}))
        r.output_token_ids = torch.randint(0, vocab, (2 * i,), generator=gen).tolist()
        reqs.append(r)
    return logits, reqs


def test_penalties_match_direct_computation() -> None:
    logits, reqs = _penalty_batch()
    got = apply_penalties(logits.clone(), reqs)
    for i, r in enumerate(reqs):
        want = reference_penalties(logits[i].tolist(), r)
        assert got[i].tolist() == pytest.approx(want, rel=1e-6, abs=1e-6), r.sampling_params


def test_greedy_uses_penalised_logits() -> None:
    logits, reqs = _penalty_batch()
    for r in reqs:
        r.sampling_params.temperature = 0.0
    out = sample(logits.clone(), reqs)
    for i, r in enumerate(reqs):
        want = reference_penalties(logits[i].tolist(), r)
        assert out.token_ids[i] == max(range(len(want)), key=want.__getitem__)


def test_repetition_penalty_flips_choice() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.0, -1.0]])
    r = Request("r0", [1], SamplingParams(temperature=0.0, repetition_penalty=2.0))
    assert sample(logits.clone(), [r]).token_ids == [2]  # 3/2 < 2
    r = Request("r0", [0], SamplingParams(temperature=0.0, frequency_penalty=2.0))
    r.output_token_ids = [1, 1]  # 3 - 2*2 = -1
    assert sample(logits.clone(), [r]).token_ids == [2]
    r = Request("r0", [1], SamplingParams(temperature=0.0, presence_penalty=0.5))
    assert sample(logits.clone(), [r]).token_ids == [1]  # prompt tokens are not penalised


# -- logprobs -------------------------------------------------------------------------------------
def test_logprobs_sampled_and_top_n() -> None:
    gen = torch.Generator().manual_seed(5)
    vocab = 40
    logits = torch.randn(6, vocab, generator=gen) * 2
    params = [
        SamplingParams(logprobs=0),
        SamplingParams(logprobs=3),
        SamplingParams(logprobs=5, temperature=0.0),
        SamplingParams(),  # no logprobs asked
        SamplingParams(logprobs=20, temperature=1.7, top_k=4, repetition_penalty=1.5),
        SamplingParams(logprobs=2, temperature=0.3),
    ]
    reqs = [make_req(p, f"r{i}") for i, p in enumerate(params)]
    reqs[4].output_token_ids = [0, 1, 2]
    raw = torch.log_softmax(logits.double(), dim=-1)
    for _ in range(5):
        out = sample(logits.clone(), reqs, gen)
        for i, p in enumerate(params):
            row = out.logprobs[i]
            if p.logprobs is None:
                assert row is None
                continue
            assert row is not None
            tok = out.token_ids[i]
            items = list(row.items())
            assert items[0][0] == tok  # the sampled token comes first
            assert items[0][1] == pytest.approx(raw[i, tok].item(), abs=1e-5)
            top = raw[i].topk(p.logprobs)
            top_ids = top.indices.tolist()
            assert set(row) == {tok, *top_ids}
            # the top-n follow in descending order (the sampled one is not repeated)
            assert [t for t, _ in items[1:]] == [t for t in top_ids if t != tok]
            for t, v in items:
                assert v == pytest.approx(raw[i, t].item(), abs=1e-5)
        if params[2].logprobs:
            assert out.token_ids[2] == logits[2].argmax().item()


# -- min_tokens -----------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_eos_and_stop_ids(temperature: float) -> None:
    vocab = 10
    logits = torch.full((1, vocab), -2.0)
    logits[0, 2] = 10.0  # eos
    logits[0, 5] = 9.0  # stop token id
    logits[0, 7] = 0.0
    params = SamplingParams(temperature=temperature, min_tokens=3, stop_token_ids=[5])
    reqs = [make_req(params, f"r{i}") for i in range(200)]
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        for r in reqs:
            r.output_token_ids = [7] * step
        toks = sample(logits.repeat(200, 1), reqs, gen).token_ids
        assert not {2, 5} & set(toks), step
    for r in reqs:
        r.output_token_ids = [7] * 3
    toks = sample(logits.repeat(200, 1), reqs, gen).token_ids
    assert 2 in toks
    if temperature == 0.0:
        assert set(toks) == {2}


def test_min_tokens_only_affects_its_own_row() -> None:
    logits = torch.tensor([[0.0, 0.0, 5.0, 0.0]] * 2)
    reqs = [
        make_req(SamplingParams(temperature=0.0, min_tokens=2), "a"),
        make_req(SamplingParams(temperature=0.0), "b"),
    ]
    toks = sample(logits, reqs).token_ids
    assert toks[0] != 2 and toks[1] == 2


# -- SamplingParams validation --------------------------------------------------------------------
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_k", -2),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("n", 0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.5),
        ("min_tokens", -1),
    ],
)
def test_invalid_params_raise_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=0.0),
        dict(top_p=1.0),
        dict(top_p=1e-6),
        dict(top_k=-1),
        dict(top_k=0),
        dict(top_k=1),
        dict(min_p=0.0),
        dict(min_p=1.0),
        dict(max_tokens=1),
        dict(max_tokens=None),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(repetition_penalty=1e-3),
    ],
)
def test_valid_boundary_params(kwargs: dict[str, object]) -> None:
    SamplingParams(**kwargs)  # type: ignore[arg-type]


def test_top_k_minus_one_means_disabled() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_min_tokens_above_max_tokens_rejected() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=4)
