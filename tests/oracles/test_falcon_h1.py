"""Oracle: Falcon-H1 (``FalconH1ForCausalLM``, attention and a Mamba-2 mixer side by side in
every layer) against transformers on random small configs, float32.

The model is driven as the Bamba oracle drives Bamba (``hybrid_driver.HybridDriver``: a state
slot and scattered KV blocks per request; here two cache entries per decoder layer). Compared
with transformers: whole prompts of 5 to 600 tokens, prompts prefilled in chunks then decoded
token by token, batches mixing prefills and decodes of other lengths, greedy ids against
``generate``; the state a request holds against the config; bad config keys refused by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre.attention.cache_spec import FullAttentionSpec, RecurrentStateSpec
from foudre.loading.errors import ModelLoadError
from foudre.loading.hf import load_hf_config
from foudre.loading.loader import load_model
from foudre.models.falcon_h1 import FalconH1ForCausalLM
from tests.oracles.hybrid_driver import (
    BLOCK,
    HybridDriver,
    check_chunked_prefill,
    check_greedy_forked,
    check_mixed_batch,
)
from tests.oracles.ssm_models import hf_logits as _hf_logits
from tests.oracles.ssm_models import prompt as _prompt
from tests.oracles.ssm_models import save_random

BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    mamba_d_ssm=64,  # not mamba_expand * hidden_size (128): d_ssm wins
    mamba_n_heads=8,
    mamba_d_head=8,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_d_conv=4,
    mamba_chunk_size=8,
    mamba_rms_norm=True,
    mamba_norm_before_gate=True,
    projectors_bias=True,
    mamba_proj_bias=True,
    max_position_embeddings=1024,
    rms_norm_eps=1e-5,
    embedding_multiplier=1.3,
    lm_head_multiplier=0.7,
    mlp_multipliers=[0.8, 1.2],
    key_multiplier=1.5,
    attention_in_multiplier=0.9,
    attention_out_multiplier=1.1,
    ssm_multipliers=[0.5, 1.5, 0.7, 1.3, 0.9],
    ssm_in_multiplier=1.2,
    ssm_out_multiplier=0.8,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
DROP = object()  # a key left out of the config
CASES: dict[str, dict[str, Any]] = {
    # the norm before the gate, every multiplier set, biases in the mixer's projections
    "norm-before-gate": {},
    # no norm (y * silu(z)), one group, a tied head, no conv bias, d_ssm from mamba_expand,
    # the multipliers' defaults
    "no-norm-tied": {
        "mamba_rms_norm": False,
        "mamba_d_ssm": None,
        "mamba_expand": 1,
        "mamba_n_groups": 1,
        "tie_word_embeddings": True,
        "mamba_conv_bias": False,
        "projectors_bias": False,
        "mamba_proj_bias": False,
        "embedding_multiplier": 1.0,
        "lm_head_multiplier": 1.0,
        "mlp_multipliers": DROP,
        "ssm_multipliers": DROP,
        "key_multiplier": 1.0,
        "num_hidden_layers": 3,
    },
    # the norm after the gate (Mamba-2's), head_dim from hidden_size / heads, a bias in the
    # mixer's in_proj (mamba_proj_bias) but not its out_proj (projectors_bias)
    "norm-after-gate": {
        "mamba_norm_before_gate": False,
        "head_dim": DROP,
        "projectors_bias": False,
    },
}


def make_falcon_h1(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight ``FalconH1ForCausalLM`` in ``path`` (weights drawn as the other
    state-space oracles draw them)."""
    config = {k: v for k, v in {**BASE, **overrides}.items() if v is not DROP}
    return save_random("FalconH1", config, path, seed)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import transformers

    path = make_falcon_h1(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    hf = transformers.FalconH1ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ours = load_model(str(path), None, "float32", torch.device("cpu"), None).model
    assert isinstance(ours, FalconH1ForCausalLM)
    return path, hf, ours


@pytest.mark.parametrize("n", [5, 37, 600])
def test_whole_prompt_logits(pair: Any, n: int) -> None:
    """A whole prompt in one step: every position's logits are transformers'."""
    _, hf, ours = pair
    ids = _prompt(n, n)
    (got,) = HybridDriver(ours, 1, n).step([(0, ids)])
    torch.testing.assert_close(got, _hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_chunked_prefill_then_decode(pair: Any) -> None:
    """A prompt in odd chunks then one token at a time: transformers' logits of the whole."""
    check_chunked_prefill(pair[1], pair[2], (5, 11, 1, 9, 3, *[1] * 12))


def test_mixed_batch_of_rows(pair: Any) -> None:
    """Rows mid-prefill, starting and decoding in the same forwards give transformers' logits
    of each whole sequence."""
    check_mixed_batch(pair[1], pair[2])


def test_greedy_ids_equal_generate(pair: Any) -> None:
    """Prompts of different lengths decoded together, one of them forked (n = 2)."""
    check_greedy_forked(pair[1], pair[2])


def test_cache_entries_and_state_bytes(pair: Any) -> None:
    """Two entries per layer, attention then state; a request's state is what the config
    implies (conv window and SSM state per layer), its KV per token the attention's."""
    _, hf, ours = pair
    cfg = hf.config
    specs = ours.kv_cache_specs()
    assert len(specs) == 2 * cfg.num_hidden_layers
    assert all(isinstance(s, FullAttentionSpec) for s in specs[0::2])
    assert all(isinstance(s, RecurrentStateSpec) for s in specs[1::2])
    inner = cfg.mamba_d_ssm or cfg.mamba_expand * cfg.hidden_size
    assert cfg.mamba_n_heads * cfg.mamba_d_head == inner
    conv = (cfg.mamba_d_conv - 1) * (inner + 2 * cfg.mamba_n_groups * cfg.mamba_d_state) * 4
    ssm = inner * cfg.mamba_d_state * 4
    assert all(s.bytes_per_request(torch.float32) == conv + ssm for s in specs[1::2])
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_key_value_heads * head_dim * 4
    assert all(s.bytes_per_token(torch.float32) == kv for s in specs[0::2])


def _config_dir(tmp_path: Path, **changes: Any) -> Path:
    raw = {"architectures": ["FalconH1ForCausalLM"], "model_type": "falcon_h1", **BASE}
    raw.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    return tmp_path


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("attention_bias", True),
        ("mlp_bias", True),
        ("hidden_act", "gelu"),
        ("ssm_multipliers", [1.0, 1.0, 1.0, 1.0]),
        ("mlp_multipliers", "big"),
        ("key_multiplier", "x"),
        ("mamba_rms_norm", "yes"),
        ("mamba_d_ssm", 96),  # 8 heads of 8 make 64
        ("mamba_n_heads", 0),
        ("time_step_limit", [0.0]),
    ],
)
def test_bad_config_key_is_named(tmp_path: Path, key: str, value: Any) -> None:
    with pytest.raises(ModelLoadError, match=key):
        load_hf_config(_config_dir(tmp_path, **{key: value}))


def test_config_defaults(tmp_path: Path) -> None:
    """transformers' defaults where config.json leaves keys out: d_ssm 1024 (so 128 heads of 8),
    8 KV heads, no norm in the mixer, every multiplier 1."""
    drop = {"mamba_d_ssm", "mamba_d_head", "mamba_n_heads", "num_key_value_heads"}
    drop |= {k for k in BASE if "multiplier" in k or k.startswith("mamba_rms")}
    raw = {"model_type": "falcon_h1", **{k: v for k, v in BASE.items() if k not in drop}}
    raw["num_attention_heads"] = 8
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_hf_config(tmp_path)
    assert (cfg.mamba_num_heads, cfg.mamba_head_dim) == (128, 8)
    assert cfg.num_key_value_heads == 8
    assert cfg.mamba_gate_norm == "none"
    assert cfg.ssm_multipliers == (1.0,) * 5 and cfg.mlp_multipliers == (1.0, 1.0)
    assert cfg.embedding_multiplier == cfg.lm_head_multiplier == cfg.key_multiplier == 1.0
    assert cfg.mamba_layers == tuple(range(cfg.num_hidden_layers))


def _restore(driver: HybridDriver, req: int, snapshot: int, source: int, tokens: int) -> None:
    """Request ``req`` resumes after the first ``tokens`` of request ``source``, as a prefix
    hit does: its state from the snapshot in slot ``snapshot``, its KV blocks copied."""
    for cache in driver.states.caches:
        cache.conv[driver.slots[req]] = cache.conv[snapshot]
        cache.ssm[driver.slots[req]] = cache.ssm[snapshot]
    blocks = -(-tokens // BLOCK)
    for spec, cache in zip(driver.specs, driver.caches, strict=True):
        if isinstance(spec, FullAttentionSpec):
            src, dst = driver.tables[source][:blocks], driver.tables[req][:blocks]
            cache[:, dst] = cache[:, src]
    driver.computed[req] = tokens


def test_snapshots_resume_a_prefix(pair: Any) -> None:
    """The states a step leaves at chosen offsets (a prefix cache's block ends: within a
    prefill chunk past the scan's first chunk, and a decode row) continue another request
    from there with transformers' logits of the whole sequence."""
    _, hf, ours = pair
    ids = _prompt(100, 7)
    want = _hf_logits(hf, ids)
    driver = HybridDriver(ours, 3, 104)
    spare = driver.slots[2]
    driver.step([(0, ids[:90])], snapshots=[(0, 79, spare)])
    _restore(driver, 1, spare, 0, 80)
    got = driver.step([(1, ids[80:87])]) + [driver.step([(1, [t])])[0] for t in ids[87:92]]
    torch.testing.assert_close(torch.cat(got), want[80:92], atol=1e-4, rtol=0)
    (last,) = driver.step([(0, ids[90:91])], snapshots=[(0, 0, spare)])
    torch.testing.assert_close(last, want[90:91], atol=1e-4, rtol=0)
    _restore(driver, 1, spare, 0, 91)
    (rest,) = driver.step([(1, ids[91:])])
    torch.testing.assert_close(rest, want[91:], atol=1e-4, rtol=0)


def test_llm_samples_with_a_seed(pair: Any) -> None:
    """Through ``LLM``: ``n`` = 2 seeded samples (the second forks the first's state) are
    valid ids, the same in a batch with other prompts as alone and on a second run, and every
    slot and block is back in its pool at the end."""
    from foudre import LLM, SamplingParams

    path, _, _ = pair
    llm = LLM(str(path), dtype="float32", skip_tokenizer_init=True, max_model_len=128)
    params = SamplingParams(temperature=0.9, max_tokens=8, ignore_eos=True, n=2, seed=1234)
    prompts = [_prompt(n, 60 + n) for n in (21, 5, 48)]

    def samples(batch: list[list[int]]) -> list[list[int]]:
        return [list(c.token_ids) for c in llm.generate(batch, params)[0].outputs]

    alone = samples(prompts[:1])
    assert len(alone) == 2 and all(len(s) == 8 and all(0 <= t < 256 for t in s) for s in alone)
    assert samples(prompts) == alone
    assert samples(prompts[:1]) == alone
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.states is not None and len(kv.states.free_slots) == kv.states.num_slots
