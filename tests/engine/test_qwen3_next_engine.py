"""Qwen3-Next served by the engine: the engine tests of ``test_recurrent.py`` (greedy ids through
``LLM`` against transformers' ``generate`` on batched prompts of 5 to 600 tokens, chunked
prefill at a small token budget, preemption, ``n`` = 4, prefix caching with state snapshots,
a shared prefix, what is refused) run on random Qwen3-Next models (gated DeltaNet and gated
attention layers, experts with a gated shared expert), and the state a request holds against
its config."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.engine.test_recurrent import (
    LENGTHS,
    STEPS,
    _llm,
    test_beam_search_forks_and_prunes_states,
    test_chunked_prefill,
    test_greedy_ids_equal_generate,
    test_invariants_hold_every_step_under_pressure,
    test_n_samples_fork_the_state,
    test_preemption_recomputes_from_a_zeroed_slot,
    test_prefix_caching_restores_snapshots,
    test_shared_prefix_hits_the_snapshot_before_it,
    test_speculative_decoding_rolls_the_state_back,
    test_torch_paths_without_the_kernels,
    test_what_cannot_run_is_refused,
)
from tests.oracles.ssm_models import prompt, save_random
from tests.oracles.test_qwen3_next import BASE, CASES

# run here with this module's ``family`` fixture
__all__ = [
    "test_beam_search_forks_and_prunes_states",
    "test_chunked_prefill",
    "test_greedy_ids_equal_generate",
    "test_invariants_hold_every_step_under_pressure",
    "test_n_samples_fork_the_state",
    "test_preemption_recomputes_from_a_zeroed_slot",
    "test_prefix_caching_restores_snapshots",
    "test_shared_prefix_hits_the_snapshot_before_it",
    "test_speculative_decoding_rolls_the_state_back",
    "test_torch_paths_without_the_kernels",
    "test_what_cannot_run_is_refused",
]


@pytest.fixture(scope="module", params=list(CASES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A random Qwen3-Next model of the case, its greedy continuations by transformers."""
    import transformers

    config = {**BASE, **CASES[request.param]}
    path = save_random("Qwen3Next", config, tmp_path_factory.mktemp(request.param))
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.eval().generation_config.eos_token_id = None
    prompts = [prompt(n, 40 + n) for n in LENGTHS]
    want = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False)
        want.append(out[0, len(p) :].tolist())
    return "Qwen3Next", path, hf.config, prompts, want


def test_state_bytes_per_request_follow_the_config(family: Any) -> None:
    """The engine charges each request the conv window and the delta-rule state of every
    DeltaNet layer, as the config gives them (float32 weights: a float32 conv state)."""
    _, path, cfg, _, _ = family
    layers = [t for t in cfg.layer_types if t == "linear_attention"]
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv = (cfg.linear_conv_kernel_dim - 1) * (2 * key_dim + value_dim) * 4
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    llm = _llm(path, num_kv_blocks=64)
    assert llm.engine.metrics()["state_bytes_per_request"] == len(layers) * (conv + state)
