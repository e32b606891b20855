"""GGUF import, against files written the way llama.cpp writes them.

``write_gguf`` writes what ``convert_hf_to_gguf.py`` writes (metadata keys, tensor names from
the gguf package's own name map, the q/k ``permute`` of llama models, ``rope_freqs`` for
Llama 3 RoPE scaling, the vocabulary export) and ``llama-quantize`` (2-D weights quantized,
norms kept F32).
The legacy types are quantized by the gguf package; it has no K-quant quantizer, so K-quant
blocks are packed here from the block layouts of ggml-quants.c, with their exact values known;
Q3_K and IQ4_NL blocks (types loaded dequantized) hold random codes, valued by its dequantizer.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from safetensors.torch import load_file

from foudre.layers.rotary import rope_inv_freq
from foudre.loading.errors import ModelLoadError
from foudre.loading.gguf import _llama3_rope_scaling, load_gguf, read_gguf
from foudre.loading.loader import load_model, load_tokenizer
from foudre.loading.tokenizer import HFTokenizer, SentencePieceTokenizer
from foudre.loading.writer import copy_tokenizer
from foudre.models.llama import LlamaForCausalLM
from foudre.quant.calib import run_sequence
from tests.conftest import SHARED, make_hf_model

CPU = torch.device("cpu")
CORPUS = (
    "Once upon a time, a little fox lived in a green forest near the river. Every morning "
    "she ran to the water to drink and to watch the fish jump. One day she met an old turtle "
    "who told her stories about the sea, the mountains and the cities far away. The fox "
    "listened, asked questions, and dreamed of travelling. In 1987 the turtle had walked "
    "12345 steps! Numbers like 3.14159 and 2,718 were his favourite things; he counted "
    'everything: stones, clouds, birds, and the stars at night. "Why do you count?" asked '
    "the fox. 'Because counting makes the world quiet,' he said. Café, naïve, jalapeño — "
    "some words came from other languages. 日本語 text and emoji 🦊🐢 appeared too.\n\n"
    "    Indented lines, tabs\tand  double  spaces were part of the story as well.\n"
)
TEXTS = [
    "Hello world",
    "The fox counted 12345 stars, then 7 more.",
    "  two  spaces\n\nand a newline\tand a tab",
    "Café naïve 🦊 日本語 ü",
    "",
    " ",
    "unseen zebra quokka xylophone",
    "<|eot_id|> inside text",
]
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")
LEGACY = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


# ----------------------------------------------------------------------------- K-quant packing


def _safe(x: np.ndarray) -> np.ndarray:
    return np.where(x > 0, x, 1).astype(np.float32)


def _pack_q45_k(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K blocks of ``x`` [rows, cols] and their exact values: 256 values per block,
    8 sub-blocks of 32 with 6-bit scale and min, ``y = d*sc*q - dmin*m``."""
    qmax = (1 << bits) - 1
    rows = x.shape[0]
    b = x.reshape(-1, 8, 32).astype(np.float32)
    n = b.shape[0]
    lo, hi = np.minimum(b.min(-1), 0), np.maximum(b.max(-1), 0)
    scale, offset = (hi - lo) / qmax, -lo
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (offset.max(-1) / 63).astype(np.float16)
    df, dminf = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / _safe(df)), 0, 63).astype(np.uint8)
    m = np.clip(np.round(offset / _safe(dminf)), 0, 63).astype(np.uint8)
    eff_d, eff_m = df * sc.astype(np.float32), dminf * m.astype(np.float32)
    q = np.clip(np.round((b + eff_m[..., None]) / _safe(eff_d)[..., None]), 0, qmax)
    q = q.astype(np.uint8)
    values = eff_d[..., None] * q.astype(np.float32) - eff_m[..., None]
    scales = np.zeros((n, 12), np.uint8)  # get_scale_min_k4's packing
    scales[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    scales[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    scales[:, 8:12] = (sc[:, 4:8] & 0xF) | ((m[:, 4:8] & 0xF) << 4)
    pairs = q.reshape(n, 4, 2, 32)  # 64 values per 32 bytes: low nibbles, then high nibbles
    qs = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).reshape(n, 128)
    parts = [d.view(np.uint8).reshape(n, 2), dmin.view(np.uint8).reshape(n, 2), scales]
    if bits == 5:
        qh = np.zeros((n, 32), np.uint8)  # bit s of qh[l]: the 5th bit of sub-block s, value l
        for s in range(8):
            qh |= ((q[:, s] >> 4) & 1) << s
        parts.append(qh)
    raw = np.concatenate([*parts, qs], axis=1)
    return raw.reshape(rows, -1), values.reshape(x.shape)


def _pack_q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K blocks: 16 sub-blocks of 16 with int8 scales, ``y = d*sc*(q - 32)``, q in 0..63,
    stored as ql[128] (low nibbles), qh[64] (high 2 bits), scales[16], d."""
    rows = x.shape[0]
    b = x.reshape(-1, 16, 16).astype(np.float32)
    n = b.shape[0]
    scale = np.abs(b).max(-1) / 31
    d = (scale.max(-1) / 127).astype(np.float16)
    df = d.astype(np.float32)[:, None]
    sc = np.clip(np.round(scale / _safe(df)), -128, 127).astype(np.int8)
    eff = df * sc.astype(np.float32)
    q = (np.clip(np.round(b / _safe(eff)[..., None]), -32, 31) + 32).astype(np.uint8)
    values = eff[..., None] * (q.astype(np.float32) - 32)
    h = q.reshape(n, 2, 4, 32)  # [half][quarter][l] = value 128*half + 32*quarter + l
    low = h & 0xF
    ql = np.concatenate(
        [low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2
    ).reshape(n, 128)
    qh = ((h[:, :, 0] >> 4) | ((h[:, :, 1] >> 4) << 2) | ((h[:, :, 2] >> 4) << 4)
          | ((h[:, :, 3] >> 4) << 6)).reshape(n, 64)  # fmt: skip
    raw = np.concatenate([ql, qh, sc.view(np.uint8), d.view(np.uint8).reshape(n, 2)], axis=1)
    return raw.reshape(rows, -1), values.reshape(x.shape)


# where the float16 scale ``d`` sits in a block of the types the gguf package cannot quantize
_D_AT = {"Q3_K": 108, "IQ4_NL": 0}


def _random_blocks(x: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """Blocks of ``qtype`` with random codes (and sub-block scales) and ``d`` set from ``x``'s
    magnitude, and their values by the gguf package's dequantizer."""
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    rng = np.random.default_rng(x.size)
    raw = rng.integers(0, 256, (x.shape[0], x.shape[1] // block, size), dtype=np.uint8)
    d = np.array(np.abs(x).max() / 127, np.float16)
    raw[..., _D_AT[qtype] : _D_AT[qtype] + 2] = np.frombuffer(d.tobytes(), np.uint8)
    raw = raw.reshape(x.shape[0], -1)
    return raw, gguf.quants.dequantize(raw, Q[qtype])


def quantize(x: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(raw GGUF bytes [rows, row_bytes], exact dequantized values) of ``x`` in ``qtype``."""
    if qtype == "Q4_K":
        return _pack_q45_k(x, 4)
    if qtype == "Q5_K":
        return _pack_q45_k(x, 5)
    if qtype == "Q6_K":
        return _pack_q6_k(x)
    if qtype in _D_AT:
        return _random_blocks(x, qtype)
    raw = gguf.quants.quantize(x.astype(np.float32), Q[qtype])
    return raw, gguf.quants.dequantize(raw, Q[qtype])


# ----------------------------------------------------------------------------- writer


def _permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """HF q/k rows to llama.cpp's rotary layout: within each head, the two halves of the rows
    (HF rotates ``x[i]`` with ``x[i + d/2]``) are interleaved (``x[2i]`` with ``x[2i + 1]``)."""
    heads = n_head_kv if n_head_kv is not None else n_head
    d = weights.shape[0] // heads
    halves = weights.reshape(heads, 2, d // 2, *weights.shape[1:])
    return np.stack([halves[:, 0], halves[:, 1]], axis=2).reshape(weights.shape)


def _llama3_rope_factors(rope: dict[str, Any], head_dim: int, base: float) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as ``rope_freqs`` for Llama-3 RoPE scaling:
    1 for short wavelengths, ``factor`` for long ones, a smooth blend in between."""
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    context = rope.get("original_max_position_embeddings", 8192)
    inv_freq = base ** -(torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / factor + smooth)
    out = torch.where(wavelen < context / high, 1.0, blended)
    out = torch.where(wavelen > context / low, factor, out)
    return out.numpy().astype(np.float32)


def _add_spm_vocab(w: gguf.GGUFWriter, model: bytes, n_vocab: int) -> None:
    """_set_vocab_sentencepiece: pieces, scores, types (padded with [PADi]), special ids."""
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_proto=model)
    tokens = [f"[PAD{i}]".encode() for i in range(n_vocab)]
    scores, types = [-10000.0] * n_vocab, [gguf.TokenType.UNUSED] * n_vocab
    for i in range(sp.vocab_size()):
        tokens[i], scores[i] = sp.id_to_piece(i).encode(), sp.get_score(i)
        types[i] = gguf.TokenType.NORMAL
        if sp.is_unknown(i):
            types[i] = gguf.TokenType.UNKNOWN
        elif sp.is_control(i):
            types[i] = gguf.TokenType.CONTROL
        elif sp.is_unused(i):
            types[i] = gguf.TokenType.UNUSED
        elif sp.is_byte(i):
            types[i] = gguf.TokenType.BYTE
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(sp.bos_id())
    w.add_eos_token_id(sp.eos_id())
    w.add_unk_token_id(sp.unk_id())
    w.add_add_bos_token(True)


def _add_bpe_vocab(w: gguf.GGUFWriter, tok_dir: Path, pre: str, n_vocab: int) -> None:
    """get_vocab_base + _set_vocab_gpt2: tokens by id, added ones typed, SpecialVocab merges."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    reverse = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(reverse[i])
            special = added[i].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    gguf.SpecialVocab(tok_dir, load_merges=True, n_vocab=n_vocab).add_to_gguf(w)


def write_gguf(
    src: Path,
    out: Path,
    qtype: str = "F32",
    *,
    spm: bytes | None = None,
    bpe: tuple[Path, str] | None = None,
    zeros: dict[str, Q] | None = None,
    types: dict[str, str] | None = None,
) -> dict[str, np.ndarray]:
    """Convert the HF model in ``src`` to ``out``; return the exact values of the weights stored
    in ``qtype`` (as stored: q/k permuted) by HF name. ``zeros`` writes the named tensors as
    all-zero blocks of another type; ``types`` writes the named 2-D tensors in another type."""
    cfg = json.loads((src / "config.json").read_text())
    state = load_file(str(src / "model.safetensors"))
    arch = {
        "LlamaForCausalLM": "llama",
        "Qwen2ForCausalLM": "qwen2",
        "Qwen3ForCausalLM": "qwen3",
        "Phi3ForCausalLM": "phi3",
    }[cfg["architectures"][0]]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name("test model")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    if "head_dim" in cfg and arch != "llama":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(head_dim)
    if spm is not None:
        _add_spm_vocab(w, spm, cfg["vocab_size"])
    if bpe is not None:
        _add_bpe_vocab(w, bpe[0], bpe[1], cfg["vocab_size"])
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", _llama3_rope_factors(rope, head_dim, theta))
    if arch == "phi3":
        _add_phi3(w, cfg, rope)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], cfg["num_hidden_layers"])
    values: dict[str, np.ndarray] = {}
    for hf_name, tensor in state.items():
        data = tensor.float().numpy()
        if arch == "llama" and hf_name.endswith(("q_proj.weight", "q_proj.bias")):
            data = _permute(data, heads, heads)
        if arch == "llama" and hf_name.endswith(("k_proj.weight", "k_proj.bias")):
            data = _permute(data, heads, kv_heads)
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf_name
        kind = (types or {}).get(name, qtype)
        if zeros and name in zeros:
            block, size = gguf.GGML_QUANT_SIZES[zeros[name]]
            raw = np.zeros((data.shape[0], data.shape[1] // block * size), np.uint8)
            w.add_tensor(name, raw, raw_dtype=zeros[name])
        elif data.ndim == 1 or kind == "F32":
            w.add_tensor(name, data.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(name, data.astype(np.float16))
            values[hf_name] = data.astype(np.float16).astype(np.float32)
        else:
            raw, values[hf_name] = quantize(data, kind)
            w.add_tensor(name, raw, raw_dtype=Q[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return values


def _add_phi3(w: gguf.GGUFWriter, cfg: dict[str, Any], rope: dict[str, Any]) -> None:
    """What convert_hf_to_gguf.py's Phi3MiniModel adds: the rotated width, the original
    context, the window (0: none), and LongRoPE's attention factor and factor tensors."""
    heads = cfg["num_attention_heads"]
    rot = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(int(rot * cfg["hidden_size"]) // heads)
    original = cfg["original_max_position_embeddings"]
    w.add_rope_scaling_orig_ctx_len(original)
    w.add_sliding_window(cfg.get("sliding_window") or 0)
    if rope.get("rope_type") == "longrope":
        scale = cfg["max_position_embeddings"] / original
        attn = math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0
        w.add_rope_scaling_attn_factors(attn)
        w.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def spm_model() -> bytes:
    """A Llama-style sentencepiece BPE model (byte fallback, identity normalizer)."""
    import sentencepiece

    buf = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(CORPUS.split(". ") * 4),
        model_writer=buf,
        model_type="bpe",
        vocab_size=384,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        split_digits=True,
        character_coverage=1.0,
        minloglevel=2,
    )
    return buf.getvalue()


def _train_bpe(out: Path, pre: str) -> Path:
    """A byte-level BPE tokenizer.json (+ tokenizer_config.json) like Llama 3's or Qwen2's."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    from foudre.loading.gguf import _BPE_PRE_TOKENIZERS

    regex, ignore_merges, nfc = _BPE_PRE_TOKENIZERS[pre]
    tok = Tokenizer(models.BPE(ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
    trainer = BpeTrainer(
        vocab_size=380,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 2, trainer)
    tok.add_tokens(["<think>"])  # a user-defined (non-special) added token, as Qwen3 has
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "bos_token": specials[0],
        "eos_token": specials[2],
        "add_bos_token": pre == "llama-bpe",
        "chat_template": "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def qwen_bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train_bpe(tmp_path_factory.mktemp("qwen_bpe"), "qwen2")


PROMPT = [1, 17, 250, 3, 99, 380, 42, 42, 7, 300, 12, 5, 211, 64, 128, 33]


def _logits(model: LlamaForCausalLM, ids: list[int] = PROMPT) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(run_sequence(model, ids))


@pytest.fixture(scope="module")
def llama_ref(llama_dir: Path) -> tuple[LlamaForCausalLM, torch.Tensor]:
    model = load_model(str(llama_dir), None, "float32", CPU, None).model
    return model, _logits(model)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ----------------------------------------------------------------------------- block layouts


def test_legacy_block_layouts_decode_as_ggml_quants_c() -> None:
    """The package's decoders against the C structs: d (and m) fp16, then packed codes."""
    rng = np.random.default_rng(0)
    n = 3
    d = rng.uniform(0.01, 0.1, n).astype(np.float16)
    m = rng.uniform(-1, 1, n).astype(np.float16)
    df, mf = d.astype(np.float32)[:, None], m.astype(np.float32)[:, None]
    dbytes, mbytes = d.view(np.uint8).reshape(n, 2), m.view(np.uint8).reshape(n, 2)

    q8 = rng.integers(-128, 128, (n, 32)).astype(np.int8)
    cases = {"Q8_0": (np.concatenate([dbytes, q8.view(np.uint8)], 1), df * q8)}
    q4 = rng.integers(0, 16, (n, 32)).astype(np.uint8)
    nib = q4[:, :16] | (q4[:, 16:] << 4)  # value j in the low nibble, j+16 in the high one
    cases["Q4_0"] = (np.concatenate([dbytes, nib], 1), df * (q4.astype(np.float32) - 8))
    cases["Q4_1"] = (np.concatenate([dbytes, mbytes, nib], 1), df * q4 + mf)
    q5 = rng.integers(0, 32, (n, 32)).astype(np.uint32)
    qh = ((q5 >> 4) << np.arange(32, dtype=np.uint32)).sum(1).astype("<u4")  # bit j: value j
    nib5 = (q5[:, :16] & 0xF) | ((q5[:, 16:] & 0xF) << 4)
    qhb = qh.view(np.uint8).reshape(n, 4)
    cases["Q5_0"] = (
        np.concatenate([dbytes, qhb, nib5.astype(np.uint8)], 1),
        df * (q5.astype(np.float32) - 16),
    )
    cases["Q5_1"] = (np.concatenate([dbytes, mbytes, qhb, nib5.astype(np.uint8)], 1), df * q5 + mf)
    for name, (raw, expected) in cases.items():
        got = gguf.quants.dequantize(raw.astype(np.uint8), Q[name])
        np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_k_quant_layouts_decode_to_the_packed_values(qtype: str) -> None:
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (3, 512)).astype(np.float32)
    raw, values = quantize(x, qtype)
    assert raw.shape == (3, 2 * gguf.GGML_QUANT_SIZES[Q[qtype]][1])
    np.testing.assert_allclose(gguf.quants.dequantize(raw, Q[qtype]), values, rtol=1e-6, atol=1e-6)
    # and the packing itself is a sane quantizer (so a wrong layout could not pass by luck)
    bound = {"Q4_K": 0.2, "Q5_K": 0.1, "Q6_K": 0.06}[qtype]
    assert np.abs(values - x).max() < bound


# ----------------------------------------------------------------------------- models


def test_header_parser_agrees_with_gguf_reader(
    llama_dir: Path, spm_model: bytes, tmp_path: Path
) -> None:
    out = tmp_path / "m.gguf"
    write_gguf(llama_dir, out, "Q4_K", spm=spm_model)
    ours, ref = read_gguf(out), gguf.GGUFReader(out)
    assert list(ours.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        mine = ours.tensors[t.name]
        assert (mine.type, mine.offset) == (int(t.tensor_type), t.data_offset)
        assert mine.nbytes == t.n_bytes
        assert mine.shape == tuple(reversed([int(d) for d in t.shape]))
    for key in ("general.architecture", "llama.embedding_length", "llama.rope.freq_base"):
        assert ours.metadata[key] == ref.fields[key].contents()
    field = ref.fields["tokenizer.ggml.tokens"]
    assert ours.metadata["tokenizer.ggml.tokens"] == [bytes(field.parts[i]) for i in field.data]
    assert ours.metadata["tokenizer.ggml.scores"] == pytest.approx(
        ref.fields["tokenizer.ggml.scores"].contents()
    )


def test_f32_llama_matches_the_hf_checkpoint_exactly(
    llama_dir: Path, llama_ref: tuple[LlamaForCausalLM, torch.Tensor], spm_model: bytes,
    tmp_path: Path,
) -> None:  # fmt: skip
    out = tmp_path / "llama-f32.gguf"
    write_gguf(llama_dir, out, "F32", spm=spm_model)
    loaded = load_model(str(out), None, "auto", CPU, None)
    ref_model, ref_logits = llama_ref
    cfg = loaded.config
    assert (cfg.architecture, cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (
        "llama", 256, 2, 64
    )  # fmt: skip
    assert cfg.torch_dtype == "float32" and not cfg.tie_word_embeddings
    assert cfg.bos_token_id == 1 and cfg.eos_token_ids == [2] and cfg.rope_scaling is None
    ours, ref = loaded.model.state_dict(), ref_model.state_dict()
    assert ours.keys() == ref.keys()
    assert all(torch.equal(ours[k], ref[k]) for k in ref)  # q/k un-permuted exactly
    assert torch.equal(_logits(loaded.model), ref_logits)
    assert loaded.tokenizer_path == str(out)


def _weight(model: LlamaForCausalLM, hf_name: str) -> np.ndarray:
    """The model's copy of the Hugging Face weight ``hf_name`` (a slice of a fused one)."""
    cfg = model.config
    *path, proj, leaf = hf_name.split(".")
    fused = {
        "q_proj": ("qkv_proj", 0, cfg.q_size),
        "k_proj": ("qkv_proj", cfg.q_size, cfg.kv_size),
        "v_proj": ("qkv_proj", cfg.q_size + cfg.kv_size, cfg.kv_size),
        "gate_proj": ("gate_up_proj", 0, cfg.intermediate_size),
        "up_proj": ("gate_up_proj", cfg.intermediate_size, cfg.intermediate_size),
    }
    if proj not in fused:
        return model.get_parameter(hf_name).detach().float().numpy()
    param = model.get_parameter(".".join([*path, fused[proj][0], leaf]))
    param = param.narrow(0, fused[proj][1], fused[proj][2])
    return param.detach().float().numpy()


# Relative L2 error of the weights against float32: about 1.3x what each format gives on
# Gaussian weights (F16 2e-4, BF16 1.7e-3, Q8_0 5.4e-3, Q6_K 1.9e-2, Q5_* 3.8-4.3e-2,
# Q4_* 7.8-8.6e-2 with the simple K-quant fit above; llama.cpp's search fits K-quants a
# little better). The
# logits of this random 2-layer model amplify weight error about 4x (measured 4.0-4.4x for
# every format), so their bound is 5x the weight bound.
WEIGHT_TOLERANCE = {
    "F16": 3e-4, "BF16": 2.5e-3, "Q8_0": 0.007, "Q6_K": 0.025, "Q5_1": 0.05, "Q5_0": 0.055,
    "Q5_K": 0.05, "Q4_1": 0.1, "Q4_0": 0.11, "Q4_K": 0.1,
}  # fmt: skip


@pytest.mark.parametrize("qtype", list(WEIGHT_TOLERANCE))
def test_quantized_llama_weights_and_logits(
    qtype: str, llama_dir: Path, llama_ref: tuple[LlamaForCausalLM, torch.Tensor],
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Dequantized at load (``FOUDRE_GGUF_DEQUANTIZE=1``; the types kept quantized by default
    are checked against this in ``test_gguf_quantized``): exactly the stored values."""
    monkeypatch.setenv("FOUDRE_GGUF_DEQUANTIZE", "1")
    out = tmp_path / f"llama-{qtype}.gguf"
    values = write_gguf(llama_dir, out, qtype)
    loaded = load_model(str(out), None, "float32", CPU, None)
    assert loaded.config.torch_dtype == ("float16" if qtype == "F16" else "bfloat16")
    model, (ref_model, ref_logits) = loaded.model, llama_ref
    assert len(values) == 2 + 7 * 2  # every 2-D weight is quantized
    for hf_name, value in values.items():  # exactly the stored values, q/k un-permuted
        w = _weight(model, hf_name)
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            w = _permute(w, 4, 4 if "q_proj" in hf_name else 2)
        np.testing.assert_array_equal(w, value, err_msg=hf_name)
    down = "model.layers.1.mlp.down_proj.weight"
    w_err = _rel(torch.from_numpy(_weight(model, down)), torch.from_numpy(_weight(ref_model, down)))
    assert 0 < w_err < WEIGHT_TOLERANCE[qtype], w_err
    err = _rel(_logits(model), ref_logits)
    assert 0 < err < 5 * WEIGHT_TOLERANCE[qtype], err


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qwen_matches_the_hf_checkpoint(arch: str, qwen_bpe: Path, tmp_path: Path) -> None:
    overrides: dict[str, Any] = {"vocab_size": 400}
    if arch == "qwen2":
        overrides["tie_word_embeddings"] = True
    else:
        overrides["head_dim"] = 32  # key_length in the GGUF, != hidden / heads
    src = make_hf_model(tmp_path / arch, arch, **overrides)
    out = tmp_path / f"{arch}.gguf"
    write_gguf(src, out, "F32", bpe=(qwen_bpe, "qwen2"))
    loaded = load_model(str(out), None, "float32", CPU, None)
    ref = load_model(str(src), None, "float32", CPU, None).model
    cfg = loaded.config
    assert cfg.architecture == arch and cfg.tie_word_embeddings == (arch == "qwen2")
    assert cfg.attention_bias == (arch == "qwen2") and cfg.qk_norm == (arch == "qwen3")
    assert cfg.head_dim == (32 if arch == "qwen3" else 16)
    ids = PROMPT[:10]
    assert torch.equal(_logits(loaded.model, ids), _logits(ref, ids))
    # Q8_0 weights (as convert_hf_to_gguf.py --outtype q8_0 writes them): dequantized at load,
    # the weights' rounding only; kept quantized, the activations are also rounded to int8 per
    # block of 32 (on VNNI, as llama.cpp runs Q8_0) and to bfloat16 (the loader's compute dtype
    # for a float32 model with quantized linears), about doubling it
    write_gguf(src, out, "Q8_0", bpe=(qwen_bpe, "qwen2"))
    dequantized = load_model(str(out), None, "float32", CPU, None, gguf_dequantize=True).model
    assert _rel(_logits(dequantized, ids), _logits(ref, ids)) < 0.01
    quant = load_model(str(out), None, "float32", CPU, None).model
    assert _rel(_logits(quant, ids), _logits(ref, ids)) < 0.025
    tok = load_tokenizer(out)
    assert tok.encode("The fox") == HFTokenizer(qwen_bpe / "tokenizer.json").encode("The fox")


def test_llama3_rope_scaling_is_recovered_from_rope_freqs(tmp_path: Path) -> None:
    # high_freq_factor 8 and a short original context put two frequencies on the smooth ramp
    rope = {
        "rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 8.0,
        "original_max_position_embeddings": 256, "rope_theta": 10000.0,
    }  # fmt: skip
    src = make_hf_model(tmp_path / "l3", "llama", rope_parameters=rope)
    out = tmp_path / "l3.gguf"
    write_gguf(src, out, "F32")
    cfg, _ = load_gguf(out)
    assert cfg.rope_scaling is not None
    assert cfg.rope_scaling["factor"] == 4.0
    assert cfg.rope_scaling["high_freq_factor"] == pytest.approx(8.0)
    assert cfg.rope_scaling["original_max_position_embeddings"] == 256
    model = load_model(str(out), None, "float32", CPU, None).model
    ref = load_model(str(src), None, "float32", CPU, None).model
    ids = list(range(3, 40))
    assert torch.allclose(_logits(model, ids), _logits(ref, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    ("factor", "low", "high"), [(8.0, 1.0, 4.0), (32.0, 1.0, 4.0), (8.0, 2.0, 4.0)]
)
def test_llama3_rope_fit_on_real_llama3_shapes(factor: float, low: float, high: float) -> None:
    """Llama 3.1 / 3.2 parameters (head_dim 128, theta 5e5), and an equivalent one."""
    rope = dict(factor=factor, low_freq_factor=low, high_freq_factor=high)
    divisors = _llama3_rope_factors(rope, 128, 500000.0)
    scaling = _llama3_rope_scaling(divisors, 128, 500000.0, Path("x.gguf"))
    assert scaling is not None and scaling["factor"] == factor
    inv = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    np.testing.assert_allclose(rope_inv_freq(128, 500000.0, scaling), inv / divisors, rtol=1e-5)


def test_llm_generates_from_a_gguf_file(llama_dir: Path, spm_model: bytes, tmp_path: Path) -> None:
    from foudre import LLM, SamplingParams

    out = tmp_path / "model.gguf"
    write_gguf(llama_dir, out, "F32", spm=spm_model)
    common: dict[str, Any] = dict(dtype="float32", max_model_len=64, num_kv_blocks=16)
    llm = LLM(model=str(out), **common)
    prompt = "Once upon a time"
    ids = SentencePieceTokenizer(spm_model).encode(prompt)
    assert llm.get_tokenizer().encode(prompt) == ids
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    got = llm.generate(prompt, params)[0].outputs[0]
    ref = LLM(model=str(llama_dir), skip_tokenizer_init=True, **common)
    assert got.token_ids == ref.generate([ids], params)[0].outputs[0].token_ids
    assert len(got.token_ids) == 8 and got.text == llm.get_tokenizer().decode(got.token_ids)


# ----------------------------------------------------------------------------- tokenizers


def _tokenizer_gguf(path: Path, add: Any) -> Path:
    w = gguf.GGUFWriter(str(path), "llama")
    add(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _assert_same_tokenizer(ours: Any, ref: Any) -> None:
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, False), text
        assert ours.decode(ids) == ref.decode(ids), text
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, False), text
    assert (ours.bos_token_id, ours.eos_token_id) == (ref.bos_token_id, ref.eos_token_id)
    assert ours.all_special_ids == ref.all_special_ids


def test_sentencepiece_tokenizer_from_metadata(spm_model: bytes, tmp_path: Path) -> None:
    out = _tokenizer_gguf(tmp_path / "spm.gguf", lambda w: _add_spm_vocab(w, spm_model, 384))
    ours = load_tokenizer(out)
    ref = SentencePieceTokenizer(spm_model)
    _assert_same_tokenizer(ours, ref)
    assert ours.decode(ours.encode("Café 🦊 naïve")) == "Café 🦊 naïve"  # byte fallback
    assert ours.encode("a")[0] == 1 and ours.vocab_size == 384
    # tools that write a model directory (quantize, distill) export the file's tokenizer
    export = tmp_path / "export"
    export.mkdir()
    copy_tokenizer(out, export)
    _assert_same_tokenizer(load_tokenizer(export), ref)


def test_llama2_tokenizer_from_metadata(tmp_path: Path) -> None:
    model = SHARED / "models" / "llama2-tokenizer" / "tokenizer.model"
    if not model.exists():
        pytest.skip("../shared/models/llama2-tokenizer is not present")
    out = _tokenizer_gguf(
        tmp_path / "l2.gguf", lambda w: _add_spm_vocab(w, model.read_bytes(), 32000)
    )
    _assert_same_tokenizer(load_tokenizer(out), SentencePieceTokenizer(model))


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2"])
def test_bpe_tokenizer_from_metadata(pre: str, tmp_path: Path) -> None:
    tok_dir = _train_bpe(tmp_path / pre, pre)
    out = _tokenizer_gguf(tmp_path / f"{pre}.gguf", lambda w: _add_bpe_vocab(w, tok_dir, pre, 400))
    ours = load_tokenizer(out)
    ref = load_tokenizer(tok_dir)
    _assert_same_tokenizer(ours, ref)
    assert ours.encode("<think>x", add_special_tokens=False)[0] == ref.encode("<think>", False)[0]
    assert (ours.encode("a")[0] == ours.bos_token_id == 0) == (pre == "llama-bpe")
    messages = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(messages) == "<user>hi"
    export = tmp_path / "export"
    export.mkdir()
    copy_tokenizer(out, export)
    exported = load_tokenizer(export)
    _assert_same_tokenizer(exported, ref)
    assert exported.apply_chat_template(messages) == "<user>hi"


def test_unsupported_bpe_pre_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    tok_dir = _train_bpe(tmp_path / "t", "qwen2")
    out = _tokenizer_gguf(tmp_path / "t.gguf", lambda w: _add_bpe_vocab(w, tok_dir, "tekken", 400))
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'tekken' is not supported"):
        load_tokenizer(out)


# ----------------------------------------------------------------------------- errors


def _one_line(exc: pytest.ExceptionInfo[ModelLoadError]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def _header_field(data: bytes, name: str) -> tuple[int, int]:
    """(offset of the first dimension, offset of the ggml type) of tensor ``name``'s header."""
    at = data.index(name.encode()) + len(name)
    return at + 4, at + 4 + 8 * int.from_bytes(data[at : at + 4], "little")


@pytest.mark.parametrize("gguf_dequantize", [False, True])
def test_unsupported_tensor_type_names_tensor_and_type(
    gguf_dequantize: bool, llama_dir: Path, tmp_path: Path
) -> None:
    """A type with neither a kept-quantized layout nor a dequantizer (ggml's internal Q8_1, a
    type id unknown to the gguf package) is refused, naming the tensor and the type."""
    out = tmp_path / "q81.gguf"
    write_gguf(llama_dir, out, "Q4_K", zeros={"blk.1.ffn_up.weight": Q.Q8_1})
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(out), None, "auto", CPU, None, gguf_dequantize=gguf_dequantize)
    message = _one_line(exc)
    assert message.startswith(f"{out}: tensor 'blk.1.ffn_up.weight' has type Q8_1, which foudre")
    # a type id the gguf package does not know either (a newer llama.cpp's)
    data = bytearray(out.read_bytes())
    type_at = _header_field(bytes(data), "blk.1.ffn_up.weight")[1]
    assert int.from_bytes(data[type_at : type_at + 4], "little") == Q.Q8_1
    data[type_at : type_at + 4] = (250).to_bytes(4, "little")
    out.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError, match=r"'blk\.1\.ffn_up\.weight' has type 250 \(unknown\)"):
        load_model(str(out), None, "auto", CPU, None)


def test_rows_not_a_multiple_of_the_block_are_named(llama_dir: Path, tmp_path: Path) -> None:
    """A row length that is not a whole number of its type's blocks (no group divides it) is
    an invalid file: refused at read, naming the tensor."""
    out = tmp_path / "rows.gguf"
    write_gguf(llama_dir, out, "Q6_K")
    data = bytearray(out.read_bytes())
    dim_at = _header_field(bytes(data), "blk.0.ffn_down.weight")[0]
    assert int.from_bytes(data[dim_at : dim_at + 8], "little") == 512
    data[dim_at : dim_at + 8] = (500).to_bytes(8, "little")
    out.write_bytes(bytes(data))
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(out), None, "auto", CPU, None)
    assert "tensor 'blk.0.ffn_down.weight' has rows of 500 values, not a multiple of its " in (
        _one_line(exc)
    )


def test_types_without_a_kept_layout_load_dequantized(llama_dir: Path, tmp_path: Path) -> None:
    """IQ and the other types the gguf package decodes load dequantized: exactly its values."""
    out = tmp_path / "iq.gguf"
    types = {"blk.0.attn_v.weight": "IQ4_NL", "blk.1.ffn_down.weight": "Q3_K"}
    values = write_gguf(llama_dir, out, "Q8_0", types=types)
    model = load_model(str(out), None, "float32", CPU, None).model
    v = model.get_submodule("model.layers.0.self_attn.qkv_proj").weight.detach().numpy()
    np.testing.assert_array_equal(v[256 + 128 :], values["model.layers.0.self_attn.v_proj.weight"])
    down = model.get_submodule("model.layers.1.mlp.down_proj").weight.detach().numpy()
    np.testing.assert_array_equal(down, values["model.layers.1.mlp.down_proj.weight"])


def test_truncated_file_is_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "cut.gguf"
    write_gguf(make_hf_model(tmp_path / "tiny", "llama"), out, "Q8_0")
    data = out.read_bytes()
    (tmp_path / "cut1.gguf").write_bytes(data[:-100])  # inside the last tensor
    with pytest.raises(ModelLoadError, match=r"truncated GGUF file: tensor '.+' ends at byte") as e:
        load_model(str(tmp_path / "cut1.gguf"), None, "auto", CPU, None)
    _one_line(e)
    (tmp_path / "cut2.gguf").write_bytes(data[:200])  # inside the metadata
    with pytest.raises(ModelLoadError, match="corrupt or truncated GGUF header") as e:
        load_model(str(tmp_path / "cut2.gguf"), None, "auto", CPU, None)
    _one_line(e)
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + data[4:])
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(str(tmp_path / "bad.gguf"), None, "auto", CPU, None)


def test_unknown_architecture_is_a_clear_error(tmp_path: Path) -> None:
    out = tmp_path / "gemma.gguf"
    w = gguf.GGUFWriter(str(out), "gemma2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError) as exc:
        load_model(str(out), None, "auto", CPU, None)
    assert "unsupported GGUF architecture 'gemma2'; supported: llama, qwen2, qwen3" in _one_line(
        exc
    )
