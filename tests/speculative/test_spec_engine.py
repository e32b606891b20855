"""Speculative decoding inside the engine: exact greedy output, the target's distribution when
sampling, rollback, and every block back in the pool."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.cli import main as cli_main
from foudre.outputs import RequestOutput
from foudre.speculative.proposers import NgramProposer
from tests.conftest import make_hf_model
from tests.speculative.test_rejection import P_THRESHOLD, chi2_pvalue

STORY = (
    "Once upon a time, there was a little girl named Lily. She loved to play in the park with "
    "her dog. One day, Lily and her dog went to the park."
)
PROMPTS = [STORY, "Tom had a red ball.", "The sun was", STORY + " Lily saw a big tree and"]


def _greedy(llm: LLM, prompts: list[Any], max_tokens: int = 40, **kw: Any) -> list[list[int]]:
    params = [
        SamplingParams(temperature=0.0, max_tokens=max_tokens + 7 * i, **kw)
        for i in range(len(prompts))
    ]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _assert_all_freed(llm: LLM) -> None:
    m = llm.metrics()
    assert m["num_free_blocks"] == m["num_total_blocks"]
    llm.engine.scheduler.check_invariants()
    proposer = llm.engine.proposer
    if proposer is not None and hasattr(proposer, "kv"):
        assert proposer.kv.num_free_blocks == proposer.kv.num_blocks
        assert not proposer.kv.req_blocks and not proposer.kv.req_hashes


@pytest.fixture(scope="module")
def embedded_reference() -> list[list[int]]:
    return _greedy(LLM(dtype="float32"), PROMPTS)


@pytest.mark.parametrize(
    "spec",
    [
        dict(speculative_method="draft"),
        dict(speculative_method="draft", num_speculative_tokens=7),
        dict(speculative_method="ngram", ngram_min=1, ngram_max=3),
    ],
)
def test_embedded_pair_greedy_identical(embedded_reference: list[list[int]], spec: dict) -> None:
    llm = LLM(dtype="float32", **spec)
    assert _greedy(llm, PROMPTS) == embedded_reference
    m = llm.metrics()
    assert m["spec_draft_tokens"] > 0
    assert 0 < m["spec_accepted_tokens"] <= m["spec_draft_tokens"]
    assert m["spec_mean_acceptance_length"] > 1.0
    per_pos = m["spec_accepted_per_position"]
    assert per_pos[0] >= per_pos[-1] and sum(per_pos) == m["spec_accepted_tokens"]
    _assert_all_freed(llm)


def test_stories260k_greedy_identical(stories_paths: tuple[str, str], tmp_path: Path) -> None:
    model, tok = stories_paths
    prompts = ["Once upon a time", "Lily and Tom went to the park. Lily and Tom", "The cat"]
    ref = _greedy(LLM(model=model, tokenizer=tok), prompts, max_tokens=60)
    # proposers built for it: prompt lookup, itself (100% acceptance), an int8 copy of itself
    ngram = LLM(model=model, tokenizer=tok, speculative_method="ngram")
    assert _greedy(ngram, prompts, max_tokens=60) == ref
    same = LLM(model=model, tokenizer=tok, speculative_model=model, num_speculative_tokens=3)
    assert _greedy(same, prompts, max_tokens=60) == ref
    m = same.metrics()
    assert m["spec_accepted_tokens"] == m["spec_draft_tokens"] > 0  # draft = target
    int8 = LLM(model=model, tokenizer=tok, speculative_model=model, speculative_quantization="int8")
    assert _greedy(int8, prompts, max_tokens=60) == ref
    _assert_all_freed(int8)
    # a draft built for it with foudre's own tools: stories260K with its least important layer
    # pruned away (ranked on a little story text)
    calib = tmp_path / "calib.txt"
    calib.write_text(STORY * 20)
    pruned = tmp_path / "pruned"
    rc = cli_main(["prune", "--model", model, "--tokenizer", tok, "--layers", "1",
                   "--calibration", str(calib), "--calibration-tokens", "512",
                   "--output", str(pruned), "--no-progress"])  # fmt: skip
    assert rc == 0
    draft = LLM(model=model, tokenizer=tok, speculative_model=str(pruned))
    assert _greedy(draft, prompts, max_tokens=60) == ref
    m = draft.metrics()
    assert 0 < m["spec_accepted_tokens"] < m["spec_draft_tokens"]
    _assert_all_freed(draft)


def test_random_hf_models_greedy_identical(tmp_path: Path) -> None:
    target = make_hf_model(tmp_path / "t", "llama", seed=0)
    draft = make_hf_model(
        tmp_path / "d",
        "llama",
        seed=1,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    # a draft whose (padded) vocabulary differs from the target's: 240 and 300 ids vs 256
    small = make_hf_model(tmp_path / "s", "llama", seed=2, vocab_size=240, num_hidden_layers=1)
    large = make_hf_model(tmp_path / "l", "llama", seed=3, vocab_size=300, num_hidden_layers=1)
    prompts: list[Any] = [[1, 5, 9, 250, 7, 5, 9], [1, *list(range(30, 90))], [3, 3, 3, 3]]
    ref = _greedy(LLM(model=str(target), skip_tokenizer_init=True), prompts, max_tokens=30)
    for spec in (
        dict(speculative_model=str(draft)),
        dict(speculative_model=str(small)),
        dict(speculative_model=str(large)),
        dict(speculative_method="ngram"),
    ):
        llm = LLM(model=str(target), skip_tokenizer_init=True, **spec)
        assert _greedy(llm, prompts, max_tokens=30) == ref, spec
        _assert_all_freed(llm)


def test_preemption_prefix_hits_and_chunking_with_speculation(
    embedded_reference: list[list[int]],
) -> None:
    # few blocks force preemption; the shared story prefix gives prefix-cache hits; a small
    # token budget chunks prefills and cuts drafts
    llm = LLM(
        dtype="float32",
        speculative_method="draft",
        num_kv_blocks=24,
        max_model_len=128,
        max_num_batched_tokens=24,
        block_size=8,
    )
    prompts = PROMPTS + PROMPTS
    out = _greedy(llm, prompts)
    n = len(PROMPTS)
    ref = _greedy(LLM(dtype="float32", max_model_len=128), prompts)
    assert out == ref
    assert out[:n] == embedded_reference
    m = llm.metrics()
    assert m["num_preemptions"] > 0
    assert m["prefix_cache_hits"] > 0
    _assert_all_freed(llm)


def test_penalties_min_tokens_stop_strings_and_logprobs() -> None:
    kw: dict[str, Any] = dict(repetition_penalty=1.3, min_tokens=5, logprobs=2, stop=[" park"])
    ref_llm = LLM(dtype="float32")
    spec_llm = LLM(dtype="float32", speculative_method="draft")
    params = SamplingParams(temperature=0.0, max_tokens=50, **kw)
    ref = ref_llm.generate(PROMPTS, params)
    out = spec_llm.generate(PROMPTS, params)
    for a, b in zip(out, ref, strict=True):
        ca, cb = a.outputs[0], b.outputs[0]
        assert ca.token_ids == cb.token_ids and ca.text == cb.text
        assert ca.finish_reason == cb.finish_reason
        assert ca.logprobs is not None and cb.logprobs is not None
        assert len(ca.logprobs) == len(ca.token_ids)
        for la, lb in zip(ca.logprobs, cb.logprobs, strict=True):
            assert la.keys() == lb.keys()
            for t in la:
                assert la[t] == pytest.approx(lb[t], abs=1e-4)
    _assert_all_freed(spec_llm)


def test_mixed_batch_and_seeded_reproducibility(embedded_reference: list[list[int]]) -> None:
    def run() -> tuple[list[list[int]], list[list[int]]]:
        llm = LLM(dtype="float32", speculative_method="draft")
        greedy = [SamplingParams(temperature=0.0, max_tokens=40 + 7 * i) for i in range(4)]
        sampled = [
            SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=30) for i in range(4)
        ]
        short = [SamplingParams(temperature=0.0, max_tokens=1)]  # no room to speculate
        outs = llm.generate(PROMPTS + PROMPTS + PROMPTS[:1], greedy + sampled + short)
        _assert_all_freed(llm)
        ids = [o.outputs[0].token_ids for o in outs]
        assert ids[-1] == embedded_reference[0][:1]
        return ids[:4], ids[4:8]

    g1, s1 = run()
    _g2, s2 = run()
    assert g1 == embedded_reference
    assert s1 == s2  # seeded requests: same tokens for a fixed configuration
    assert len({tuple(s) for s in s1}) > 1


def test_max_tokens_and_max_model_len_respected() -> None:
    llm = LLM(
        dtype="float32", speculative_method="draft", num_speculative_tokens=6, max_model_len=64
    )
    prompt = llm.get_tokenizer().encode(STORY)
    out = llm.generate(
        [prompt, prompt],
        [
            SamplingParams(temperature=0.0, max_tokens=9),
            SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True),
        ],
    )
    assert len(out[0].outputs[0].token_ids) <= 9
    assert len(prompt) + len(out[1].outputs[0].token_ids) == 64
    assert out[1].outputs[0].finish_reason == "length"
    _assert_all_freed(llm)


def test_sampled_distribution_through_the_engine(tmp_path: Path) -> None:
    """The second generated token (decided by verification of a draft) follows the target's
    distribution: compare its histogram over many requests with the exact marginal
    ``sum_t1 p(t1 | prompt) p(t2 | prompt, t1)`` computed without speculation."""
    vocab = 20  # logprobs returns at most 20 entries: the whole vocabulary
    target = make_hf_model(tmp_path / "t", "llama", seed=3, vocab_size=vocab)
    draft = make_hf_model(tmp_path / "d", "llama", seed=4, vocab_size=vocab, num_hidden_layers=1)
    prompt = [1, 7, 3, 11]
    temp = 0.7
    marginal = second_token_marginal(LLM(model=str(target), skip_tokenizer_init=True), prompt, temp)
    n = 3000
    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        speculative_model=str(draft),
        num_speculative_tokens=1,
        seed=11,
    )
    params = SamplingParams(temperature=temp, max_tokens=3, ignore_eos=True)
    outs = llm.generate([prompt] * n, params)
    assert chi2_pvalue(token_histogram(outs, 1, vocab), marginal) > P_THRESHOLD
    m = llm.metrics()
    rate = m["spec_accepted_tokens"] / m["spec_draft_tokens"]
    assert 0.05 < rate < 0.95, rate  # both acceptance and rejection were exercised
    _assert_all_freed(llm)


def second_token_marginal(llm: LLM, prompt: list[int], temp: float) -> torch.Tensor:
    """The exact distribution of the second token sampled at ``temp`` after ``prompt``:
    ``sum_t1 p(t1 | prompt) p(t2 | prompt, t1)`` (a vocabulary of at most 20 tokens)."""
    vocab = llm.engine.model.config.vocab_size
    [p1] = next_token_probs(llm, [prompt], temp)
    marginal = torch.zeros(vocab)
    for t1 in range(vocab):
        if p1[t1] > 0:
            marginal += p1[t1] * next_token_probs(llm, [[*prompt, t1]], temp)[0]
    return marginal


def next_token_probs(llm: LLM, prompts: list[list[int]], temp: float) -> list[torch.Tensor]:
    """The model's next-token distribution at ``temp`` after each prompt (one batch; a
    vocabulary of at most 20 tokens, as many as ``logprobs`` returns)."""
    vocab = llm.engine.model.config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab)
    probs = []
    for out in llm.generate(prompts, params):
        lp = out.outputs[0].logprobs
        assert lp is not None
        logits = torch.full((vocab,), float("-inf"))
        for t, v in lp[0].items():
            logits[t] = v
        probs.append((logits / temp).softmax(dim=-1))
    return probs


def token_histogram(outs: list[RequestOutput], index: int, vocab: int) -> torch.Tensor:
    """How many of the requests' outputs have each token at position ``index``."""
    ids = torch.tensor([o.outputs[0].token_ids[index] for o in outs])
    return torch.bincount(ids, minlength=vocab)


def test_ngram_lookup() -> None:
    prop = NgramProposer(3, ngram_min=1, ngram_max=3)
    assert prop.lookup([1, 2, 3, 4, 1, 2, 3], 3) == [4, 1, 2]
    assert prop.lookup([1, 2, 3, 9, 2, 3, 5, 2, 3], 2) == [5, 2]  # latest earlier match
    assert prop.lookup([5, 6, 7], 3) == []
    assert prop.lookup([7], 3) == []
    assert prop.lookup([4, 4, 4], 5) == [4]  # a match at the end yields what exists


def test_no_drafts_above_speculative_max_batch_size(
    embedded_reference: list[list[int]],
) -> None:
    """Steps with more running requests than the limit verify no drafts; the draft model
    catches up on the tokens it skipped once the batch shrinks (the outputs are the same)."""
    llm = LLM(dtype="float32", speculative_method="draft", speculative_max_batch_size=2)
    engine, proposer = llm.engine, llm.engine.proposer
    assert proposer is not None
    batches: list[int] = []
    propose = proposer.propose

    def watched(requests: Any, limits: Any) -> Any:
        batches.append(len(engine.scheduler.running))
        return propose(requests, limits)

    proposer.propose = watched  # type: ignore[method-assign]
    assert _greedy(llm, PROMPTS) == embedded_reference
    assert batches and max(batches) <= 2  # the last requests drafted, the full batch did not
    assert llm.metrics()["spec_draft_tokens"] > 0
    _assert_all_freed(llm)
    with pytest.raises(ValueError, match="speculative_max_batch_size"):
        LLM(speculative_method="draft", speculative_max_batch_size=0)


def test_bad_speculative_config() -> None:
    with pytest.raises(ValueError, match="speculative_method"):
        LLM(speculative_method="medusa")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="ngram_min"):
        LLM(speculative_method="ngram", ngram_min=3, ngram_max=2)
