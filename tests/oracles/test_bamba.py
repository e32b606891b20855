"""Oracle: Bamba (``BambaForCausalLM``, Mamba-2 mixers and attention layers) against
transformers on random small configs, float32.

A plain driver runs the model (``hybrid_driver.HybridDriver``): each request gets a state slot
and blocks of a paged KV cache (handed out in a scattered order), and each step builds the
attention backend's metadata and the ``RecurrentBatch`` of its rows. Compared with
transformers: the logits of prompts prefilled in chunks then decoded token by token, of batches
mixing prefills and decodes of other lengths, and greedy ids against ``generate``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from foudre.attention.cache_spec import RecurrentStateSpec
from foudre.loading.loader import load_model
from foudre.models.bamba import BambaForCausalLM
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
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    attn_layer_indices=[1, 3],
    mamba_n_heads=8,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=8,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
CASES: dict[str, dict[str, Any]] = {
    "attn-1-3": {},
    # attention first, one Mamba group, a tied head, no conv bias, projections with biases
    "attn-0-tied": {
        "attn_layer_indices": [0],
        "num_hidden_layers": 3,
        "mamba_n_groups": 1,
        "tie_word_embeddings": True,
        "mamba_conv_bias": False,
        "mamba_proj_bias": True,
    },
}


def make_bamba(path: Path, seed: int = 0, **overrides: Any) -> Path:
    """A random-weight ``BambaForCausalLM`` in ``path`` (weights drawn as ``make_mamba2`` draws
    them: far from uniform logits, a state that matters)."""
    return save_random("Bamba", {**BASE, **overrides}, path, seed)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    import transformers

    path = make_bamba(tmp_path_factory.mktemp(request.param), **CASES[request.param])
    hf = transformers.BambaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    ours = load_model(str(path), None, "float32", torch.device("cpu"), None).model
    assert isinstance(ours, BambaForCausalLM)
    return path, hf, ours


def test_chunked_prefill_then_decode(pair: Any) -> None:
    """A whole prompt at once, and one in odd chunks then one token at a time: every
    position's logits are transformers' over the whole sequence."""
    _, hf, ours = pair
    ids = _prompt(41, 3)
    (whole,) = HybridDriver(ours, 1, 64).step([(0, ids)])
    torch.testing.assert_close(whole, _hf_logits(hf, ids), atol=1e-4, rtol=0)
    check_chunked_prefill(hf, ours, (5, 11, 1, 9, 3, *[1] * 12))


def test_mixed_batch_of_rows(pair: Any) -> None:
    """Rows mid-prefill, starting and decoding in the same forwards give transformers' logits
    of each whole sequence."""
    check_mixed_batch(pair[1], pair[2])


def test_greedy_ids_equal_generate(pair: Any) -> None:
    """Prompts of different lengths decoded together, one of them forked (n = 2)."""
    check_greedy_forked(pair[1], pair[2])


def test_layers_and_state_bytes(pair: Any) -> None:
    _, hf, ours = pair
    cfg = hf.config
    attn = cfg.attn_layer_indices
    specs = [s for s in ours.kv_cache_specs() if isinstance(s, RecurrentStateSpec)]
    assert len(specs) == cfg.num_hidden_layers - len(attn)
    inner = cfg.mamba_n_heads * cfg.mamba_d_head
    conv = (cfg.mamba_d_conv - 1) * (inner + 2 * cfg.mamba_n_groups * cfg.mamba_d_state) * 4
    ssm = inner * cfg.mamba_d_state * 4
    assert all(s.bytes_per_request(torch.float32) == conv + ssm for s in specs)
