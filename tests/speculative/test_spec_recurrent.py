"""Speculative decoding on a recurrent model samples from the target's distribution: a draft
model's tokens verified by a Mamba-2 target (its state rolled back past rejected drafts:
``ModelRunner._verified_states``, ``Scheduler.update``), the second generated token's histogram
over many requests against the exact marginal computed without speculation (χ²)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from foudre import LLM, SamplingParams
from tests.conftest import make_hf_model
from tests.oracles.ssm_models import save_random
from tests.oracles.test_mamba2 import BASE as MAMBA2
from tests.speculative.test_rejection import P_THRESHOLD, chi2_pvalue
from tests.speculative.test_spec_engine import (
    next_token_probs,
    second_token_marginal,
    token_histogram,
)


@pytest.mark.slow
def test_sampled_distribution_on_a_recurrent_target(tmp_path: Path) -> None:
    """Two drafts a step: the second token is decided by a verification that accepts or
    rejects the first draft, and follows ``sum_t1 p(t1) p(t2 | t1)``; the fourth comes after
    rows that rejected drafts took back their state, and follows the target's conditional
    distributions given each request's first three tokens."""
    vocab = 20  # logprobs returns at most 20 entries: the whole vocabulary
    config = {**MAMBA2, "vocab_size": vocab, "pad_token_id": 0, "max_position_embeddings": 64}
    target = save_random("Mamba2", config, tmp_path / "t", seed=3)
    draft = make_hf_model(tmp_path / "d", "llama", seed=4, vocab_size=vocab, num_hidden_layers=1)
    prompt = [1, 7, 3, 11]
    temp = 0.7
    plain = LLM(model=str(target), skip_tokenizer_init=True, dtype="float32")
    marginal = second_token_marginal(plain, prompt, temp)
    n = 8000  # (enough to see a state left past the rejected drafts: p ~ 1e-5 with n = 8000)
    llm = LLM(
        model=str(target),
        skip_tokenizer_init=True,
        dtype="float32",
        speculative_model=str(draft),
        num_speculative_tokens=2,
        seed=11,
    )
    params = SamplingParams(temperature=temp, max_tokens=4, ignore_eos=True)
    outs = llm.generate([prompt] * n, params)
    assert chi2_pvalue(token_histogram(outs, 1, vocab), marginal) > P_THRESHOLD
    # the fourth token comes from the step after the verification that decided the second and
    # third: from the state restored where it rejected a draft. Its expected histogram: each
    # request's exact p(t4 | prompt, t1, t2, t3), summed
    prefixes = [tuple(o.outputs[0].token_ids[:3]) for o in outs]
    distinct = sorted(set(prefixes))
    exact = next_token_probs(plain, [[*prompt, *pre] for pre in distinct], temp)
    of = dict(zip(distinct, exact, strict=True))
    expected = torch.stack([of[pre] for pre in prefixes]).sum(0) / n
    assert chi2_pvalue(token_histogram(outs, 3, vocab), expected) > P_THRESHOLD
    m = llm.metrics()
    rate = m["spec_accepted_tokens"] / m["spec_draft_tokens"]
    assert 0.05 < rate < 0.95, rate  # both acceptance and rejection were exercised
    assert m["num_free_blocks"] == m["num_total_blocks"] and m["num_used_state_slots"] == 0
