"""Oracle: Mamba-2 (``Mamba2ForCausalLM``) against transformers on random small configs, float32.

The model runs through a plain driver here (``RecurrentStates``: a slot per request; the
engine's own runs are in ``tests/engine/test_recurrent.py``). Compared: whole-sequence logits;
a prompt prefilled in chunks then decoded token by token, its states carried; a batch of rows
of different lengths (prefill and decode mixed) against each row alone; greedy ids against
``generate``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foudre.attention import TorchSDPABackend
from foudre.layers.mamba import RecurrentBatch, RecurrentStates, ssd_chunked
from foudre.loading.loader import load_model
from foudre.models.mamba2 import Mamba2ForCausalLM
from tests.oracles.ssm_models import hf_logits as _hf_logits
from tests.oracles.ssm_models import prompt as _prompt
from tests.oracles.ssm_models import save_random, step_metadata

BASE: dict[str, Any] = dict(
    vocab_size=256,
    hidden_size=64,
    num_hidden_layers=2,
    num_heads=8,
    head_dim=16,
    expand=2,
    state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=8,
    layer_norm_epsilon=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CASES: dict[str, dict[str, Any]] = {
    "groups2": {},
    # one group shared by all heads, a tied head, no conv bias, projections with biases
    "tied-onegroup": {
        "n_groups": 1,
        "tie_word_embeddings": True,
        "use_conv_bias": False,
        "use_bias": True,
        "chunk_size": 16,
        "num_hidden_layers": 3,
    },
}


def make_mamba2(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight ``Mamba2ForCausalLM`` (float32 safetensors) in ``path``: weights drawn
    large enough that the logits are far from uniform, and the SSM's own parameters so that
    the state matters (dt about 0.3-1, decay per token exp(dt A) about 0.6-0.99: a token still
    moves the logits dozens of tokens later)."""
    return save_random("Mamba2", {**BASE, **overrides}, path, seed)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import transformers

    path = make_mamba2(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    hf = transformers.Mamba2ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ours = load_model(str(path), None, "float32", torch.device("cpu"), None).model
    assert isinstance(ours, Mamba2ForCausalLM)
    return path, hf, ours


def _step(
    model: Mamba2ForCausalLM, states: RecurrentStates, rows: list[tuple[int, list[int]]]
) -> list[torch.Tensor]:
    """One forward over ``rows`` (slot, new ids): the logits of every new token, per row."""
    ids = torch.tensor([t for _, new in rows for t in new])
    batch = RecurrentBatch.of_lengths([len(n) for _, n in rows], [s for s, _ in rows], ids.device)
    metadata = step_metadata(model.kv_cache_specs(), None, batch)
    with torch.no_grad():
        hidden = model(ids, torch.zeros_like(ids), states.caches, TorchSDPABackend(), metadata)
        logits = model.compute_logits(hidden)
    return list(logits.split([len(n) for _, n in rows]))


def test_whole_sequence_logits(pair: Any) -> None:
    _, hf, ours = pair
    # one token, under a chunk, several chunks, several of the scan's own (64-token) chunks
    for n, seed in ((1, 0), (7, 1), (40, 2), (600, 5)):
        ids = _prompt(n, seed)
        states = RecurrentStates.of_model(ours, 1)
        (got,) = _step(ours, states, [(states.allocate(), ids)])
        torch.testing.assert_close(got, _hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_chunked_prefill_then_decode(pair: Any) -> None:
    """Chunks of odd sizes (across the scan's own chunks), then one token at a time: every
    position's logits are those of the whole sequence."""
    _, hf, ours = pair
    ids = _prompt(45, 3)
    want = _hf_logits(hf, ids)
    states = RecurrentStates.of_model(ours, 2)
    slot = states.allocate()
    got, at = [], 0
    for size in (5, 11, 1, 9, 3, *[1] * 16):
        (out,) = _step(ours, states, [(slot, ids[at : at + size])])
        got.append(out)
        at += size
    assert at == len(ids)
    torch.testing.assert_close(torch.cat(got), want, atol=1e-4, rtol=0)


def test_batch_of_rows_equals_each_alone(pair: Any) -> None:
    """Rows mid-prefill, starting, and decoding in one forward give each row's own logits."""
    _, _, ours = pair
    prompts = [_prompt(n, 10 + n) for n in (13, 4, 30, 9)]
    alone = []
    for p in prompts:
        states = RecurrentStates.of_model(ours, 1)
        slot = states.allocate()
        first = _step(ours, states, [(slot, p[:-3])])[0]
        rest = [_step(ours, states, [(slot, [t])])[0] for t in p[-3:]]
        alone.append(torch.cat([first, *rest]))
    states = RecurrentStates.of_model(ours, 6)
    slots = [states.allocate() for _ in prompts]
    together: list[list[torch.Tensor]] = [[] for _ in prompts]
    # step 1: rows 0 and 2 prefill part of their prompt; step 2: they finish while 1 and 3
    # start; then every row decodes its last tokens one at a time (mixed with prefills)
    plan = [
        {0: (0, 6), 2: (0, 20)},
        {0: (6, 10), 1: (0, 1), 2: (20, 27), 3: (0, 6)},
        {0: (10, 11), 1: (1, 2), 2: (27, 28), 3: (6, 7)},
        {0: (11, 12), 1: (2, 3), 2: (28, 29), 3: (7, 8)},
        {0: (12, 13), 1: (3, 4), 2: (29, 30), 3: (8, 9)},
    ]
    for step in plan:
        rows = [(slots[r], prompts[r][a:b]) for r, (a, b) in step.items()]
        for r, out in zip(step, _step(ours, states, rows), strict=True):
            together[r].append(out)
    for r in range(len(prompts)):
        torch.testing.assert_close(torch.cat(together[r]), alone[r], atol=1e-4, rtol=0)


def test_greedy_ids_equal_generate(pair: Any) -> None:
    """A batch of prompts of different lengths decoded together, forked once (n = 2)."""
    _, hf, ours = pair
    prompts = [_prompt(n, 20 + n) for n in (5, 17, 33, 200)]
    steps = 12
    want = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False)
        want.append(out[0, len(p) :].tolist())
    states = RecurrentStates.of_model(ours, 5)
    slots = [states.allocate() for _ in prompts]
    logits = _step(ours, states, list(zip(slots, prompts, strict=True)))
    nexts = [int(lg[-1].argmax()) for lg in logits]
    got = [[t] for t in nexts]
    fork = states.fork(slots[1])  # a second sample of prompt 1 continues from a copy
    got.append([nexts[1]])
    slots.append(fork)
    for _ in range(steps - 1):
        logits = _step(ours, states, [(s, [g[-1]]) for s, g in zip(slots, got, strict=True)])
        for g, lg in zip(got, logits, strict=True):
            g.append(int(lg[-1].argmax()))
    assert got[:4] == want
    assert got[4] == want[1]


def test_scan_equals_recurrence() -> None:
    """The chunked scan from a state equals the token-by-token recurrence."""
    torch.manual_seed(0)
    r, length, heads, p, groups, n = 2, 12, 4, 3, 2, 5
    x = torch.randn(r, length, heads, p)
    dt = torch.rand(r, length, heads) * 0.5
    a = -torch.rand(heads) * 2
    b, c = torch.randn(r, length, groups, n), torch.randn(r, length, groups, n)
    h0 = torch.randn(r, heads, p, n)
    y, h, _ = ssd_chunked(x, dt, a, b, c, h0, 4)
    state = h0.clone()
    bh, ch = b.repeat_interleave(2, 2), c.repeat_interleave(2, 2)
    for t in range(length):
        decay = torch.exp(dt[:, t] * a)[:, :, None, None]
        state = state * decay + (dt[:, t, :, None] * x[:, t])[..., None] * bh[:, t, :, None, :]
        want = torch.einsum("rhpn,rhn->rhp", state, ch[:, t])
        torch.testing.assert_close(y[:, t], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h, state, atol=1e-5, rtol=1e-5)


def test_state_bytes_follow_the_config(pair: Any) -> None:
    _, hf, ours = pair
    cfg = hf.config
    conv_dim = cfg.num_heads * cfg.head_dim + 2 * cfg.n_groups * cfg.state_size
    per_layer = (
        cfg.conv_kernel - 1
    ) * conv_dim * 4 + cfg.num_heads * cfg.head_dim * cfg.state_size * 4
    specs = ours.kv_cache_specs()
    assert len(specs) == cfg.num_hidden_layers
    assert all(s.bytes_per_request(torch.float32) == per_layer for s in specs)


def test_bad_checkpoints_name_the_key_or_tensor(tmp_path: Path) -> None:
    """A config whose state size disagrees with the tensors, a missing tensor and heads that
    do not make expand * hidden_size are refused, naming the tensor or the key."""
    import json

    from foudre.loading.errors import ModelLoadError
    from foudre.loading.hf import load_hf_config

    path = make_mamba2(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "state_size": 8}))
    with pytest.raises(ModelLoadError, match=r"weight .backbone\.layers\.0\.mixer\..* has shape"):
        load_model(str(path), None, "float32", torch.device("cpu"), None)
    (path / "config.json").write_text(json.dumps({**config, "head_dim": 8}))
    with pytest.raises(ModelLoadError, match="expand \\* hidden_size"):
        load_hf_config(path)
    (path / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    with pytest.raises(ModelLoadError, match="hidden_act"):
        load_hf_config(path)
    (path / "config.json").write_text(json.dumps(config))
    from safetensors.torch import load_file, save_file

    tensors = load_file(path / "model.safetensors")
    del tensors["backbone.layers.1.mixer.D"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"backbone\.layers\.1\.mixer\.D.* missing"):
        load_model(str(path), None, "float32", torch.device("cpu"), None)


def test_scan_in_slices_of_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scan's chunks taken a few at a time (bounded memory) give the same result."""
    from foudre.layers import mamba

    torch.manual_seed(1)
    x, dt = torch.randn(2, 24, 4, 3), torch.rand(2, 24, 4) * 0.5
    a, b, c = -torch.rand(4), torch.randn(2, 24, 1, 5), torch.randn(2, 24, 1, 5)
    h0 = torch.randn(2, 4, 3, 5)
    want = ssd_chunked(x, dt, a, b, c, h0, 4)[:2]
    monkeypatch.setattr(mamba, "SCAN_ELEMENTS", 2 * 4 * 4 * 4 * 2)  # two chunks at a time
    got = ssd_chunked(x, dt, a, b, c, h0, 4)[:2]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
