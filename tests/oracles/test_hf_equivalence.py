"""Oracle: our Llama-family model against Hugging Face transformers on the same random weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from tests.conftest import make_hf_model

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-gqa": ("llama", {}),
    "llama-mha-tied": ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama-mqa": ("llama", {"num_key_value_heads": 1}),
    "llama3-rope-scaling": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
            "rope_theta": 500000.0,
        },
    ),
    "llama-linear-rope": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # YaRN (Qwen2.5's long-context scaling): interpolated low frequencies, scaled cos/sin
    "qwen2-yarn": (
        "qwen2",
        {
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
    ),
    "llama-head-dim": ("llama", {"head_dim": 32}),
    "mistral": ("mistral", {"sliding_window": None}),
    # a window shorter than most prompts and every continuation: exact windowed attention
    "mistral-window": ("mistral", {"sliding_window": 8}),
    # layer 0 full attention, layer 1 a window (Qwen2's max_window_layers)
    "qwen2-alternating-window": (
        "qwen2",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),
    "qwen2-bias": ("qwen2", {"tie_word_embeddings": True}),
    "qwen3-qk-norm": ("qwen3", {"head_dim": 24}),
}

PROMPTS = [
    [1, 5, 9, 33, 7],
    [1, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113, 114, 115, 116, 3],
    [1, 42],
    list(range(1, 40)),
]


def _hf_model(path: Path) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_and_greedy_match_transformers(tmp_path: Path, case: str) -> None:
    arch, overrides = CASES[case]
    path = make_hf_model(tmp_path / case, arch, **overrides)
    hf = _hf_model(path)
    hf.generation_config.eos_token_id = None  # our run ignores EOS too
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, num_kv_blocks=64)

    # last-position logits, through the engine's logprobs (log-softmax is shift-invariant, so
    # compare log-softmaxed HF logits) and directly through the model
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0, -1].float()
        ours = _last_logits(llm, prompt).cpu()
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)

    # greedy continuations of a batch of prompts of different lengths, token for token
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        with torch.no_grad():
            ref_ids = hf.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0
            )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref_ids, case
    assert llm.metrics()["num_free_blocks"] == llm.metrics()["num_total_blocks"]


def _last_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Run one prompt through the engine's own model, KV cache and backend; last logits."""
    from foudre.engine.request import Request
    from foudre.engine.scheduler import new_request
    from foudre.runner.step import ScheduledRow, SchedulerOutput

    engine = llm.engine
    req = Request("probe", list(prompt), SamplingParams(max_tokens=1))
    assert engine.kv.allocate_slots(req, len(prompt))
    runner = engine.runner
    captured: list[torch.Tensor] = []
    original = runner.model.compute_logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        logits = original(hidden)
        captured.append(logits)
        return logits

    runner.model.compute_logits = spy  # type: ignore[method-assign]
    try:
        row = ScheduledRow("probe", 0, list(prompt), engine.kv.block_ids("probe"), 1)
        row.group_block_ids = engine.kv.group_block_ids("probe")
        runner.execute(SchedulerOutput([row], removed=["probe"], new_requests=[new_request(req)]))
        runner.input_batch.remove(["probe"])
    finally:
        runner.model.compute_logits = original  # type: ignore[method-assign]
        engine.kv.free(req)
    return captured[0][0]
