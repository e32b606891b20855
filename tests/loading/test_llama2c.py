"""llama2.c checkpoint loading, with stories260K's published greedy text as the oracle."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

from foudre.loading import Llama2cTokenizer, ModelLoadError, load_llama2c

from .paths import STORIES_BIN, STORIES_Q8, TOK512, shared_file

STORIES_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."
)


def test_header_and_shapes() -> None:
    config, weights = load_llama2c(shared_file(STORIES_BIN))
    assert (config.hidden_size, config.num_hidden_layers) == (64, 5)
    assert (config.num_attention_heads, config.num_key_value_heads) == (8, 4)
    assert (config.vocab_size, config.max_position_embeddings) == (512, 512)
    assert config.head_dim == 8 and config.intermediate_size == 172
    assert config.tie_word_embeddings and "lm_head.weight" not in weights
    assert config.bos_token_id == 1 and config.eos_token_ids == [2]
    assert config.architecture == "llama" and config.torch_dtype == "float32"
    assert weights["model.embed_tokens.weight"].shape == (512, 64)
    assert weights["model.layers.4.self_attn.q_proj.weight"].shape == (64, 64)
    assert weights["model.layers.4.self_attn.k_proj.weight"].shape == (32, 64)
    assert weights["model.layers.4.self_attn.v_proj.weight"].shape == (32, 64)
    assert weights["model.layers.0.mlp.gate_proj.weight"].shape == (172, 64)
    assert weights["model.layers.0.mlp.down_proj.weight"].shape == (64, 172)
    assert weights["model.norm.weight"].shape == (64,)
    assert len(weights) == 2 + 9 * 5
    assert all(w.dtype == torch.float32 for w in weights.values())


def test_greedy_generation_matches_llama2c() -> None:
    """The rotate_half permutation is right iff HF's Llama reproduces llama2.c's story."""
    transformers = pytest.importorskip("transformers")
    config, weights = load_llama2c(shared_file(STORIES_BIN))
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(hf_config).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[1]]), max_new_tokens=40, do_sample=False, min_new_tokens=40
        )
    text = Llama2cTokenizer(shared_file(TOK512)).decode(out[0].tolist())
    assert text.startswith(STORIES_TEXT), text


def _write(path: Path, header: tuple[int, ...], n_floats: int) -> Path:
    path.write_bytes(struct.pack("<7i", *header) + bytes(4 * n_floats))
    return path


def _numel(dim: int, hidden: int, layers: int, heads: int, kv: int, vocab: int, seq: int) -> int:
    hd = dim // heads
    per_layer = 2 * dim + 2 * dim * dim + 2 * kv * hd * dim + 3 * dim * hidden
    return vocab * dim + layers * per_layer + dim + seq * hd


def test_untied_classifier_and_permutation(tmp_path: Path) -> None:
    header = (8, 12, 1, 2, 1, -10, 4)
    n = _numel(8, 12, 1, 2, 1, 10, 4) + 10 * 8
    path = tmp_path / "tiny.bin"
    values = torch.arange(n, dtype=torch.float32)
    path.write_bytes(struct.pack("<7i", *header) + values.numpy().tobytes())
    config, weights = load_llama2c(path)
    assert not config.tie_word_embeddings and weights["lm_head.weight"].shape == (10, 8)
    assert weights["lm_head.weight"].flatten()[-1].item() == n - 1
    # q rows: head 0 stored as pairs (0,1),(2,3) -> rotate_half order 0,2,1,3.
    wq_start = 10 * 8 + 8
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q[:4, 0].tolist() == [wq_start + r * 8 for r in (0, 2, 1, 3)]


@pytest.mark.parametrize("delta", [-4, 4])
def test_size_mismatch_names_file_and_sizes(tmp_path: Path, delta: int) -> None:
    n = _numel(8, 12, 1, 2, 1, 10, 4)
    path = _write(tmp_path / "bad.bin", (8, 12, 1, 2, 1, 10, 4), n)
    path.write_bytes(path.read_bytes()[:delta] if delta < 0 else path.read_bytes() + bytes(delta))
    with pytest.raises(ModelLoadError) as exc:
        load_llama2c(path)
    message = str(exc.value)
    assert "bad.bin" in message and str(28 + 4 * n) in message
    assert str(28 + 4 * n + delta) in message
    assert ("truncated" if delta < 0 else "oversized") in message


def test_truncated_real_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "stories_cut.bin"
    path.write_bytes(shared_file(STORIES_BIN).read_bytes()[:-100])
    with pytest.raises(ModelLoadError, match=r"stories_cut.bin.*truncated"):
        load_llama2c(path)


def test_bad_header_and_tiny_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"header"):
        load_llama2c(_write(tmp_path / "h.bin", (7, 12, 1, 2, 1, 10, 4), 10))
    (tmp_path / "t.bin").write_bytes(b"abc")
    with pytest.raises(ModelLoadError, match=r"t.bin"):
        load_llama2c(tmp_path / "t.bin")
    with pytest.raises(ModelLoadError, match=r"missing.bin"):
        load_llama2c(tmp_path / "missing.bin")


def test_quantized_v2_is_refused() -> None:
    with pytest.raises(ModelLoadError, match=r"unsupported llama2.c format version 2"):
        load_llama2c(shared_file(STORIES_Q8))
