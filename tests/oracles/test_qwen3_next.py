"""Oracle: Qwen3-Next (``Qwen3NextForCausalLM``: gated DeltaNet layers, gated attention, experts
with a gated shared expert, zero-centred norms) against transformers (its torch path of the
delta rule) on random small configs, float32, through the stand-in driver of
``hybrid_driver.py`` (a state slot and paged KV blocks per request); and the chunked delta rule
against its token-by-token recurrence."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from foudre.attention.cache_spec import RecurrentStateSpec
from foudre.layers import gated_deltanet
from foudre.layers.gated_deltanet import (
    GatedDeltaNet,
    GatedDeltaNetShape,
    delta_step,
    gated_delta_chunked,
)
from foudre.layers.mamba import RecurrentBatch, RecurrentStates
from foudre.loading.loader import load_model
from foudre.models.qwen3_next import Qwen3NextForCausalLM
from tests.oracles.hybrid_driver import (
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
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    linear_conv_kernel_dim=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=24,
    norm_topk_prob=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CASES: dict[str, dict[str, Any]] = {
    "moe": {},
    # one key head per value head, attention first, a dense MLP layer, unnormalised top-k, tied
    "dense-layer-tied": {
        "layer_types": ["full_attention", "linear_attention", "linear_attention"],
        "num_hidden_layers": 3,
        "linear_num_value_heads": 2,
        "mlp_only_layers": [1],
        "norm_topk_prob": False,
        "tie_word_embeddings": True,
        "rope_parameters": {"rope_type": "default", "rope_theta": 500.0},  # 0.25 by default
    },
}


def make_qwen3_next(path: Path, seed: int = 0, **overrides: Any) -> Path:
    return save_random("Qwen3Next", {**BASE, **overrides}, path, seed)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import transformers

    path = make_qwen3_next(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    hf = transformers.Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ours = load_model(str(path), None, "float32", torch.device("cpu"), None).model
    assert isinstance(ours, Qwen3NextForCausalLM)
    return path, hf, ours


def _driver(model: Qwen3NextForCausalLM, requests: int, max_len: int) -> HybridDriver:
    return HybridDriver(model, requests, max_len)  # type: ignore[arg-type]


def _random_rule(
    r: int, length: int, heads: int, dk: int, dv: int, seed: int
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(r, length, heads, dk, generator=g), dim=-1)
    k = torch.nn.functional.normalize(torch.randn(r, length, heads, dk, generator=g), dim=-1)
    v = torch.randn(r, length, heads, dv, generator=g)
    decay = -torch.rand(r, length, heads, generator=g) * 0.6
    beta = torch.rand(r, length, heads, generator=g)
    state = torch.randn(r, heads, dk, dv, generator=g)
    return q * dk**-0.5, k, v, decay, beta, state


def test_chunked_rule_equals_recurrence() -> None:
    """The chunked delta rule from a state (over padded rows, several chunks) equals the
    token-by-token recurrence: every output, the final state, and the states after chosen
    tokens (mid-chunk, a chunk's last, the last)."""
    r, length, padded, heads, dk, dv = 2, 150, 192, 3, 8, 6
    q, k, v, decay, beta, state = _random_rule(r, length, heads, dk, dv, 0)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x.new_zeros(r, padded - length, *x.shape[2:])], 1)

    at = (torch.tensor([0, 1, 1, 0]), torch.tensor([5, 63, 149, 130]))
    o, final, states_at = gated_delta_chunked(
        pad(q), pad(k), pad(v), pad(decay), pad(beta), state.clone(), 64, at
    )
    pool, rows, outs, states = state.clone(), torch.arange(r), [], []
    for t in range(length):
        outs.append(delta_step(q[:, t], k[:, t], v[:, t], decay[:, t], beta[:, t], pool, rows))
        states.append(pool.clone())
    torch.testing.assert_close(o[:, :length], torch.stack(outs, 1), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, pool, atol=1e-5, rtol=1e-5)
    assert states_at is not None
    for i, (row, pos) in enumerate(zip(*at, strict=True)):
        torch.testing.assert_close(states_at[i], states[int(pos)][int(row)], atol=1e-5, rtol=1e-5)


def test_chunks_in_slices(monkeypatch: pytest.MonkeyPatch) -> None:
    """The chunks' terms taken a few chunks at a time (bounded memory) give the same result."""
    q, k, v, decay, beta, state = _random_rule(2, 32, 2, 4, 3, 1)
    want = gated_delta_chunked(q, k, v, decay, beta, state, 8)[:2]
    monkeypatch.setattr(gated_deltanet, "DELTA_ELEMENTS", 2 * 2 * 8 * 8 * 2)
    got = gated_delta_chunked(q, k, v, decay, beta, state, 8)[:2]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_mixer_snapshots_equal_token_by_token_states() -> None:
    """A mixer step of a long row (several chunks) and a one-token row, with snapshots at
    offsets: each snapshot slot holds the state (conv window and delta-rule state) that
    feeding the row one token at a time reaches after that token; the rows' outputs are the
    token-by-token outputs."""
    torch.manual_seed(0)
    shape = GatedDeltaNetShape(32, 2, 4, 8, 6, 4)
    mixer = GatedDeltaNet(shape)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(131, 32)
    states = RecurrentStates([shape.state_spec()], 10)
    cache = states.caches[0]
    cache.ssm.normal_()
    cache.conv.normal_()
    ref = RecurrentStates([shape.state_spec()], 2)
    ref.caches[0].ssm[0], ref.caches[0].conv[0] = cache.ssm[0], cache.conv[0]
    ref.caches[0].ssm[1], ref.caches[0].conv[1] = cache.ssm[1], cache.conv[1]
    offsets = [0, 2, 63, 64, 100, 129]
    snaps = [(0, off, 2 + i) for i, off in enumerate(offsets)] + [(1, 0, 9)]
    batch = RecurrentBatch.of_lengths([130, 1], [0, 1], torch.device("cpu"), snaps)
    with torch.no_grad():
        out = mixer(x, cache, batch)
        want = []
        for t in range(130):
            one = RecurrentBatch.of_lengths([1], [0], torch.device("cpu"))
            want.append(mixer(x[t : t + 1], ref.caches[0], one))
            if t in offsets:
                slot = 2 + offsets.index(t)
                torch.testing.assert_close(cache.ssm[slot], ref.caches[0].ssm[0], atol=1e-5, rtol=0)
                torch.testing.assert_close(cache.conv[slot], ref.caches[0].conv[0])
        last = mixer(
            x[130:], ref.caches[0], RecurrentBatch.of_lengths([1], [1], torch.device("cpu"))
        )
    torch.testing.assert_close(out[:130], torch.cat(want), atol=1e-5, rtol=0)
    torch.testing.assert_close(out[130:], last, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.ssm[0], ref.caches[0].ssm[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.ssm[9], ref.caches[0].ssm[1], atol=1e-6, rtol=0)
    torch.testing.assert_close(cache.conv[9], ref.caches[0].conv[1])


@pytest.mark.parametrize("n", [5, 64, 200, 600])
def test_whole_sequence_logits(pair: Any, n: int) -> None:
    _, hf, ours = pair
    ids = _prompt(n, n)
    (got,) = _driver(ours, 1, n).step([(0, ids)])
    torch.testing.assert_close(got, _hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_chunked_prefill_then_decode(pair: Any) -> None:
    """A prompt in odd chunks (one longer than a delta-rule chunk) then one token at a time:
    every position's logits are transformers' over the whole sequence."""
    check_chunked_prefill(pair[1], pair[2], (5, 70, 1, 9, 3, *[1] * 22))


def test_mixed_batch_of_rows(pair: Any) -> None:
    """Rows mid-prefill, starting and decoding in the same forwards give transformers' logits
    of each whole sequence."""
    check_mixed_batch(pair[1], pair[2], long=80)


def test_greedy_ids_equal_generate(pair: Any) -> None:
    """Prompts of different lengths decoded together, one of them forked (n = 2)."""
    check_greedy_forked(pair[1], pair[2])


def test_layers_and_state_bytes(pair: Any) -> None:
    """A state slot per linear-attention layer of the config's size; KV for the others."""
    _, hf, ours = pair
    cfg = hf.config
    specs = ours.kv_cache_specs()
    linear = [i for i, t in enumerate(cfg.layer_types) if t == "linear_attention"]
    assert [i for i, s in enumerate(specs) if isinstance(s, RecurrentStateSpec)] == linear
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv = (cfg.linear_conv_kernel_dim - 1) * (2 * key_dim + value_dim) * 4
    state = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    for i in linear:
        assert specs[i].bytes_per_request(torch.float32) == conv + state  # type: ignore[union-attr]


def test_checkpoint_tensors_skipped_or_named(tmp_path: Path) -> None:
    """Multi-token-prediction tensors are skipped; a missing DeltaNet tensor and a q_proj
    without its gate rows are refused, naming the tensor."""
    from safetensors.torch import load_file, save_file

    from foudre.loading.errors import ModelLoadError

    path = make_qwen3_next(tmp_path / "m")
    original = load_file(path / "model.safetensors")

    def load_with(tensors: dict[str, torch.Tensor]) -> Any:
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        return load_model(str(path), None, "float32", torch.device("cpu"), None).model

    mtp = {**original, "mtp.fc.weight": torch.zeros(64, 128)}
    assert isinstance(load_with(mtp), Qwen3NextForCausalLM)
    missing = {k: v for k, v in original.items() if k != "model.layers.2.linear_attn.A_log"}
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.linear_attn\.A_log.* missing"):
        load_with(missing)
    name = "model.layers.1.self_attn.q_proj.weight"
    halved = {**original, name: original[name][:64]}
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.q_proj"):
        load_with(halved)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"linear_num_value_heads": 3}, "linear_num_value_heads"),
        ({"linear_key_head_dim": 0}, "linear_key_head_dim"),
        (
            {"layer_types": ["linear_attention", "mamba", "full_attention", "full_attention"]},
            "layer_types",
        ),
        ({"layer_types": ["linear_attention"]}, "layer_types"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"full_attention_interval": 0, "layer_types": None}, "full_attention_interval"),
    ],
)
def test_bad_configs_name_the_key(tmp_path: Path, change: dict[str, Any], named: str) -> None:
    import transformers

    from foudre.loading.errors import ModelLoadError
    from foudre.loading.hf import load_hf_config

    transformers.Qwen3NextConfig(**BASE).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw = {k: v for k, v in {**raw, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=named):
        load_hf_config(tmp_path)


def test_interval_gives_the_layers(tmp_path: Path) -> None:
    """Without layer_types, every full_attention_interval-th layer is attention."""
    import transformers

    from foudre.loading.hf import load_hf_config

    transformers.Qwen3NextConfig(**BASE).save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    del raw["layer_types"]
    raw["full_attention_interval"] = 2
    raw["num_hidden_layers"] = 6
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = load_hf_config(tmp_path)
    assert cfg.linear_layers == (0, 2, 4)
    assert cfg.partial_rotary_factor == 0.5
    assert cfg.shared_expert_gate and cfg.norm_topk_prob
    raw["num_experts"] = 0  # dense MLPs everywhere, as transformers builds it
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert not load_hf_config(tmp_path).is_moe
