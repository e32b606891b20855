"""State-space and hybrid models served by the engine (issue #49): greedy ids through ``LLM``
against transformers' ``generate`` (float32, random small configs) for Mamba-2, Bamba, the
Granite 4.0 hybrid and Falcon-H1 (attention and Mamba side by side in every layer), batched
prompts of 5 to 600 tokens; with chunked prefill at a small token budget, with preemption,
with ``n`` = 4 (the samples fork the state), with prefix caching (the same tokens, hits
reported, snapshots restored); the state memory a request holds against what the config
implies; speculative decoding (the state rolled back past rejected drafts); slots and blocks
all back in the pools at the end; what cannot run refused by name."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre import LLM, SamplingParams
from foudre.speculative.proposers import Draft, Proposer, SpecRequest
from tests.oracles.ssm_models import prompt, save_random
from tests.oracles.test_bamba import BASE as BAMBA
from tests.oracles.test_falcon_h1 import BASE as FALCON_H1
from tests.oracles.test_granite_moe_hybrid import BASE as GRANITE
from tests.oracles.test_mamba2 import BASE as MAMBA2

FAMILIES = {"Mamba2": MAMBA2, "Bamba": BAMBA, "GraniteMoeHybrid": GRANITE, "FalconH1": FALCON_H1}
LENGTHS = (5, 17, 33, 600)
STEPS = 6
# 16 blocks of 4 tokens and a 24-token budget for six requests of up to 39 tokens: preemptions
PRESSURE: dict[str, Any] = dict(
    dtype="float32",
    skip_tokenizer_init=True,
    max_model_len=64,
    block_size=4,
    num_kv_blocks=16,
    max_num_batched_tokens=24,
)


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A random model of the family, its greedy continuations by transformers."""
    import transformers

    name = request.param
    config = {**FAMILIES[name], "max_position_embeddings": 1024}
    path = save_random(name, config, tmp_path_factory.mktemp(name))
    hf = getattr(transformers, f"{name}ForCausalLM").from_pretrained(path, dtype=torch.float32)
    hf.eval().generation_config.eos_token_id = None
    prompts = [prompt(n, 40 + n) for n in LENGTHS]
    want = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=STEPS, do_sample=False)
        want.append(out[0, len(p) :].tolist())
    return name, path, hf.config, prompts, want


def _llm(path: Path, **kwargs: Any) -> LLM:
    return LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=640, **kwargs)


def _greedy(llm: LLM, prompts: list[list[int]], n: int = 1) -> list[list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True, n=n)
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]


def _assert_pools_empty(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.states is not None
    assert len(kv.states.free_slots) == kv.states.num_slots and not kv.states.of_request


def test_greedy_ids_equal_generate(family: Any) -> None:
    """All prompts in one batch, the default engine (prefix caching on, no hits)."""
    _, path, _, prompts, want = family
    llm = _llm(path)
    assert _greedy(llm, prompts) == [[w] for w in want]
    _assert_pools_empty(llm)


def test_chunked_prefill(family: Any) -> None:
    """A 24-token budget chunks every prompt over many steps (the state carried across
    chunks, rows of prefill chunks and decodes mixed)."""
    _, path, _, prompts, want = family
    llm = _llm(path, max_num_batched_tokens=24)
    assert _greedy(llm, prompts) == [[w] for w in want]
    _assert_pools_empty(llm)


def test_preemption_recomputes_from_a_zeroed_slot(family: Any) -> None:
    """16 blocks of 4 tokens cannot hold six requests of up to 39 tokens at once: some are
    preempted (their slots freed) and recomputed from zeroed slots."""
    _, path, _, prompts, want = family
    llm = LLM(str(path), **PRESSURE, enable_prefix_caching=False)
    assert _greedy(llm, prompts[:3] * 2) == [[w] for w in want[:3] * 2]
    assert llm.engine.metrics()["num_preemptions"] > 0
    _assert_pools_empty(llm)


def test_n_samples_fork_the_state(family: Any) -> None:
    """``n`` = 4 greedy samples: three are forked from the first after its prompt (their
    states copied, their blocks shared), and all four continue as transformers does."""
    _, path, _, prompts, want = family
    llm = _llm(path)
    got = _greedy(llm, prompts[:3], n=4)
    assert got == [[w] * 4 for w in want[:3]]
    _assert_pools_empty(llm)


def test_prefix_caching_restores_snapshots(family: Any) -> None:
    """Snapshots every 8 tokens: a second pass over the same prompts, and prompts sharing a
    prefix with them, hit the cache (restored states, only the tails recomputed) and give the
    same tokens as transformers."""
    _, path, _, prompts, want = family
    llm = _llm(path, block_size=4, state_snapshot_interval=8, max_num_batched_tokens=64)
    assert _greedy(llm, prompts) == [[w] for w in want]
    metrics = llm.engine.metrics()
    assert metrics["prefix_cache_hits"] == 0
    assert metrics["num_state_snapshots"] > 0
    assert metrics["state_snapshot_bytes"] == (
        metrics["num_state_snapshots"] * metrics["state_bytes_per_request"]
    )
    assert _greedy(llm, prompts) == [[w] for w in want]
    hits = llm.engine.metrics()["prefix_cache_hits"]
    # every prompt hits up to its last snapshot before its last token
    assert hits == sum((n - 1) // 8 * 8 for n in LENGTHS)
    _assert_pools_empty(llm)


def test_shared_prefix_hits_the_snapshot_before_it(family: Any, tmp_path: Path) -> None:
    """A long shared prefix then different tails: the second request restores the state at
    the last snapshot inside the shared part and recomputes from there; its tokens are
    transformers'."""
    import transformers

    name, path, _, prompts, _ = family
    hf = getattr(transformers, f"{name}ForCausalLM").from_pretrained(path, dtype=torch.float32)
    hf.eval().generation_config.eos_token_id = None
    shared = prompts[3][:203]
    tails = [prompt(9, 1), prompt(30, 2)]
    llm = _llm(path, block_size=4, state_snapshot_interval=8)
    for i, tail in enumerate(tails):
        ids = shared + tail
        want = hf.generate(torch.tensor([ids]), max_new_tokens=STEPS, do_sample=False)
        assert _greedy(llm, [ids]) == [[want[0, len(ids) :].tolist()]]
        if i:
            assert llm.engine.metrics()["prefix_cache_hits"] == 200
    _assert_pools_empty(llm)


def test_state_bytes_per_request_follow_the_config(family: Any) -> None:
    """The engine charges each request its conv and SSM states of every Mamba layer, as the
    config gives them: float32 weights, so a float32 conv state."""
    _, path, cfg, _, _ = family
    if hasattr(cfg, "mamba_n_heads"):  # the hybrids' names (Mamba layers: linear_attention;
        # Falcon-H1's layers are all "hybrid": attention and Mamba side by side)
        heads, head_dim = cfg.mamba_n_heads, cfg.mamba_d_head
        groups, d_state, d_conv = cfg.mamba_n_groups, cfg.mamba_d_state, cfg.mamba_d_conv
        layers = [t for t in cfg.layer_types if t in ("linear_attention", "hybrid")]
    else:
        heads, head_dim = cfg.num_heads, cfg.head_dim
        groups, d_state, d_conv = cfg.n_groups, cfg.state_size, cfg.conv_kernel
        layers = ["mamba"] * cfg.num_hidden_layers
    conv = (d_conv - 1) * (heads * head_dim + 2 * groups * d_state) * 4
    ssm = heads * head_dim * d_state * 4
    llm = _llm(path, num_kv_blocks=64)
    assert llm.engine.metrics()["state_bytes_per_request"] == len(layers) * (conv + ssm)


def test_what_cannot_run_is_refused(family: Any) -> None:
    _, path, _, _, _ = family
    with pytest.raises(ValueError, match="kv_cache_memory"):
        _llm(path, kv_cache_memory=4096)
    with pytest.raises(ValueError, match=r"speculative_model: .* recurrent"):
        _llm(path, speculative_method="draft", speculative_model=str(path))


class _KnownDrafts(Proposer):
    """Drafts from the known greedy continuations (by prompt), one draft in ``k + 1`` wrong in
    turn: every verification accepts all of its drafts, some, or none."""

    name = "known"

    def __init__(self, k: int, prompts: list[list[int]], want: list[list[int]]) -> None:
        super().__init__(k)
        self.want = {tuple(p): w for p, w in zip(prompts, want, strict=True)}
        self.turn = 0

    def propose(self, requests: Sequence[SpecRequest], max_drafts: Sequence[int]) -> list[Draft]:
        drafts = []
        for req, n in zip(requests, max_drafts, strict=True):
            done = len(req.output_token_ids)
            ids = list(self.want[tuple(req.prompt_token_ids)][done : done + n])
            self.turn += 1
            wrong = self.turn % (self.num_speculative_tokens + 1)
            if wrong < len(ids):
                ids[wrong] = (ids[wrong] + 1) % 256
            drafts.append(Draft(ids))
        return drafts


def test_speculative_decoding_rolls_the_state_back(family: Any) -> None:
    """Verified drafts on a recurrent model (greedy): rows that reject some drafts take back
    the state after their first token and recompute the accepted ones, so the ids are
    transformers' greedy ones; with prefix caching and a small token budget too."""
    _, path, _, prompts, want = family
    for extra in ({}, {"enable_prefix_caching": True, "max_num_batched_tokens": 48}):
        llm = _llm(path, speculative_method="ngram", num_speculative_tokens=3, **extra)
        llm.engine.proposer = _KnownDrafts(3, prompts, want)
        assert _greedy(llm, prompts) == [[w] for w in want]
        m = llm.metrics()
        assert m["spec_draft_tokens"] > m["spec_accepted_tokens"] > 0
        _assert_pools_empty(llm)


def test_beam_search_forks_and_prunes_states(family: Any) -> None:
    """Beam search (width 3): each surviving extra beam forks its parent's state, pruned beams
    free theirs; the beams are transformers' ``generate(num_beams=3)``'s."""
    import transformers

    from foudre.sampling_params import BeamSearchParams

    name, path, _, prompts, _ = family
    hf = getattr(transformers, f"{name}ForCausalLM").from_pretrained(path, dtype=torch.float32)
    hf.eval().generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    llm = _llm(path)
    ours = llm.beam_search(prompts[:3], BeamSearchParams(beam_width=3, max_tokens=STEPS))
    for p, out in zip(prompts[:3], ours, strict=True):
        ref = hf.generate(
            torch.tensor([p]),
            num_beams=3,
            num_return_sequences=3,
            do_sample=False,
            max_new_tokens=STEPS,
        )
        assert [s.token_ids for s in out.sequences] == [r[len(p) :] for r in ref.tolist()]
    _assert_pools_empty(llm)


def test_torch_paths_without_the_kernels(family: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the C++ / Triton kernels do not run, the mixers take their torch forms (the chunked
    scan, the gathered one-step update): the same tokens, snapshots included."""
    from foudre.layers import gated_deltanet, mamba, ssm_ops

    monkeypatch.setattr(ssm_ops, "library", lambda: None)
    monkeypatch.setattr(mamba, "has_kernels", lambda state: False)
    monkeypatch.setattr(gated_deltanet, "has_kernels", lambda state: False)
    _, path, _, prompts, want = family
    llm = _llm(path, block_size=4, state_snapshot_interval=8, max_num_batched_tokens=40)
    assert _greedy(llm, prompts) == [[w] for w in want]
    assert _greedy(llm, prompts) == [[w] for w in want]
    assert llm.engine.metrics()["prefix_cache_hits"] > 0
    _assert_pools_empty(llm)


def _two_slots(path: Path) -> LLM:
    """An engine whose KV budget holds 3.25 requests' states (twice that beside attention
    layers, whose blocks take the other half): 2 slots and the padding rows' one."""
    probe = _llm(path, num_kv_blocks=64).engine
    per_slot = probe.metrics()["state_bytes_per_request"]
    budget = per_slot * 3.25 * (2 if probe.kv_bytes_per_block else 1)
    llm = LLM(
        str(path),
        dtype="float32",
        skip_tokenizer_init=True,
        max_model_len=64,
        kv_cache_memory=float(int(budget)),
        enable_prefix_caching=False,
    )
    assert llm.engine.metrics()["num_state_slots"] == 2
    return llm


def test_admission_waits_for_a_state_slot(family: Any) -> None:
    """With 2 state slots, three requests run two at a time, the third admitted when a slot
    frees."""
    _, path, _, prompts, want = family
    llm = _two_slots(path)
    assert _greedy(llm, prompts[:3]) == [[w] for w in want[:3]]
    assert llm.engine.stats.peak_running == 2
    _assert_pools_empty(llm)


def test_beams_within_the_state_slots(family: Any) -> None:
    """With 2 state slots, max_num_seqs is 2: a beam search of width 3 is refused by name (it
    would wait forever for a third slot), one of width 2 runs."""
    from foudre.errors import InvalidParameterError
    from foudre.sampling_params import BeamSearchParams

    _, path, _, prompts, _ = family
    llm = _two_slots(path)
    assert llm.engine.config.max_num_seqs == 2
    with pytest.raises(InvalidParameterError, match="beam_width"):
        llm.beam_search(prompts[:1], BeamSearchParams(beam_width=3, max_tokens=STEPS))
    out = llm.beam_search(prompts[:2], BeamSearchParams(beam_width=2, max_tokens=STEPS))
    assert all(len(o.sequences) == 2 for o in out)
    _assert_pools_empty(llm)


def test_invariants_hold_every_step_under_pressure(family: Any) -> None:
    """Two snapshot slots for many due snapshots (the least recently used one of a block no
    request holds is reused), 16 blocks for six requests (preemptions), a 24-token budget and
    samples forked from one prompt: after every step the slots, snapshots and blocks account
    for their pools, and the tokens are transformers'."""
    _, path, _, prompts, want = family
    llm = LLM(str(path), **PRESSURE, state_snapshot_interval=8, num_state_snapshots=2)
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)
    got: dict[str, list[int]] = {}
    for rnd in range(2):
        for i, p in enumerate(prompts[:3]):
            engine.add_request(p, params, request_id=f"{rnd}-{i}")
        engine.add_group(f"{rnd}-n", [prompts[1]], SamplingParams(**{**vars_of(params), "n": 2}))
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[out.request_id] = [c.token_ids for c in out.outputs]
            engine.scheduler.check_invariants()
    assert engine.metrics()["num_preemptions"] > 0
    assert engine.metrics()["prefix_cache_hits"] > 0
    for rnd in range(2):
        assert [got[f"{rnd}-{i}"] for i in range(3)] == [[w] for w in want[:3]]
        assert [got[f"{rnd}-n-{i}"] for i in range(2)] == [[want[1]]] * 2
    _assert_pools_empty(llm)


def vars_of(params: SamplingParams) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
