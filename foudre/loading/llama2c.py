"""llama2.c checkpoints (Karpathy's ``run.c`` "version 0" float32 ``.bin`` format).

Layout: a 28-byte header of seven little-endian int32 (dim, hidden_dim, n_layers, n_heads,
n_kv_heads, vocab_size, seq_len; a negative vocab_size means the classifier is not shared with
the embedding), then float32 arrays in this order::

    token_embedding (vocab, dim)   rms_att (L, dim)   wq (L, dim, dim)   wk, wv (L, kv_dim, dim)
    wo (L, dim, dim)   rms_ffn (L, dim)   w1 (L, hidden, dim)   w2 (L, dim, hidden)
    w3 (L, hidden, dim)   rms_final (dim)   freq_cis_real, freq_cis_imag (seq_len, head_dim/2)
    wcls (vocab, dim), only when vocab_size < 0

Every matrix is stored as PyTorch ``nn.Linear`` stores it, (out_features, in_features).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from foudre.loading.errors import ModelLoadError
from foudre.models.config import ModelConfig

_HEADER = struct.Struct("<7i")
_MAGIC_AK42 = 0x616B3432  # llama2.c export.py version >= 1 files start with "ak42"


def _interleaved_to_rotate_half(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Permute the rows of wq/wk from llama2.c's RoPE pairing to Hugging Face's.

    llama2.c rotates pairs (2i, 2i+1) of each head; HF's rotate_half rotates (i, i + d/2). This
    is the permutation of transformers' ``convert_llama_weights_to_hf``: after it, the HF
    attention computes exactly what llama2.c computes.
    """
    out_features, in_features = w.shape
    head_dim = out_features // n_heads
    return (
        w.view(n_heads, head_dim // 2, 2, in_features)
        .transpose(1, 2)
        .reshape(out_features, in_features)
        .contiguous()
    )


@dataclass(frozen=True, slots=True)
class _Header:
    """The seven header fields; ``vocab`` is positive, ``shared`` says its sign was."""

    dim: int
    hidden: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab: int
    seq_len: int
    shared: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


def _read_checkpoint(path: Path) -> bytes:
    """The file's bytes, checked to hold a header and not to be a versioned ("ak42") file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ModelLoadError(f"{path}: file not found", path) from None
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc}", path) from exc
    if len(data) < _HEADER.size:
        raise ModelLoadError(
            f"{path}: truncated llama2.c checkpoint: expected at least {_HEADER.size} bytes "
            f"of header, got {len(data)} bytes",
            path,
        )
    if struct.unpack_from("<I", data)[0] == _MAGIC_AK42:
        version = struct.unpack_from("<i", data, 4)[0]
        kind = "int8 quantized" if version == 2 else "versioned"
        raise ModelLoadError(
            f"{path}: unsupported llama2.c format version {version} ({kind}, magic 'ak42'); "
            "only the version 0 float32 format (export.py --version 0) is supported",
            path,
        )
    return data


def _parse_header(path: Path, data: bytes) -> _Header:
    """The header of ``data``, checked to be plausible."""
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = _HEADER.unpack_from(data)
    shared = vocab > 0
    vocab = abs(vocab)
    if (
        min(dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len) <= 0
        or dim % n_heads != 0
        or n_heads % n_kv_heads != 0
        or (dim // n_heads) % 2 != 0
    ):
        raise ModelLoadError(
            f"{path}: not a llama2.c v0 checkpoint: implausible header dim={dim} "
            f"hidden_dim={hidden} n_layers={n_layers} n_heads={n_heads} n_kv_heads={n_kv_heads} "
            f"vocab_size={vocab} seq_len={seq_len}",
            path,
        )
    return _Header(dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len, shared)


def _array_shapes(h: _Header) -> list[tuple[str, tuple[int, ...]]]:
    """The float32 arrays after the header, in file order, with their shapes."""
    dim, hidden, n_layers, vocab = h.dim, h.hidden, h.n_layers, h.vocab
    kv_dim = h.n_kv_heads * h.head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [
        ("embed", (vocab, dim)),
        ("rms_att", (n_layers, dim)),
        ("wq", (n_layers, dim, dim)),
        ("wk", (n_layers, kv_dim, dim)),
        ("wv", (n_layers, kv_dim, dim)),
        ("wo", (n_layers, dim, dim)),
        ("rms_ffn", (n_layers, dim)),
        ("w1", (n_layers, hidden, dim)),
        ("w2", (n_layers, dim, hidden)),
        ("w3", (n_layers, hidden, dim)),
        ("rms_final", (dim,)),
        ("freq_cis_real", (h.seq_len, h.head_dim // 2)),
        ("freq_cis_imag", (h.seq_len, h.head_dim // 2)),
    ]
    if not h.shared:
        shapes.append(("wcls", (vocab, dim)))
    return shapes


def _hf_weights(arrays: dict[str, torch.Tensor], h: _Header) -> dict[str, torch.Tensor]:
    """llama2.c's arrays under Hugging Face Llama names, wq and wk permuted to rotate_half."""
    weights: dict[str, torch.Tensor] = {"model.embed_tokens.weight": arrays["embed"]}
    for i in range(h.n_layers):
        p = f"model.layers.{i}."
        weights[p + "input_layernorm.weight"] = arrays["rms_att"][i]
        weights[p + "self_attn.q_proj.weight"] = _interleaved_to_rotate_half(
            arrays["wq"][i], h.n_heads
        )
        weights[p + "self_attn.k_proj.weight"] = _interleaved_to_rotate_half(
            arrays["wk"][i], h.n_kv_heads
        )
        weights[p + "self_attn.v_proj.weight"] = arrays["wv"][i]
        weights[p + "self_attn.o_proj.weight"] = arrays["wo"][i]
        weights[p + "post_attention_layernorm.weight"] = arrays["rms_ffn"][i]
        weights[p + "mlp.gate_proj.weight"] = arrays["w1"][i]
        weights[p + "mlp.down_proj.weight"] = arrays["w2"][i]
        weights[p + "mlp.up_proj.weight"] = arrays["w3"][i]
    weights["model.norm.weight"] = arrays["rms_final"]
    if not h.shared:
        weights["lm_head.weight"] = arrays["wcls"]
    return weights


def load_llama2c(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a llama2.c v0 float32 checkpoint into a ``ModelConfig`` and HF-named float32 weights.

    The weights use Hugging Face Llama names and HF's rotate_half RoPE convention (wq and wk
    are permuted), so a ``LlamaForCausalLM`` loading them reproduces ``run.c``'s logits.
    ``lm_head.weight`` is present only when the classifier is not shared. The file size must
    match the header exactly. Raises ``ModelLoadError`` naming the file for a missing file, a
    bad header, a size mismatch, or a quantized / versioned ("ak42") file.
    """
    path = Path(path)
    data = _read_checkpoint(path)
    h = _parse_header(path, data)
    shapes = _array_shapes(h)
    numels = [torch.Size(shape).numel() for _, shape in shapes]
    expected = _HEADER.size + 4 * sum(numels)
    if len(data) != expected:
        problem = "truncated" if len(data) < expected else "oversized"
        raise ModelLoadError(
            f"{path}: {problem} llama2.c checkpoint: header (dim={h.dim}, n_layers={h.n_layers}, "
            f"vocab_size={h.vocab}, seq_len={h.seq_len}) implies {expected} bytes, file has "
            f"{len(data)} bytes",
            path,
        )

    flat = torch.frombuffer(bytearray(data), dtype=torch.float32, offset=_HEADER.size)
    arrays: dict[str, torch.Tensor] = {}
    offset = 0
    for (name, shape), numel in zip(shapes, numels, strict=True):
        arrays[name] = flat[offset : offset + numel].view(shape)
        offset += numel

    config = ModelConfig(
        architecture="llama",
        vocab_size=h.vocab,
        hidden_size=h.dim,
        intermediate_size=h.hidden,
        num_hidden_layers=h.n_layers,
        num_attention_heads=h.n_heads,
        num_key_value_heads=h.n_kv_heads,
        head_dim=h.head_dim,
        max_position_embeddings=h.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=h.shared,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_ids=[2],
    )
    return config, _hf_weights(arrays, h)
