"""GGUF files (llama.cpp's format): model config, weights and tokenizer, all from one file.

Layout (little-endian, versions 2 and 3)::

    "GGUF"  u32 version  u64 n_tensors  u64 n_kv
    n_kv x (string key, u32 value type, value)        metadata: config, tokenizer, chat template
    n_tensors x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml type, u64 offset)
    padding to general.alignment (32), then the tensor data; dims are innermost first

The header is parsed here (the ``gguf`` package's reader parses a 128k-token vocabulary element
by element, which takes seconds); tensor bytes are memory-mapped and dequantized with
``gguf.quants.dequantize``, so no block decoder is written by hand. ``load_model`` keeps the
Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K and Q8_0 linears quantized instead
(``foudre.loading.gguf_quant``).

Weights are renamed to the Hugging Face names ``LlamaForCausalLM.load_weights`` expects. For
``llama`` files the rows of ``attn_q`` and ``attn_k`` are permuted back: llama.cpp's converter
reorders them so that its RoPE can rotate adjacent pairs, where Hugging Face's rotates halves.

Mixtures of experts are read as llama.cpp writes them: ``llama`` (Mixtral), ``qwen2moe``,
``qwen3moe`` and ``olmoe``, with the router ``ffn_gate_inp``, the experts stacked in
``ffn_{gate,up,down}_exps`` (``[experts, rows, cols]``; the older one-tensor-per-expert
``ffn_gate.{e}`` too) and Qwen2-MoE's shared expert (``ffn_*_shexp``, its gate
``ffn_gate_inp_shexp``). A layer is sparse when it has a router. How the top-k weights are
normalised follows llama.cpp's graphs (renormalised for ``llama`` and ``qwen3moe``, not for
``qwen2moe`` and ``olmoe``) unless ``expert_weights_norm`` says otherwise; other gating
functions or a weight scale are refused, naming the key.

Gemma 3 (``gemma3``) is read as llama.cpp's converter writes it: its norms stored as
``1 + weight`` (the converter adds the one Gemma's norm adds at run time, so it is taken off
here), ``ffn_norm`` the MLP's input norm (``pre_feedforward_layernorm``) with the post-norms
``post_attention_norm`` and ``post_ffw_norm``, q/k unpermuted. What the converter leaves out, as
llama.cpp's graph assumes it: the sliding layers' RoPE base (10000, unless ``rope.freq_base_swa``
says), which layers slide (five in six, unless ``attention.sliding_window_pattern`` says), and
the score scale (``head_dim**-0.5``; ``(hidden / heads)**-0.5`` for the 62-layer 27B).

gpt-oss (``gpt-oss``): attention sinks (``attn_sinks``), the o_proj and router biases, YaRN
(not truncated, as its config says), even layers sliding; the experts as the converter splits
them (``ffn_gate_exps`` and ``ffn_up_exps`` with their biases) re-interleaved into
transformers' ``gate_up_proj``; MXFP4 experts (the converter keeps a MXFP4 checkpoint's) stay
packed (``quant.mxfp4.from_gguf``, ``ModelConfig.mxfp4_experts``). The clamped SwiGLU's
constants are llama.cpp's (alpha 1.702, limit 7): the file has no key for them.

DeepSeek-V3 (``deepseek2``): latent attention from ``kv_lora_rank``, ``q_lora_rank`` and the
heads' ``key_length_mla`` / ``value_length_mla``; ``kv_b_proj`` joined back from the
``attn_k_b`` / ``attn_v_b`` the converter splits it into (or read as ``attn_kv_b``); RoPE rows
left interleaved as in the checkpoint (``rope_interleave``); routing by sigmoid with the
selection bias ``exp_probs_b``, ``expert_group_count`` / ``expert_group_used_count`` groups,
``expert_weights_scale`` and the ``leading_dense_block_count`` dense layers (the routers say
which); YaRN's ``yarn_log_multiplier`` as ``0.1 * mscale_all_dim``.

State-space models: Mamba-2 (``mamba2``) and the hybrids llama.cpp's converter writes as
``granitehybrid`` (Granite 4.0's ``GraniteMoeHybridForCausalLM`` and ``BambaForCausalLM``, both
read as foudre's Granite 4.0 hybrid, whose multipliers default to none). The mixer's sizes come
from ``ssm.*``: ``time_step_rank`` is the number of heads (as llama.cpp uses it),
``inner_size`` their total width, ``group_count``, ``state_size``, ``conv_kernel``; the conv
and projection biases are there when the tensors are. A granitehybrid layer is a Mamba layer
where ``attention.head_count_kv`` (one count per layer) is 0. Its attention turns RoPE only
when ``rope.scaling.finetuned`` (llama.cpp's switch, which the converter sets for Bamba and not
for Granite 4.0), over ``rope.dimension_count`` of each head; q/k rows un-permuted as for
``llama``; Granite's ``embedding_scale``, ``residual_scale``, ``attention.scale`` and
``logit_scale``; a dense MLP (the shared one alone) or experts with a shared MLP. The
converter's layouts are undone (``_ssm_weight``): ``A = -exp(A_log)`` back to ``A_log``, ``A``
and ``D`` from ``[heads, 1]``, conv1d's filters from ``[channels, d_conv]``, the gated norm's
weight from ``[groups, inner / groups]``; every Mamba layer's tensors must have the shapes the
keys give (``_check_ssm_tensors`` names the first that does not).

Falcon-H1 (``falcon-h1``): attention and the same mixer in every layer, read with the mixer's
``ssm.*`` keys and Llama's attention keys (RoPE over whole heads, q/k rows not permuted). The
converter folds every muP multiplier into the weights (the embedding's into ``token_embd``,
which a tied head then carries too; the keys' into ``attn_k``; the per-section ``ssm_multipliers``
into ``ssm_in``'s rows), so the file's model has none; the mixer's output norm is there when
``ssm_norm`` is, after the gate (llama.cpp's graph; the file does not keep
``mamba_norm_before_gate``); its MLP norm is ``ffn_norm`` without ``.weight``.

Qwen3-Next (``qwen3next``): the gated DeltaNet's key heads from ``ssm.group_count``, value heads
from ``time_step_rank``, key width ``state_size``, value width ``inner_size / time_step_rank``,
its layers from ``attention.recurrent_layers`` (else ``full_attention_interval``); RoPE over
``rope.dimension_count`` of each head; experts with the gated shared expert
(``ffn_gate_inp_shexp``), the top-k renormalised (llama.cpp's graph). The converter's layouts
are undone: ``in_proj_qkvz`` joined back from ``attn_qkv`` (all q, all k, all v rows) and
``attn_gate`` (z) into transformers' per-key-head groups (``_qkvz``), ``A = -exp(A_log)``, the
squeezed conv1d, and the zero-centred norms stored as ``1 + w`` (all but the DeltaNet's gated
norm); the query and gate rows of ``attn_q`` stay as the checkpoint's. The
``nextn_predict_layers`` multi-token-prediction blocks the converter appends are not read.
Every DeltaNet layer's tensors must have the shapes the keys give (``_check_deltanet_tensors``).
Other recurrent architectures (``UNSUPPORTED_RECURRENT``: Mamba 1, Jamba, Nemotron-H, RWKV,
Qwen3.5...) are refused naming the architecture.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import re
import struct
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, quants
from gguf.quants import dequantize

from foudre.layers.rotary import rope_inv_freq
from foudre.loading.errors import ModelLoadError
from foudre.loading.memory import release_freed
from foudre.loading.tokenizer import HFTokenizer, SentencePieceTokenizer, Tokenizer
from foudre.models.config import ModelConfig
from foudre.quant import gguf_blocks
from foudre.quant.mxfp4 import from_gguf

_QT = GGMLQuantizationType
# The types foudre reads: the floats and every type the gguf package dequantizes (its ``quants``
# module has a class per type it decodes: the legacy and K-quants, IQ*, TQ*, MXFP4...), which
# ``gguf_quant`` keeps quantized or dequantizes at load. Not ggml's internal Q8_1 / Q8_K, nor
# integer tensors.
SUPPORTED_TENSOR_TYPES = tuple(
    t for t in _QT if t in (_QT.F32, _QT.F16) or isinstance(getattr(quants, t.name, None), type)
)

# general.architecture -> foudre architecture. Mistral and Mixtral models are written as "llama".
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
    "phi3": "phi3",
    "gemma3": "gemma3",
    "gpt-oss": "gpt_oss",
    "deepseek2": "deepseek_v3",
    "mamba2": "mamba2",
    "granitehybrid": "granitemoehybrid",
    "falcon-h1": "falcon_h1",
    "qwen3next": "qwen3_next",
}
# llama.cpp's graphs: whether each architecture renormalises its top-k expert weights
_NORM_TOPK = {
    "llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False, "gpt-oss": True,
    "deepseek2": False, "granitehybrid": True, "qwen3next": True,
}  # fmt: skip
_GATING_SOFTMAX, _GATING_SIGMOID = 1, 2  # llama_expert_gating_func_type (3: softmax of weights)

# bytes of float32 values a quantized tensor is decoded in at a time (whole rows)
CHUNK_BYTES = 8 << 20

_MAGIC = b"GGUF"
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALARS = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2",
    GGUFValueType.INT16: "<i2", GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4",
    GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?", GGUFValueType.UINT64: "<u8",
    GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}  # fmt: skip

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",  # phi3: q|k|v rows, as foudre fuses them
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# Gemma 3's layer norms, where its names differ from the Llama family's (ffn_norm: the MLP's input)
_GEMMA3_BLOCK_NAMES = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# gpt-oss's, where they differ from the Llama family's (its experts: _GPT_OSS_EXPERTS)
_GPT_OSS_BLOCK_NAMES = {
    "attn_sinks.weight": "self_attn.sinks",
    "attn_output.bias": "self_attn.o_proj.bias",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate_inp.bias": "mlp.gate.bias",
}
# gpt-oss's experts: down as transformers stores it, gate and up joined into transformers'
# interleaved gate_up (_joined); MXFP4 ones as the packed blocks and scales (_mxfp4)
_GPT_OSS_EXPERTS = {
    "ffn_gate_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_up_exps.weight": "mlp.experts.gate_up_proj",
    "ffn_gate_exps.bias": "mlp.experts.gate_up_proj_bias",
    "ffn_up_exps.bias": "mlp.experts.gate_up_proj_bias",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
# DeepSeek's latent attention and router; llama.cpp's newer converters split kv_b_proj into
# attn_k_b (W_UK per head, transposed) and attn_v_b (W_UV), joined again here (_joined)
_DEEPSEEK2_BLOCK_NAMES = {
    "attn_q_a.weight": "self_attn.q_a_proj.weight",
    "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attn_q_b.weight": "self_attn.q_b_proj.weight",
    "attn_q.weight": "self_attn.q_b_proj.weight",  # without q_lora_rank, foudre's q_b_proj
    "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
    "attn_k_b.weight": "self_attn.kv_b_proj.weight",
    "attn_v_b.weight": "self_attn.kv_b_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
# State-space models (mamba2, granitehybrid): a Mamba-2 mixer's tensors as foudre's
# ``Mamba2Mixer`` names its parameters, under the layer's ``mixer`` (mamba2) or ``mamba``
# (granitehybrid); the converter's layouts are undone in ``_ssm_weight``
_SSM_NAMES = {
    "ssm_in.weight": "in_proj.weight",
    "ssm_in.bias": "in_proj.bias",
    "ssm_conv1d.weight": "conv1d.weight",
    "ssm_conv1d.bias": "conv1d.bias",
    "ssm_dt.bias": "dt_bias",
    "ssm_a": "A_log",
    "ssm_d": "D",
    "ssm_norm.weight": "norm.weight",
    "ssm_out.weight": "out_proj.weight",
    "ssm_out.bias": "out_proj.bias",
}
_SSM_MIXER = {"mamba2": "mixer", "granitehybrid": "mamba", "falcon-h1": "mamba"}
# Falcon-H1's, where they differ from the Llama family's (the converter names the MLP's norm
# ``ffn_norm`` without ``.weight``)
_FALCON_H1_BLOCK_NAMES = {
    "ffn_norm": "pre_ff_layernorm.weight",
    "ffn_norm.weight": "pre_ff_layernorm.weight",
    "ffn_gate.weight": "feed_forward.gate_proj.weight",
    "ffn_up.weight": "feed_forward.up_proj.weight",
    "ffn_down.weight": "feed_forward.down_proj.weight",
}
# Qwen3-Next's gated DeltaNet (transformers' names under ``linear_attn``: in_proj_qkvz is joined
# back from the converter's attn_qkv and attn_gate, _qkvz) and its post-attention norm
_QWEN3NEXT_BLOCK_NAMES = {
    "attn_qkv.weight": "linear_attn.in_proj_qkvz.weight",
    "attn_gate.weight": "linear_attn.in_proj_qkvz.weight",
    "ssm_ba.weight": "linear_attn.in_proj_ba.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_a": "linear_attn.A_log",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
}
# the architectures whose recurrent tensors the converter re-laid (undone in _ssm_weight)
_SSM_LAYOUTS = (*_SSM_MIXER, "qwen3next")
# (1 + weight) RMSNorms the converter stores as 1 + weight (Gemma 3: every norm; Qwen3-Next: all
# but the DeltaNet's gated norm)
_OFFSET_NORMS = {
    "qwen3next": ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight",
                  "attn_k_norm.weight", "output_norm.weight"),
}  # fmt: skip
# GGUF architectures with recurrent layers (state-space, RWKV, linear attention) that foudre
# does not read: refused naming the architecture, whatever their tensors
UNSUPPORTED_RECURRENT = (
    "mamba", "jamba", "nemotron_h", "nemotron_h_moe", "plamo2", "lfm2", "lfm2moe", "rwkv6",
    "rwkv6qwen2", "rwkv7", "arwkv7", "qwen35", "qwen35moe", "kimi-linear",
)  # fmt: skip
# (architecture, leaf) of a tensor the converter wrote as two -> (the other's leaf, this part)
_PAIRS = {
    ("gpt-oss", "ffn_gate_exps.weight"): ("ffn_up_exps.weight", 0),
    ("gpt-oss", "ffn_up_exps.weight"): ("ffn_gate_exps.weight", 1),
    ("gpt-oss", "ffn_gate_exps.bias"): ("ffn_up_exps.bias", 0),
    ("gpt-oss", "ffn_up_exps.bias"): ("ffn_gate_exps.bias", 1),
    ("deepseek2", "attn_k_b.weight"): ("attn_v_b.weight", 0),
    ("deepseek2", "attn_v_b.weight"): ("attn_k_b.weight", 1),
    ("qwen3next", "attn_qkv.weight"): ("attn_gate.weight", 0),
    ("qwen3next", "attn_gate.weight"): ("attn_qkv.weight", 1),
}
# stacked experts [experts, rows, cols], and the older files' one tensor per expert
_EXPERT_NAMES = {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}
_STACKED = re.compile(r"^(ffn_gate|ffn_up|ffn_down)_exps\.weight$")
_PER_EXPERT = re.compile(r"^(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight$")
_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")
_ROPE_FREQS = "rope_freqs.weight"  # Llama 3 RoPE scaling, stored as per-frequency divisors
# Phi-3's LongRoPE factors (llama.cpp's converter writes rope_scaling's lists as tensors)
_ROPE_LONG, _ROPE_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"
_ROPE_TENSORS = (_ROPE_FREQS, _ROPE_LONG, _ROPE_SHORT)  # read into rope_scaling, not weights
# foudre architectures whose q/k rows llama.cpp's converter permuted for its RoPE (undone on load)
_PERMUTED_QK = ("llama", "mixtral", "granitemoehybrid")

# tokenizer.ggml.token_type values; sentencepiece's ModelProto.SentencePiece.Type uses the same.
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# tokenizer.ggml.pre -> (split regex, or the regexes split by in turn; ignore_merges, NFC) of the
# Hugging Face tokenizer it stands for (llama.cpp's llama-vocab.cpp lists the same regexes).
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# o200k (gpt-oss, GPT-4o): words with their case runs and contractions, digits by three
_CASED = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_UNCASED = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_O200K_REGEX = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED}*{_UNCASED}+{_CONTRACTIONS}|"
    rf"[^\r\n\p{{L}}\p{{N}}]?{_CASED}+{_UNCASED}*{_CONTRACTIONS}|"
    r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek-V3: digits by three, then runs of CJK, then words and punctuation
_DEEPSEEK3_REGEXES = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+|"
    r" ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_BPE_PRE_TOKENIZERS: dict[str, tuple[str | tuple[str, ...], bool, bool]] = {
    "llama-bpe": (_LLAMA3_REGEX, True, False),
    "qwen2": (_LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}"), False, True),
    "gpt-2": (_GPT2_REGEX, False, False),
    "gpt-4o": (_O200K_REGEX, False, False),
    "deepseek-v3": (_DEEPSEEK3_REGEXES, False, False),
}


@dataclass(slots=True, frozen=True)
class GGUFTensor:
    """Where one tensor's bytes are. ``shape`` is in PyTorch order (outermost first)."""

    name: str
    type: int  # ggml type id; may be one the gguf package does not know
    shape: tuple[int, ...]
    offset: int  # absolute, in bytes
    nbytes: int

    @property
    def type_name(self) -> str:
        try:
            return GGMLQuantizationType(self.type).name
        except ValueError:
            return f"{self.type} (unknown)"


@dataclass(slots=True)
class GGUFFile:
    """A parsed GGUF header over the memory-mapped file.

    ``metadata`` holds scalars as Python values (strings decoded as UTF-8), numeric arrays as
    lists and string arrays as lists of ``bytes`` (tokens are not always valid UTF-8).
    """

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]
    data: np.ndarray

    def release(self, tensor: GGUFTensor) -> None:
        """Drop the pages of ``tensor``'s bytes (and of its neighbours' on the same pages) from
        this process's resident memory once read: the map is read-only and shared, so they stay
        in the page cache and a later read maps them again; loading a file thus holds no more
        than one tensor's pages at a time besides what it builds."""
        mapping = getattr(self.data, "_mmap", None)
        if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        start = tensor.offset - tensor.offset % mmap.PAGESIZE
        end = min(tensor.offset + tensor.nbytes, len(mapping))
        if end > start:
            with contextlib.suppress(OSError, ValueError):
                mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


def is_gguf_file(path: str | Path) -> bool:
    """Whether ``path`` is a file named ``*.gguf`` or starting with the GGUF magic bytes."""
    path = Path(path)
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(4) == _MAGIC
    except OSError:
        return False


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def u32(self) -> int:
        value: int = _U32.unpack_from(self.buf, self.pos)[0]
        self.pos += 4
        return value

    def u64(self) -> int:
        value: int = _U64.unpack_from(self.buf, self.pos)[0]
        self.pos += 8
        return value

    def raw(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.buf):
            raise struct.error(f"{n} bytes at offset {self.pos} run past the end of the file")
        out = bytes(self.buf[self.pos : end])
        self.pos = end
        return out

    def string(self) -> bytes:
        return self.raw(self.u64())

    def value(self, vtype: int) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string().decode("utf-8", errors="replace")
        if vtype == GGUFValueType.ARRAY:
            itype, n = self.u32(), self.u64()
            if itype == GGUFValueType.STRING:
                return [self.string() for _ in range(n)]
            if itype == GGUFValueType.ARRAY:
                return [self.value(itype) for _ in range(n)]
            dtype = np.dtype(_scalar_dtype(itype))
            data = self.raw(n * dtype.itemsize)
            return np.frombuffer(data, dtype=dtype).tolist()
        dtype = np.dtype(_scalar_dtype(vtype))
        return np.frombuffer(self.raw(dtype.itemsize), dtype=dtype)[0].item()


def _scalar_dtype(vtype: int) -> str:
    try:
        return _SCALARS[GGUFValueType(vtype)]
    except (ValueError, KeyError):
        raise ValueError(f"unknown metadata value type {vtype}") from None


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse the header of the GGUF file at ``path``; tensor data stays memory-mapped.

    Raises ``ModelLoadError`` naming the file when it is missing, not GGUF, of an unsupported
    version or byte order, split in parts, corrupt, or truncated (any tensor's bytes past the
    end of the file).
    """
    path = Path(path)
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise ModelLoadError(f"{path}: cannot read: {exc}", path) from exc
    if size < 24:
        raise ModelLoadError(f"{path}: truncated GGUF file ({size} bytes)", path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(data.data)
    try:
        if cur.raw(4) != _MAGIC:
            raise ModelLoadError(f"{path}: not a GGUF file (bad magic bytes)", path)
        version = cur.u32()
        if version & 0xFFFF == 0:
            raise ModelLoadError(f"{path}: big-endian GGUF files are not supported", path)
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: unsupported GGUF version {version} (2 and 3 are)", path)
        n_tensors, n_kv = cur.u64(), cur.u64()
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string().decode("utf-8", errors="replace")
            metadata[key] = cur.value(cur.u32())
        infos: list[tuple[str, tuple[int, ...], int, int]] = []
        for _ in range(n_tensors):
            name = cur.string().decode("utf-8", errors="replace")
            n_dims = cur.u32()
            if n_dims > 4:
                raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
            dims = tuple(cur.u64() for _ in range(n_dims))
            infos.append((name, dims, cur.u32(), cur.u64()))
    except (struct.error, ValueError, OverflowError) as exc:
        raise ModelLoadError(
            f"{path}: corrupt or truncated GGUF header at byte {cur.pos}: {exc}", path
        ) from exc
    if int(metadata.get("split.count", 1)) > 1:
        raise ModelLoadError(
            f"{path}: split GGUF files are not supported; merge the parts first "
            "(llama-gguf-split --merge)",
            path,
        )
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0 or alignment & (alignment - 1):
        raise ModelLoadError(f"{path}: invalid general.alignment {alignment!r}", path)
    start = -(-cur.pos // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    for name, dims, ggml_type, offset in infos:
        if name in tensors:
            raise ModelLoadError(f"{path}: tensor {name!r} appears twice", path)
        shape = tuple(reversed(dims))
        nbytes = 0
        if ggml_type in GGML_QUANT_SIZES:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            if dims and dims[0] % block:
                raise ModelLoadError(
                    f"{path}: tensor {name!r} has rows of {dims[0]} values, not a multiple of "
                    f"its type's block of {block}",
                    path,
                )
            nbytes = math.prod(dims) // block * type_size
        tensor = GGUFTensor(name, ggml_type, shape, start + offset, nbytes)
        if tensor.offset + nbytes > size:
            raise ModelLoadError(
                f"{path}: truncated GGUF file: tensor {name!r} ends at byte "
                f"{tensor.offset + nbytes}, the file has {size} bytes",
                path,
            )
        tensors[name] = tensor
    return GGUFFile(path, metadata, tensors, data)


# ----------------------------------------------------------------------------- weights


def _check_type(f: GGUFFile, tensor: GGUFTensor) -> None:
    if tensor.type not in SUPPORTED_TENSOR_TYPES:
        names = ", ".join(t.name for t in SUPPORTED_TENSOR_TYPES)
        raise ModelLoadError(
            f"{f.path}: tensor {tensor.name!r} has type {tensor.type_name}, which foudre cannot "
            f"load (supported: {names})",
            f.path,
        )


def dequantize_tensor(
    f: GGUFFile, tensor: GGUFTensor, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The values of ``tensor`` (float32, or the file's own float16 / bfloat16), in a new tensor;
    quantized tensors in ``dtype`` when given (the float32 values rounded to it, as a copy into
    a tensor of that dtype rounds them).

    Quantized tensors are decoded a few megabytes of rows at a time from the file's map (each
    row's values are its own blocks'), so no float32 copy of a whole tensor is ever held; the
    pages read are then dropped from this process (``GGUFFile.release``). Raises
    ``ModelLoadError`` naming the tensor and its type for a type not in
    ``SUPPORTED_TENSOR_TYPES``.
    """
    _check_type(f, tensor)
    raw = f.data[tensor.offset : tensor.offset + tensor.nbytes]
    qtype = GGMLQuantizationType(tensor.type)
    try:
        if qtype == _QT.F32:
            return torch.from_numpy(np.array(raw.view(np.float32).reshape(tensor.shape)))
        if qtype == _QT.F16:
            return torch.from_numpy(np.array(raw.view(np.float16).reshape(tensor.shape)))
        if qtype == _QT.BF16:
            bits = np.array(raw.view(np.int16).reshape(tensor.shape))
            return torch.from_numpy(bits).view(torch.bfloat16)
        rows = math.prod(tensor.shape[:-1])
        out = torch.empty(rows, tensor.shape[-1], dtype=dtype or torch.float32)
        if gguf_blocks.dequantize(tensor.type, f.data.ctypes.data + tensor.offset, out):
            return out.reshape(tensor.shape)  # (Q4_0, Q5_0, Q8_0: natively, the same values)
        blocks = np.asarray(raw).reshape(rows, -1)
        step = max(1, CHUNK_BYTES // max(1, 4 * tensor.shape[-1]))
        for r in range(0, rows, step):
            part = dequantize(blocks[r : r + step], qtype)
            out[r : r + step].copy_(torch.from_numpy(np.ascontiguousarray(part, np.float32)))
        return out.reshape(tensor.shape)
    finally:
        f.release(tensor)
        release_freed()


def _hf_name(name: str, arch: str | None = None) -> str | None:
    """The Hugging Face name of a GGUF tensor of a file of architecture ``arch`` (GGUF's name);
    for stacked experts, with ``{}`` where the expert's index goes."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.match(name)
    if m is None:
        return None
    layer, leaf = m.group(1), m.group(2)
    if arch == "phi3" and leaf == "ffn_up.weight":  # gate|up rows, as foudre fuses them
        return f"model.layers.{layer}.mlp.gate_up_proj.weight"
    if arch == "gemma3" and leaf in _GEMMA3_BLOCK_NAMES:
        return f"model.layers.{layer}.{_GEMMA3_BLOCK_NAMES[leaf]}"
    if arch in _SSM_MIXER and leaf in _SSM_NAMES:
        return f"model.layers.{layer}.{_SSM_MIXER[arch]}.{_SSM_NAMES[leaf]}"
    if arch == "mamba2":  # a norm and a mixer a layer, nothing else
        return f"model.layers.{layer}.norm.weight" if leaf == "attn_norm.weight" else None
    family = {
        "gpt-oss": {**_GPT_OSS_BLOCK_NAMES, **_GPT_OSS_EXPERTS},
        "falcon-h1": _FALCON_H1_BLOCK_NAMES,
        "qwen3next": _QWEN3NEXT_BLOCK_NAMES,
    }.get(arch or "")
    family = _DEEPSEEK2_BLOCK_NAMES if arch == "deepseek2" else family
    if family is not None and leaf in family:
        return f"model.layers.{layer}.{family[leaf]}"
    if leaf in _BLOCK_NAMES:
        return f"model.layers.{layer}.{_BLOCK_NAMES[leaf]}"
    stacked, single = _STACKED.match(leaf), _PER_EXPERT.match(leaf)
    if stacked is not None:
        return f"model.layers.{layer}.mlp.experts.{{}}.{_EXPERT_NAMES[stacked.group(1)]}.weight"
    if single is not None:
        part = _EXPERT_NAMES[single.group(1)]
        return f"model.layers.{layer}.mlp.experts.{single.group(2)}.{part}.weight"
    return None


def _mxfp4(f: GGUFFile, tensor: GGUFTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A gpt-oss expert tensor of type MXFP4 as ``MXFP4Experts``' blocks and scales."""
    if tensor.type != _QT.MXFP4:
        raise ModelLoadError(
            f"{f.path}: tensor {tensor.name!r} is {tensor.type_name}; the file's other experts "
            "are MXFP4, which gpt-oss's must all be or none",
            f.path,
        )
    try:
        return from_gguf(f.data[tensor.offset : tensor.offset + tensor.nbytes], tensor.shape)
    finally:
        f.release(tensor)


def _joined(hf: str, first: Any, second: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensor ``hf`` from the two the converter wrote (``_PAIRS``): gpt-oss's gate and up
    (``[E, I, hidden]``, biases ``[E, I]``) as transformers' interleaved ``gate_up_proj``
    ``[E, hidden, 2I]`` (MXFP4: blocks and scales ``[E, 2I, ...]``, rows interleaved; biases
    ``[E, 2I]``); DeepSeek's W_UK ``[heads, rank, nope]`` and W_UV ``[heads, v, rank]`` as
    ``kv_b_proj`` ``[heads * (nope + v), rank]``."""
    if hf.endswith("kv_b_proj.weight"):
        kv = torch.cat([first.transpose(1, 2), second], dim=1)
        yield hf, kv.reshape(-1, kv.shape[-1]).contiguous()
        return
    if isinstance(first, tuple):  # MXFP4 (blocks, scales): gate row j at 2j, up row j at 2j + 1
        for suffix, gate, up in zip(("_blocks", "_scales"), first, second, strict=True):
            joined = torch.stack([gate, up], dim=2)
            yield hf + suffix, joined.reshape(gate.shape[0], -1, *gate.shape[2:])
        return
    joined = torch.stack([first, second], dim=2).reshape(first.shape[0], -1, *first.shape[2:])
    yield hf, joined.transpose(1, 2) if joined.dim() == 3 else joined


def _ssm_weight(f: GGUFFile, tensor: GGUFTensor, leaf: str, w: torch.Tensor) -> torch.Tensor:
    """A Mamba-2 mixer's tensor back in ``Mamba2Mixer``'s layout: the converter squeezed
    conv1d's ``[channels, 1, d_conv]`` to ``[channels, d_conv]``, stored ``A_log`` as ``A =
    -exp(A_log)`` and ``A``, ``D`` as ``[heads, 1]``, and the gated norm's weight as
    ``[groups, inner / groups]``. An ``A`` that is not negative (no ``A_log`` gives it) is
    refused, naming the tensor."""
    if leaf == "ssm_conv1d.weight":
        return w.unsqueeze(1)
    if leaf == "ssm_a":
        a = w.float().reshape(-1)
        if not bool((a < 0).all()):
            raise ModelLoadError(
                f"{f.path}: tensor {tensor.name!r} holds A = -exp(A_log), which must be "
                "negative; it is not",
                f.path,
            )
        return torch.log(-a)
    if leaf in ("ssm_d", "ssm_norm.weight"):
        return w.reshape(-1)
    return w


def _qkvz(config: ModelConfig, qkv: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Qwen3-Next's ``in_proj_qkvz`` (per key head: its q, k, then its value heads' v and z
    rows) from the converter's ``attn_qkv`` (all q rows, all k rows, all v rows) and
    ``attn_gate`` (all z rows), the inverse of its re-ordering."""
    heads, dk = config.linear_num_key_heads, config.linear_key_head_dim
    rv = config.linear_num_value_heads // heads * config.linear_value_head_dim
    q, k, v = qkv.split([heads * dk, heads * dk, heads * rv])
    parts = [q.reshape(heads, dk, -1), k.reshape(heads, dk, -1), v.reshape(heads, rv, -1)]
    joined = torch.cat([*parts, z.reshape(heads, rv, -1)], dim=1)
    return joined.reshape(-1, qkv.shape[-1])


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of q/k rows (pairs (2i, 2i+1) back to halves (i, i+d/2)).

    The converter computes ``w.reshape(n_heads, 2, d/2, ...).swapaxes(1, 2)``; this is its
    inverse. Works for weights ``[n_heads*d, in]`` and biases ``[n_heads*d]``.
    """
    head_dim = w.shape[0] // n_heads
    return (
        w.reshape(n_heads, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
    ).contiguous()


def iter_gguf_weights(
    f: GGUFFile,
    config: ModelConfig,
    skip: Collection[str] = frozenset(),
    dtype: torch.dtype | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(Hugging Face name, tensor)`` for every weight of ``f`` but those named in
    ``skip`` (GGUF names: what ``gguf_quant`` keeps quantized), one tensor at a time.

    Quantized tensors come dequantized to float32 (to ``dtype`` when given: what copying the
    float32 values into a tensor of that dtype gives, without the float32 copy of the whole
    tensor); q/k of ``llama`` files come un-permuted; tensors the converter wrote in two
    (gpt-oss's gate and up experts, DeepSeek's ``attn_k_b`` and ``attn_v_b``) joined once both
    are read; gpt-oss's MXFP4 experts as their packed blocks and scales, never dequantized.
    ``rope_freqs.weight`` is not yielded (``load_gguf`` turned it into ``rope_scaling``).
    """
    arch = str(f.metadata.get("general.architecture"))
    mtp = _first_mtp_block(f, arch)
    halves: dict[str, dict[int, Any]] = {}  # a pair's first part read, by its joined name
    for tensor in f.tensors.values():
        block = _BLOCK.match(tensor.name)
        if tensor.name in _ROPE_TENSORS or tensor.name in skip:
            continue
        if block is not None and int(block.group(1)) >= mtp:
            continue  # a multi-token-prediction block (nextn_predict_layers): not run here
        hf = _hf_name(tensor.name, arch)
        if hf is None:
            raise ModelLoadError(
                f"{f.path}: tensor {tensor.name!r} has no counterpart in foudre's "
                f"{config.architecture} model",
                f.path,
            )
        leaf = tensor.name if block is None else block.group(2)
        if (arch == "gemma3" and hf.endswith("norm.weight")) or leaf in _OFFSET_NORMS.get(arch, ()):
            w = (dequantize_tensor(f, tensor).float() - 1.0).to(dtype or torch.float32)
            yield hf, w  # stored as 1 + weight
            continue
        if config.mxfp4_experts and hf.endswith(("experts.gate_up_proj", "experts.down_proj")):
            part: Any = _mxfp4(f, tensor)
        else:
            part = dequantize_tensor(f, tensor, dtype)
        if (arch, leaf) in _PAIRS:
            parts = halves.setdefault(hf, {})
            parts[_PAIRS[arch, leaf][1]] = part
            if 0 in parts and 1 in parts:
                del halves[hf]
                if arch == "qwen3next":
                    yield hf, _qkvz(config, parts[0], parts[1])
                else:
                    yield from _joined(hf, parts[0], parts[1])
            else:
                parts[2] = (tensor.name, _PAIRS[arch, leaf][0])
            continue
        if isinstance(part, tuple):  # packed MXFP4 down_proj
            yield f"{hf}_blocks", part[0]
            yield f"{hf}_scales", part[1]
            continue
        w = part
        if arch in _SSM_LAYOUTS and leaf in _SSM_NAMES:
            w = _ssm_weight(f, tensor, leaf, w)
        if arch == "gpt-oss" and hf.endswith("experts.down_proj"):
            w = w.transpose(1, 2)  # transformers' [E, I, hidden]
        if "{}" in hf:  # stacked experts: one tensor per expert, as Hugging Face names them
            for e, expert in enumerate(w):
                yield hf.format(e), expert
            continue
        if hf.endswith("shared_expert_gate.weight") and w.dim() == 1:
            w = w[None]  # llama.cpp stores this [1, hidden] matrix as a vector
        if config.architecture in _PERMUTED_QK:
            if hf.endswith(("q_proj.weight", "q_proj.bias")):
                w = _unpermute_rope(w, config.num_attention_heads)
            elif hf.endswith(("k_proj.weight", "k_proj.bias")):
                w = _unpermute_rope(w, config.num_key_value_heads)
        yield hf, w
    for parts in halves.values():
        name, other = parts[2]
        raise ModelLoadError(f"{f.path}: tensor {name!r} without its pair {other!r}", f.path)


# ----------------------------------------------------------------------------- config


def _meta_int(f: GGUFFile, key: str, default: int | None = None) -> int:
    value = f.metadata.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelLoadError(
            f"{f.path}: metadata {key} must be a non-negative int, got {value!r}", f.path
        )
    return value


def _meta_float(f: GGUFFile, key: str, default: float | None = None) -> float:
    value = f.metadata.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise ModelLoadError(
            f"{f.path}: metadata {key} must be a positive number, got {value!r}", f.path
        )
    return float(value)


def _llama3_rope_scaling(
    factors: np.ndarray, head_dim: int, theta: float, path: Path
) -> dict[str, Any] | None:
    """Recover Llama 3 ``rope_scaling`` from llama.cpp's per-frequency divisors.

    The converter stores ``inv_freq / scaled_inv_freq`` instead of the four parameters. Only
    two combinations of them matter (the smooth ramp is linear in frequency), so the ramp is
    fitted with ``low_freq_factor = 1`` and the result is checked against the divisors.
    """
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    f = factors.astype(np.float64).reshape(-1)
    if f.shape != inv.shape or not np.all(np.isfinite(f)) or f.min() <= 0:
        raise ModelLoadError(
            f"{path}: {_ROPE_FREQS} has {f.size} values, expected {inv.size} positive ones", path
        )
    if np.allclose(f, 1.0):
        return None
    factor = float(f.max())
    low, high, old = 1.0, 4.0, 8192.0  # Llama 3.1's values
    ramp = (f > 1 + 1e-4) & (f < factor * (1 - 1e-4))
    if ramp.sum() >= 2:
        smooth = (1 / f[ramp] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(inv[ramp], smooth, 1)
        if slope > 0 and intercept < 0:
            high = low - 1 / intercept
            old = -2 * math.pi * slope / intercept
            old = float(round(old)) if abs(old - round(old)) < 1e-3 * old else old
            high = float(round(high, 4)) if abs(high - round(high, 4)) < 1e-6 * high else high
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": float(high),
        "original_max_position_embeddings": int(old) if float(old).is_integer() else old,
    }
    got = rope_inv_freq(head_dim, theta, scaling).double().numpy()
    if not np.allclose(got, inv / f, rtol=1e-4, atol=0):
        raise ModelLoadError(
            f"{path}: {_ROPE_FREQS} does not follow Llama 3 RoPE scaling; unsupported", path
        )
    return scaling


def _longrope_scaling(f: GGUFFile, arch: str, rope_dim: int) -> dict[str, Any]:
    """Phi-3's LongRoPE ``rope_scaling`` from the factors llama.cpp's converter stores as
    tensors, its original context and its attention factor."""
    factors = {}
    for key, name in (("long_factor", _ROPE_LONG), ("short_factor", _ROPE_SHORT)):
        tensor = f.tensors.get(name)
        if tensor is None:
            raise ModelLoadError(f"{f.path}: {name} without its pair {_ROPE_LONG}", f.path)
        values = dequantize_tensor(f, tensor).float().reshape(-1)
        if values.numel() != rope_dim // 2 or not bool((values > 0).all()):
            raise ModelLoadError(
                f"{f.path}: {name} must hold {rope_dim // 2} positive factors, got "
                f"{values.numel()}",
                f.path,
            )
        factors[key] = values.tolist()
    context = _meta_int(f, f"{arch}.context_length", 2048)
    original = _meta_int(f, f"{arch}.rope.scaling.original_context_length", context)
    scaling: dict[str, Any] = {
        "rope_type": "longrope",
        **factors,
        "original_max_position_embeddings": original,
        "factor": context / original,
    }
    if f"{arch}.rope.scaling.attn_factor" in f.metadata:
        scaling["attention_factor"] = _meta_float(f, f"{arch}.rope.scaling.attn_factor")
    return scaling


def _yarn_scaling(f: GGUFFile, arch: str) -> dict[str, Any]:
    """YaRN ``rope_scaling`` from the ``rope.scaling.*`` keys. gpt-oss's ramp is not truncated
    (its config's ``truncate: false``); deepseek2's ``yarn_log_multiplier`` is ``0.1 *
    mscale_all_dim`` (and its ``mscale`` the same, as in the released models)."""
    key = f"{arch}.rope.scaling"
    scaling: dict[str, Any] = {
        "rope_type": "yarn",
        "factor": _meta_float(f, f"{key}.factor"),
        "original_max_position_embeddings": _meta_int(f, f"{key}.original_context_length"),
    }
    for name, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                     ("attn_factor", "attention_factor")):  # fmt: skip
        if f"{key}.{name}" in f.metadata:
            scaling[hf] = _meta_float(f, f"{key}.{name}")
    ext = f.metadata.get(f"{key}.yarn_ext_factor", 1.0)
    if ext != 1.0:
        raise ModelLoadError(f"{f.path}: {key}.yarn_ext_factor={ext!r} is not supported", f.path)
    if f"{key}.yarn_log_multiplier" in f.metadata:
        if arch != "deepseek2":
            raise ModelLoadError(
                f"{f.path}: {key}.yarn_log_multiplier is supported in deepseek2 files only",
                f.path,
            )
        mscale = _meta_float(f, f"{key}.yarn_log_multiplier") / 0.1
        scaling["mscale"] = scaling["mscale_all_dim"] = mscale
    if arch == "gpt-oss":
        scaling["truncate"] = False
    return scaling


def _rope_scaling(
    f: GGUFFile, arch: str, head_dim: int, theta: float, rope_dim: int
) -> dict[str, Any] | None:
    if _ROPE_LONG in f.tensors or _ROPE_SHORT in f.tensors:
        if arch != "phi3":
            raise ModelLoadError(f"{f.path}: LongRoPE factors in a {arch} file", f.path)
        return _longrope_scaling(f, arch, rope_dim)
    kind = f.metadata.get(f"{arch}.rope.scaling.type", "none")
    if _ROPE_FREQS in f.tensors:
        if kind not in ("none", "linear") or f.metadata.get(f"{arch}.rope.scaling.factor", 1) != 1:
            raise ModelLoadError(
                f"{f.path}: {_ROPE_FREQS} together with rope scaling {kind!r} is not supported",
                f.path,
            )
        factors = dequantize_tensor(f, f.tensors[_ROPE_FREQS]).float().numpy()
        return _llama3_rope_scaling(factors, head_dim, theta, f.path)
    if kind == "none":
        return None
    if kind == "linear":
        factor = _meta_float(f, f"{arch}.rope.scaling.factor")
        return None if factor == 1 else {"rope_type": "linear", "factor": factor}
    if kind == "yarn":
        return _yarn_scaling(f, arch)
    raise ModelLoadError(
        f"{f.path}: unsupported rope scaling type {kind!r} (supported: none, linear, llama3, yarn)",
        f.path,
    )


def _default_dtype(f: GGUFFile) -> str:
    """float32 / float16 for unquantized files, else bfloat16 (HF's usual dtype)."""
    types = {t.type for t in f.tensors.values() if len(t.shape) >= 2}
    if types <= {_QT.F32}:
        return "float32"
    if types <= {_QT.F32, _QT.F16}:
        return "float16"
    return "bfloat16"


def _first_mtp_block(f: GGUFFile, arch: str) -> int:
    """The first of the multi-token-prediction blocks the converter appends to a qwen3next
    file's (``nextn_predict_layers`` of its ``block_count``), which foudre does not run; past
    the last block where there are none."""
    blocks = f.metadata.get(f"{arch}.block_count")
    if arch != "qwen3next" or not isinstance(blocks, int):
        return 1 << 62
    return blocks - _meta_int(f, f"{arch}.nextn_predict_layers", 0)


def _check_tensors(f: GGUFFile) -> tuple[str, GGUFTensor]:
    """``(architecture, token embedding)`` of ``f``, once its architecture is one foudre has
    and each of its tensors has a type foudre dequantizes and a place in the model."""
    path = f.path
    arch = f.metadata.get("general.architecture")
    if arch in UNSUPPORTED_RECURRENT:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} (recurrent layers) is not supported; the "
            "recurrent architectures foudre reads from GGUF are mamba2, granitehybrid, "
            "falcon-h1 and qwen3next",
            path,
        )
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r}; "
            f"supported: {', '.join(ARCHITECTURES)}",
            path,
        )
    mtp = _first_mtp_block(f, arch)
    for tensor in f.tensors.values():
        _check_type(f, tensor)
        block = _BLOCK.match(tensor.name)
        if block is not None and int(block.group(1)) >= mtp:
            continue
        if tensor.name not in _ROPE_TENSORS and _hf_name(tensor.name, arch) is None:
            raise ModelLoadError(
                f"{path}: tensor {tensor.name!r} has no counterpart in foudre's {arch} model",
                path,
            )
    embed = f.tensors.get("token_embd.weight")
    if embed is None or len(embed.shape) != 2:
        raise ModelLoadError(f"{path}: no 2-D token_embd.weight tensor", path)
    return arch, embed


def _attention_heads(f: GGUFFile, arch: str, hidden: int) -> tuple[int, int, int, int]:
    """``(heads, KV heads, head_dim, rotated dims)``; keys, values and RoPE share head_dim but
    in phi3 files, whose RoPE may turn fewer (partial rotary)."""
    path = f.path
    heads = _meta_int(f, f"{arch}.attention.head_count")
    kv_heads = _meta_int(f, f"{arch}.attention.head_count_kv", heads)
    if heads == 0 or kv_heads == 0:
        raise ModelLoadError(f"{path}: attention head counts must be positive", path)
    if arch == "deepseek2":  # key/value lengths are the latent's (_gguf_mla); keys per head
        rope_dim = _meta_int(f, f"{arch}.rope.dimension_count")
        return heads, heads, rope_dim, rope_dim
    head_dim = _meta_int(f, f"{arch}.attention.key_length", hidden // heads)
    value_dim = _meta_int(f, f"{arch}.attention.value_length", head_dim)
    rope_dim = _meta_int(f, f"{arch}.rope.dimension_count", head_dim)
    partial = arch in ("phi3", "qwen3next") and 0 < rope_dim < head_dim
    if value_dim != head_dim or (rope_dim != head_dim and not partial):
        raise ModelLoadError(
            f"{path}: key_length={head_dim}, value_length={value_dim} and "
            f"rope.dimension_count={rope_dim} must be equal (no partial RoPE)",
            path,
        )
    return heads, kv_heads, head_dim, rope_dim


def _partial_rotary(f: GGUFFile, head_dim: int, rope_dim: int) -> float:
    """The ``partial_rotary_factor`` whose rotated width is ``rope_dim``."""
    factor = rope_dim / head_dim
    if int(head_dim * factor) != rope_dim:
        raise ModelLoadError(
            f"{f.path}: rope.dimension_count={rope_dim} of head_dim={head_dim} is no "
            "partial_rotary_factor",
            f.path,
        )
    return factor


def _window(f: GGUFFile, arch: str) -> int | None:
    """A phi3 file's sliding window over every layer (0 or absent: none, as Phi-4's)."""
    if arch != "phi3":
        return None
    return _meta_int(f, f"{arch}.attention.sliding_window", 0) or None


def _architecture_name(f: GGUFFile, arch: str, moe: dict[str, Any]) -> str:
    """foudre's architecture for GGUF's ``arch``: a Llama with experts is a Mixtral."""
    if arch == "llama" and moe:
        return "mixtral"
    if arch in ("qwen2moe", "qwen3moe", "olmoe") and not moe:
        raise ModelLoadError(f"{f.path}: a {arch} file without expert_count and routers", f.path)
    return ARCHITECTURES[arch]


def _eos_ids(f: GGUFFile, vocab: int) -> list[int]:
    """The EOS, EOT and EOM token ids the file names (in the vocabulary), without duplicates."""
    eos: list[int] = []
    for key in ("eos", "eot", "eom"):
        token = f.metadata.get(f"tokenizer.ggml.{key}_token_id")
        if isinstance(token, int) and 0 <= token < vocab and token not in eos:
            eos.append(token)
    return eos


def gguf_config(f: GGUFFile) -> ModelConfig:
    """The ``ModelConfig`` described by the metadata (and tensor list) of ``f``.

    Raises ``ModelLoadError`` naming the file for an unsupported architecture or feature
    (partial RoPE, RoPE scaling other than linear / Llama 3, a mixture-of-experts routing other
    than softmax then top-k), a missing or invalid key, a missing expert tensor, and for any
    tensor of a type foudre cannot dequantize or with no place in the model, so that nothing is
    built for a file that cannot load.
    """
    path = f.path
    arch, embed = _check_tensors(f)
    if arch in _SSM_MIXER:
        return _ssm_config(f, arch, embed)
    hidden = _meta_int(f, f"{arch}.embedding_length")
    heads, kv_heads, head_dim, rope_dim = _attention_heads(f, arch, hidden)
    theta = _meta_float(f, f"{arch}.rope.freq_base", 10000.0)
    n_layers = min(_meta_int(f, f"{arch}.block_count"), _first_mtp_block(f, arch))
    moe = _gguf_moe(f, arch, n_layers)
    arch_name = _architecture_name(f, arch, moe)
    clip = f.metadata.get(f"{arch}.attention.clamp_kqv")
    vocab = embed.shape[0]
    eos = _eos_ids(f, vocab)
    bos = f.metadata.get("tokenizer.ggml.bos_token_id")
    gemma3 = _gguf_gemma3(f, arch, n_layers, hidden // heads, head_dim)
    gemma3 |= _gguf_mla(f, arch) | _gguf_gpt_oss(f, arch, n_layers)
    gemma3 |= _qwen3next_fields(f, arch, hidden, n_layers)
    window = gemma3.pop("sliding_window", None) or _window(f, arch)  # (gemma3's, gpt-oss's...)
    try:
        return ModelConfig(
            architecture=arch_name,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_meta_int(
                f, f"{arch}.feed_forward_length", moe.get("moe_intermediate_size")
            ),
            num_hidden_layers=n_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            max_position_embeddings=_meta_int(f, f"{arch}.context_length", 2048),
            rms_norm_eps=_meta_float(f, f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_theta=theta,
            rope_scaling=_rope_scaling(f, arch, head_dim, theta, rope_dim),
            tie_word_embeddings="output.weight" not in f.tensors,
            attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in f.tensors,
            qk_norm=arch in ("qwen3", "qwen3moe", "olmoe"),
            qk_norm_over_heads=arch == "olmoe",
            clip_qkv=float(clip) if isinstance(clip, int | float) and clip > 0 else None,
            torch_dtype=_default_dtype(f),
            bos_token_id=bos if isinstance(bos, int) and 0 <= bos < vocab else None,
            eos_token_ids=eos,
            partial_rotary_factor=_partial_rotary(f, head_dim, rope_dim),
            sliding_window=window,
            **moe,
            **gemma3,
        )
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}", path) from exc


def _gguf_gemma3(
    f: GGUFFile, arch: str, n_layers: int, hidden_per_head: int, head_dim: int
) -> dict[str, Any]:
    """The ``ModelConfig`` Gemma 3 fields of a ``gemma3`` file (``{}`` for others), with
    llama.cpp's values for what its converter does not write (the module's docstring)."""
    if arch != "gemma3":
        return {}
    fields: dict[str, Any] = dict(
        rope_local_theta=_meta_float(f, f"{arch}.rope.freq_base_swa", 10000.0),
        query_pre_attn_scalar=float(hidden_per_head if n_layers == 62 else head_dim),
    )
    cap = f.metadata.get(f"{arch}.final_logit_softcapping")
    if cap is not None:
        fields["final_logit_softcapping"] = _meta_float(f, f"{arch}.final_logit_softcapping")
    if f.metadata.get(f"{arch}.attn_logit_softcapping") is not None:
        raise ModelLoadError(
            f"{f.path}: gemma3 with {arch}.attn_logit_softcapping is not supported (the "
            "attention backends do not soft-cap scores)",
            f.path,
        )
    window = f.metadata.get(f"{arch}.attention.sliding_window")
    if window is None:
        return fields
    window = _meta_int(f, f"{arch}.attention.sliding_window")
    pattern = f.metadata.get(f"{arch}.attention.sliding_window_pattern", 6)
    if isinstance(pattern, list | np.ndarray) and len(pattern) == n_layers:
        slides = [bool(x) for x in pattern]  # per layer: whether it slides
    elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        slides = [(i + 1) % pattern != 0 for i in range(n_layers)]
    else:
        raise ModelLoadError(
            f"{f.path}: {arch}.attention.sliding_window_pattern must be a positive int or one "
            f"flag per layer, got {pattern!r}",
            f.path,
        )
    if window and any(slides):
        fields["sliding_window"] = window
        fields["layer_types"] = tuple(
            "sliding_attention" if s else "full_attention" for s in slides
        )
    return fields


def _gguf_mla(f: GGUFFile, arch: str) -> dict[str, Any]:
    """A deepseek2 file's latent attention fields (``{}`` for others). Its ``key_length`` and
    ``value_length`` are the latent's (llama.cpp runs it as multi-query attention over
    ``kv_lora_rank + rope`` values); the heads' own are ``key_length_mla`` and
    ``value_length_mla`` (older files: ``key_length`` and ``value_length``). Its RoPE rows stay
    in the checkpoint's interleaved pairs (llama.cpp rotates adjacent pairs)."""
    if arch != "deepseek2":
        return {}
    rope = _meta_int(f, f"{arch}.rope.dimension_count")
    key = f"{arch}.attention"
    mla = f"{key}.key_length_mla" in f.metadata
    qk = _meta_int(f, f"{key}.key_length_mla" if mla else f"{key}.key_length")
    v = _meta_int(f, f"{key}.value_length_mla" if mla else f"{key}.value_length")
    if qk <= rope or not v:
        raise ModelLoadError(
            f"{f.path}: deepseek2 heads of {qk} key values (of which {rope} rotated) and {v} "
            "value values: unsupported",
            f.path,
        )
    q_lora = f.metadata.get(f"{key}.q_lora_rank")
    return dict(
        kv_lora_rank=_meta_int(f, f"{key}.kv_lora_rank"),
        q_lora_rank=None if not q_lora else _meta_int(f, f"{key}.q_lora_rank"),
        qk_nope_head_dim=qk - rope,
        qk_rope_head_dim=rope,
        v_head_dim=v,
        rope_interleave=True,
    )


def _gguf_gpt_oss(f: GGUFFile, arch: str, n_layers: int) -> dict[str, Any]:
    """A gpt-oss file's fields (``{}`` for others): even layers slide over
    ``attention.sliding_window`` (llama.cpp's pattern), the clamped SwiGLU's constants are
    llama.cpp's (transformers' defaults: the file has no key for them), and its experts are
    kept packed when they are MXFP4 (all of them, or none)."""
    if arch != "gpt-oss":
        return {}
    fields: dict[str, Any] = {}
    window = _meta_int(f, f"{arch}.attention.sliding_window", 0)
    if window:
        fields["sliding_window"] = window
        fields["layer_types"] = tuple(
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)
        )
    experts = [t for t in f.tensors.values() if _STACKED.match(t.name.split(".", 2)[-1])]
    fields["mxfp4_experts"] = any(t.type == _QT.MXFP4 for t in experts)
    return fields


def _gguf_moe(f: GGUFFile, arch: str, n_layers: int) -> dict[str, Any]:
    """The ``ModelConfig`` mixture-of-experts fields of a GGUF file (``{}`` for a dense one).

    A layer is sparse when it has a router (``ffn_gate_inp``); every sparse layer must hold
    all its experts' tensors and every dense one its MLP, else ``ModelLoadError`` names the
    first missing tensor.
    """
    path = f.path
    experts = _meta_int(f, f"{arch}.expert_count", 0)
    if not experts:
        return {}
    routing = _gguf_routing(f, arch)
    norm = f.metadata.get(f"{arch}.expert_weights_norm", _NORM_TOPK[arch])
    sparse = [i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" in f.tensors]
    if not sparse:
        raise ModelLoadError(f"{path}: expert_count={experts} but no ffn_gate_inp router", path)
    for i in range(n_layers):
        if i not in sparse:
            needed = [f"blk.{i}.{p}.weight" for p in _EXPERT_NAMES]
        elif f"blk.{i}.ffn_gate.0.weight" not in f.tensors:
            needed = [f"blk.{i}.{p}_exps.weight" for p in _EXPERT_NAMES]
        else:
            needed = [f"blk.{i}.{p}.{e}.weight" for e in range(experts) for p in _EXPERT_NAMES]
        for name in needed:
            if name not in f.tensors:
                raise ModelLoadError(f"{path}: tensor {name!r} is missing", path)
    first = sparse[0]
    stacked = f.tensors.get(f"blk.{first}.ffn_gate_exps.weight")
    single = f.tensors.get(f"blk.{first}.ffn_gate.0.weight")
    shape = stacked.shape[1] if stacked is not None else single.shape[0] if single else 0
    inter = _meta_int(f, f"{arch}.expert_feed_forward_length", shape)
    shared_gate = f.tensors.get(f"blk.{first}.ffn_gate_shexp.weight")
    shared = _meta_int(
        f,
        f"{arch}.expert_shared_feed_forward_length",
        shared_gate.shape[0] if shared_gate is not None else 0,
    )
    return dict(
        num_experts=experts,
        num_experts_per_tok=_meta_int(f, f"{arch}.expert_used_count"),
        moe_intermediate_size=inter,
        norm_topk_prob=bool(norm),
        shared_expert_intermediate_size=shared if shared_gate is not None else 0,
        shared_expert_gate=f"blk.{first}.ffn_gate_inp_shexp.weight" in f.tensors,
        mlp_only_layers=tuple(i for i in range(n_layers) if i not in sparse),
        **routing,
    )


def _gguf_routing(f: GGUFFile, arch: str) -> dict[str, Any]:
    """The routing fields of a mixture of experts: softmax then top-k, unscaled, one group;
    deepseek2's sigmoid scores (also where a file leaves ``expert_gating_func`` out but has
    the selection bias ``exp_probs_b``, as a converter reading a config without
    ``scoring_func`` writes it), group-limited top-k and weight scale. Others are refused,
    naming the key."""
    path, meta = f.path, f.metadata
    if arch != "deepseek2":
        fields: dict[str, Any] = {}
        default = _GATING_SOFTMAX
    else:
        groups = _meta_int(f, f"{arch}.expert_group_count", 1)
        fields = dict(
            moe_scoring_func="sigmoid",
            n_group=groups,
            topk_group=_meta_int(f, f"{arch}.expert_group_used_count", groups),
            routed_scaling_factor=_meta_float(f, f"{arch}.expert_weights_scale", 1.0),
        )
        bias = any(name.endswith(".exp_probs_b.bias") for name in f.tensors)
        default = _GATING_SIGMOID if bias else _GATING_SOFTMAX
    gating = meta.get(f"{arch}.expert_gating_func", default)
    if gating != (_GATING_SIGMOID if arch == "deepseek2" else _GATING_SOFTMAX):
        raise ModelLoadError(
            f"{path}: unsupported mixture-of-experts routing {arch}.expert_gating_func="
            f"{gating!r} (foudre routes {arch} files by "
            f"{'sigmoid, value 2' if arch == 'deepseek2' else 'softmax then top-k, value 1'})",
            path,
        )
    if arch == "deepseek2":
        return fields
    scale = meta.get(f"{arch}.expert_weights_scale", 0.0)
    if scale not in (0, 0.0, 1, 1.0):
        raise ModelLoadError(
            f"{path}: unsupported mixture-of-experts routing {arch}.expert_weights_scale="
            f"{scale!r} (only unscaled weights)",
            path,
        )
    for key, most in (("leading_dense_block_count", 0), ("expert_group_count", 1)):
        value = meta.get(f"{arch}.{key}", 0)
        if value > most:
            raise ModelLoadError(
                f"{path}: unsupported mixture-of-experts layout {arch}.{key}={value!r}", path
            )
    return fields


# ----------------------------------------------------------------------------- state space


def _ssm_config(f: GGUFFile, arch: str, embed: GGUFTensor) -> ModelConfig:
    """The ``ModelConfig`` of a ``mamba2`` or ``granitehybrid`` file (the module's docstring),
    once every Mamba layer's tensors agree with the ``ssm.*`` keys (``_check_ssm_tensors``)."""
    path = f.path
    hidden = _meta_int(f, f"{arch}.embedding_length")
    n_layers = _meta_int(f, f"{arch}.block_count")
    vocab = embed.shape[0]
    bos = f.metadata.get("tokenizer.ggml.bos_token_id")
    if arch == "mamba2":  # attention fields are placeholders, as for a config.json
        fields: dict[str, Any] = dict(
            intermediate_size=0, num_attention_heads=1, num_key_value_heads=1, head_dim=2
        )
        mamba_layers = tuple(range(n_layers))
    elif arch == "falcon-h1":
        fields, mamba_layers = _falcon_h1_fields(f, arch, hidden), tuple(range(n_layers))
    else:
        fields, mamba_layers = _granitehybrid_fields(f, arch, hidden, n_layers)
    ssm = _ssm_fields(f, arch, mamba_layers)
    _check_ssm_tensors(f, arch, {**ssm, **fields}, hidden, n_layers)
    try:
        return ModelConfig(
            architecture=ARCHITECTURES[arch],
            vocab_size=vocab,
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            max_position_embeddings=_meta_int(f, f"{arch}.context_length", 2048),
            rms_norm_eps=_meta_float(f, f"{arch}.attention.layer_norm_rms_epsilon"),
            tie_word_embeddings="output.weight" not in f.tensors,
            torch_dtype=_default_dtype(f),
            bos_token_id=bos if isinstance(bos, int) and 0 <= bos < vocab else None,
            eos_token_ids=_eos_ids(f, vocab),
            **fields,
            **ssm,
        )
    except ValueError as exc:
        raise ModelLoadError(f"{path}: {exc}", path) from exc


def _ssm_fields(f: GGUFFile, arch: str, mamba_layers: tuple[int, ...]) -> dict[str, Any]:
    """The ``mamba_*`` fields from the ``ssm.*`` keys: ``time_step_rank`` is the number of
    heads (llama.cpp's use of it), ``inner_size`` their width; the biases are there when the
    first Mamba layer has them. What the file does not say: the scan's chunk (the result does
    not depend on it) and ``time_step_limit`` (llama.cpp clamps nothing: (0, inf))."""
    key = f"{arch}.ssm"
    heads = _meta_int(f, f"{key}.time_step_rank")
    inner = _meta_int(f, f"{key}.inner_size")
    groups = _meta_int(f, f"{key}.group_count", 1)
    sizes = {
        name: _meta_int(f, f"{key}.{name}")
        for name in ("time_step_rank", "inner_size", "state_size", "conv_kernel")
    }
    if not all(sizes.values()) or not groups or inner % heads or heads % groups:
        raise ModelLoadError(
            f"{f.path}: {key}.* must be positive, with time_step_rank (heads) dividing "
            f"inner_size and group_count dividing the heads, got {sizes} and group_count="
            f"{groups}",
            f.path,
        )
    first = f"blk.{mamba_layers[0]}" if mamba_layers else ""
    return dict(
        mamba_num_heads=heads,
        mamba_head_dim=inner // heads,
        mamba_state_size=sizes["state_size"],
        mamba_n_groups=groups,
        mamba_conv_kernel=sizes["conv_kernel"],
        mamba_conv_bias=f"{first}.ssm_conv1d.bias" in f.tensors,
        mamba_proj_bias=f"{first}.ssm_in.bias" in f.tensors,
        mamba_layers=mamba_layers,
    )


def _check_ssm_tensors(
    f: GGUFFile, arch: str, ssm: dict[str, Any], hidden: int, n_layers: int
) -> None:
    """Every Mamba layer holds its mixer's tensors in the shapes the ``ssm.*`` keys give (as
    the converter writes them) and no other layer holds any; else ``ModelLoadError`` names the
    first tensor at fault and the keys it disagrees with."""
    heads, groups = ssm["mamba_num_heads"], ssm["mamba_n_groups"]
    inner = heads * ssm["mamba_head_dim"]
    conv_dim = inner + 2 * groups * ssm["mamba_state_size"]
    projection = inner + conv_dim + heads
    out_bias = ssm.get("mamba_out_proj_bias")
    out_bias = ssm["mamba_proj_bias"] if out_bias is None else out_bias
    shapes: dict[str, tuple[tuple[int, ...], bool]] = {  # leaf -> (shape, required)
        "ssm_in.weight": ((projection, hidden), True),
        "ssm_in.bias": ((projection,), ssm["mamba_proj_bias"]),
        "ssm_conv1d.weight": ((conv_dim, ssm["mamba_conv_kernel"]), True),
        "ssm_conv1d.bias": ((conv_dim,), ssm["mamba_conv_bias"]),
        "ssm_dt.bias": ((heads,), True),
        "ssm_a": ((heads, 1), True),
        "ssm_d": ((heads, 1), True),
        "ssm_norm.weight": ((groups, inner // groups), ssm.get("mamba_gate_norm") != "none"),
        "ssm_out.weight": ((hidden, inner), True),
        "ssm_out.bias": ((hidden,), out_bias),
    }
    keys = (
        f"{arch}.ssm.inner_size={inner}, time_step_rank={heads}, group_count={groups}, "
        f"state_size={ssm['mamba_state_size']}, conv_kernel={ssm['mamba_conv_kernel']}, "
        f"embedding_length={hidden}"
    )
    for i in range(n_layers):
        mamba = i in ssm["mamba_layers"]
        for leaf, (shape, required) in shapes.items():
            name = f"blk.{i}.{leaf}"
            tensor = f.tensors.get(name)
            if tensor is not None and not mamba:
                raise ModelLoadError(
                    f"{f.path}: tensor {name!r} in layer {i}, an attention layer by "
                    f"{arch}.attention.head_count_kv",
                    f.path,
                )
            if mamba and (tensor is None) == required:
                why = "is missing" if required else "is unexpected (the first Mamba layer has none)"
                if arch == "granitehybrid" and f"blk.{i}.attn_q.weight" in f.tensors:
                    # (a converter that misread layer_types)
                    why += f"; layer {i} has attention tensors but head_count_kv[{i}] = 0"
                raise ModelLoadError(f"{f.path}: tensor {name!r} {why} ({keys})", f.path)
            if mamba and tensor is not None and tensor.shape != shape:
                raise ModelLoadError(
                    f"{f.path}: tensor {name!r} has shape {tensor.shape}, expected {shape} from "
                    f"{keys}",
                    f.path,
                )


def _granitehybrid_fields(
    f: GGUFFile, arch: str, hidden: int, n_layers: int
) -> tuple[dict[str, Any], tuple[int, ...]]:
    """A granitehybrid file's attention, MLP and Granite fields, and its Mamba layers: those
    whose ``attention.head_count_kv`` is 0 (llama.cpp's rule). RoPE only when
    ``rope.scaling.finetuned`` (its switch: the converter sets it for Bamba, not for Granite
    4.0), over ``rope.dimension_count`` of each head; the multipliers from ``embedding_scale``,
    ``residual_scale``, ``attention.scale`` and ``logit_scale`` (absent or 0: none); the MLP
    dense (``ffn_gate``, of ``expert_shared_feed_forward_length`` or else
    ``feed_forward_length``) or experts with a shared MLP."""
    path = f.path
    heads = _meta_int(f, f"{arch}.attention.head_count")
    kv = f.metadata.get(f"{arch}.attention.head_count_kv", heads)
    per_layer = kv if isinstance(kv, list) else [kv] * n_layers
    if (
        not heads
        or len(per_layer) != n_layers
        or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in per_layer)
        or len({n for n in per_layer if n}) > 1
    ):
        raise ModelLoadError(
            f"{path}: {arch}.attention.head_count_kv must give each of the {n_layers} layers "
            f"one KV head count (0: a Mamba layer), the same for every attention layer, and "
            f"head_count must be positive; got head_count={heads}, head_count_kv={kv!r}",
            path,
        )
    head_dim = _meta_int(f, f"{arch}.attention.key_length", hidden // heads)
    rope_dim = _meta_int(f, f"{arch}.rope.dimension_count", head_dim)
    theta = _meta_float(f, f"{arch}.rope.freq_base", 10000.0)
    use_rope = bool(f.metadata.get(f"{arch}.rope.scaling.finetuned", True))
    if f"{arch}.attention.value_length" in f.metadata or any(
        name.endswith(".attn_q.bias") for name in f.tensors
    ):
        raise ModelLoadError(f"{path}: {arch} with attention biases or value_length", path)
    moe = _gguf_moe(f, arch, n_layers)
    shared = f.metadata.get(f"{arch}.expert_shared_feed_forward_length")
    ffn = _meta_int(f, f"{arch}.feed_forward_length")
    fields: dict[str, Any] = dict(
        intermediate_size=ffn,
        num_attention_heads=heads,
        num_key_value_heads=max(per_layer) or heads,
        head_dim=head_dim,
        rope_theta=theta,
        use_rope=use_rope,
        rope_scaling=_rope_scaling(f, arch, head_dim, theta, rope_dim) if use_rope else None,
        partial_rotary_factor=_partial_rotary(f, head_dim, rope_dim) if use_rope else 1.0,
        embedding_multiplier=_scale(f, f"{arch}.embedding_scale") or 1.0,
        residual_multiplier=_scale(f, f"{arch}.residual_scale") or 1.0,
        attention_multiplier=_scale(f, f"{arch}.attention.scale"),
        logits_scaling=_scale(f, f"{arch}.logit_scale") or 1.0,
        **moe,
    )
    if not moe:  # the shared MLP alone
        fields["shared_expert_intermediate_size"] = (
            _meta_int(f, f"{arch}.expert_shared_feed_forward_length") if shared else ffn
        )
    return fields, tuple(i for i, n in enumerate(per_layer) if not n)


def _falcon_h1_fields(f: GGUFFile, arch: str, hidden: int) -> dict[str, Any]:
    """A falcon-h1 file's attention and MLP, beside the mixer in every layer. The converter
    folds every muP multiplier into the weights (the embedding's into ``token_embd``, which a
    tied head then carries too, as llama.cpp runs it), so none is left; the mixer's output
    norm is there when ``ssm_norm`` is, after the gate (llama.cpp's graph: the file does not
    keep transformers' ``mamba_norm_before_gate``); RoPE turns whole heads."""
    heads, kv_heads, head_dim, rope_dim = _attention_heads(f, arch, hidden)
    if any(name.endswith(".attn_q.bias") for name in f.tensors):
        raise ModelLoadError(f"{f.path}: {arch} with attention biases", f.path)
    theta = _meta_float(f, f"{arch}.rope.freq_base", 10000.0)
    return dict(
        intermediate_size=_meta_int(f, f"{arch}.feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=_rope_scaling(f, arch, head_dim, theta, rope_dim),
        mamba_gate_norm="after_gate" if "blk.0.ssm_norm.weight" in f.tensors else "none",
        mamba_out_proj_bias="blk.0.ssm_out.bias" in f.tensors,
    )


def _qwen3next_fields(f: GGUFFile, arch: str, hidden: int, n_layers: int) -> dict[str, Any]:
    """A qwen3next file's gated DeltaNet fields (``{}`` for other architectures): the key heads
    from ``ssm.group_count``, the value heads from ``time_step_rank``, their widths from
    ``state_size`` and ``inner_size`` / ``time_step_rank`` (llama.cpp takes both widths to be
    ``state_size``; the converter writes each); the DeltaNet layers from
    ``attention.recurrent_layers``, else all but every ``full_attention_interval``-th. Every
    DeltaNet layer's tensors must have the shapes these give (``_check_deltanet_tensors``)."""
    if arch != "qwen3next":
        return {}
    key = f"{arch}.ssm"
    sizes = {
        name: _meta_int(f, f"{key}.{name}")
        for name in ("group_count", "time_step_rank", "state_size", "inner_size", "conv_kernel")
    }
    k_heads, v_heads, inner = sizes["group_count"], sizes["time_step_rank"], sizes["inner_size"]
    if not all(sizes.values()) or v_heads % k_heads or inner % v_heads or sizes["conv_kernel"] < 2:
        raise ModelLoadError(
            f"{f.path}: {key}.* must be positive, with group_count (key heads) dividing "
            f"time_step_rank (value heads) dividing inner_size, and conv_kernel at least 2; "
            f"got {sizes}",
            f.path,
        )
    recurrent = f.metadata.get(f"{arch}.attention.recurrent_layers")
    if recurrent is None:
        every = _meta_int(f, f"{arch}.full_attention_interval", 4) or 1
        linear = tuple(i for i in range(n_layers) if (i + 1) % every)
    elif isinstance(recurrent, list) and len(recurrent) >= n_layers:
        linear = tuple(i for i in range(n_layers) if recurrent[i])
    else:
        raise ModelLoadError(
            f"{f.path}: {arch}.attention.recurrent_layers must give each of the {n_layers} "
            f"layers true or false, got {recurrent!r}",
            f.path,
        )
    fields = dict(
        linear_num_key_heads=k_heads,
        linear_num_value_heads=v_heads,
        linear_key_head_dim=sizes["state_size"],
        linear_value_head_dim=inner // v_heads,
        linear_conv_kernel=sizes["conv_kernel"],
        linear_layers=linear,
    )
    _check_deltanet_tensors(f, fields, sizes, hidden, n_layers)
    return fields


def _check_deltanet_tensors(
    f: GGUFFile, fields: dict[str, Any], sizes: dict[str, int], hidden: int, n_layers: int
) -> None:
    """Every DeltaNet layer holds its tensors in the shapes the ``ssm.*`` keys give (as the
    converter writes them), and no attention layer holds any; else ``ModelLoadError`` names
    the first tensor at fault and the keys."""
    k_dim = fields["linear_num_key_heads"] * fields["linear_key_head_dim"]
    v_heads, v_dim = fields["linear_num_value_heads"], sizes["inner_size"]
    conv = 2 * k_dim + v_dim
    shapes = {
        "attn_qkv.weight": (conv, hidden),
        "attn_gate.weight": (v_dim, hidden),
        "ssm_ba.weight": (2 * v_heads, hidden),
        "ssm_conv1d.weight": (conv, fields["linear_conv_kernel"]),
        "ssm_dt.bias": (v_heads,),
        "ssm_a": (v_heads,),
        "ssm_norm.weight": (fields["linear_value_head_dim"],),
        "ssm_out.weight": (hidden, v_dim),
    }
    keys = ", ".join(f"{k}={v}" for k, v in sizes.items()) + f", embedding_length={hidden}"
    for i in range(n_layers):
        linear = i in fields["linear_layers"]
        for leaf, shape in shapes.items():
            name = f"blk.{i}.{leaf}"
            tensor = f.tensors.get(name)
            if tensor is not None and not linear:
                raise ModelLoadError(
                    f"{f.path}: tensor {name!r} in layer {i}, an attention layer by "
                    "qwen3next.attention.recurrent_layers",
                    f.path,
                )
            if linear and tensor is None:
                raise ModelLoadError(
                    f"{f.path}: tensor {name!r} of DeltaNet layer {i} is missing (qwen3next.ssm."
                    f"{keys})",
                    f.path,
                )
            if linear and tensor is not None and tensor.shape != shape:
                raise ModelLoadError(
                    f"{f.path}: tensor {name!r} has shape {tensor.shape}, expected {shape} from "
                    f"qwen3next.ssm.{keys}",
                    f.path,
                )


def _scale(f: GGUFFile, key: str) -> float | None:
    """A Granite multiplier: None where the file has none (absent or 0, as llama.cpp reads)."""
    if not f.metadata.get(key):
        return None
    return _meta_float(f, key)


def load_gguf(path: str | Path) -> tuple[ModelConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Read a GGUF model: its ``ModelConfig`` and a lazy iterator of HF-named weights.

    Everything that can be checked without reading tensor data (header, architecture,
    hyper-parameters, tensor types and names, file length) is checked before returning;
    ``ModelLoadError`` names the file and, where there is one, the tensor at fault.
    """
    f = read_gguf(path)
    config = gguf_config(f)
    return config, iter_gguf_weights(f, config)


# ----------------------------------------------------------------------------- tokenizer


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32 fields are written as 10-byte two's complement
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _pb_int(field: int, value: int) -> bytes:
    return _varint(field << 3) + _varint(value)


def _pb_bytes(field: int, value: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(value)) + value


def _pb_float(field: int, value: float) -> bytes:
    return _varint(field << 3 | 5) + struct.pack("<f", value)


def sentencepiece_model_proto(
    tokens: list[bytes],
    scores: list[float],
    types: list[int],
    *,
    unk_id: int,
    bos_id: int | None,
    eos_id: int | None,
    add_space_prefix: bool = True,
    remove_extra_whitespaces: bool = False,
) -> bytes:
    """A serialized sentencepiece ``ModelProto`` (BPE) with these pieces, scores and types.

    This is what llama.cpp's ``llama`` tokenizer runs: sentencepiece BPE over the pieces'
    scores, whitespace escaped to U+2581, an optional dummy prefix, byte fallback when the
    vocabulary has byte pieces. Field numbers are those of sentencepiece_model.proto.
    """

    def piece_type(t: int) -> int:
        return t if _NORMAL <= t <= _BYTE else _NORMAL

    pieces = b"".join(
        _pb_bytes(1, _pb_bytes(1, tok) + _pb_float(2, score) + _pb_int(3, piece_type(t)))
        for tok, score, t in zip(tokens, scores, types, strict=True)
    )

    def piece(i: int | None) -> bytes:
        return b"" if i is None else tokens[i]

    trainer = (
        _pb_int(3, 2)  # model_type: BPE
        + _pb_int(4, len(tokens))  # vocab_size
        + _pb_int(35, int(_BYTE in types))  # byte_fallback
        + _pb_int(40, unk_id)
        + _pb_int(41, -1 if bos_id is None else bos_id)
        + _pb_int(42, -1 if eos_id is None else eos_id)
        + _pb_int(43, -1)  # pad_id
        + _pb_bytes(45, tokens[unk_id])  # unk_piece
        + (b"" if bos_id is None else _pb_bytes(46, piece(bos_id)))
        + (b"" if eos_id is None else _pb_bytes(47, piece(eos_id)))
    )
    normalizer = (
        _pb_bytes(1, b"identity")
        + _pb_int(3, int(add_space_prefix))
        + _pb_int(4, int(remove_extra_whitespaces))
        + _pb_int(5, 1)  # escape_whitespaces
    )
    return pieces + _pb_bytes(2, trainer) + _pb_bytes(3, normalizer)


def _byte_level_bpe(
    tokens: list[bytes], types: list[int], merges: list[bytes], pre: str, path: Path
) -> Any:
    """A ``tokenizers.Tokenizer`` equal to the Hugging Face one llama.cpp's converter read."""
    from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as RustTokenizer

    if pre not in _BPE_PRE_TOKENIZERS:
        raise ModelLoadError(
            f"{path}: BPE pre-tokenizer {pre!r} is not supported (supported: "
            f"{', '.join(_BPE_PRE_TOKENIZERS)}); pass --tokenizer with the model's Hugging "
            "Face tokenizer",
            path,
        )
    regex, ignore_merges, nfc = _BPE_PRE_TOKENIZERS[pre]
    texts = [t.decode("utf-8", errors="replace") for t in tokens]
    vocab: dict[str, int] = {}
    for i, text in enumerate(texts):
        vocab.setdefault(text, i)
    pairs: list[tuple[str, str]] = []
    for merge in merges:
        left, sep, right = merge.decode("utf-8", errors="replace").partition(" ")
        if not sep:
            raise ModelLoadError(f"{path}: malformed BPE merge {merge!r}", path)
        pairs.append((left, right))
    tok = RustTokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
    if nfc:
        tok.normalizer = normalizers.NFC()
    splits = [
        pre_tokenizers.Split(Regex(r), behavior="isolated")
        for r in ((regex,) if isinstance(regex, str) else regex)
    ]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(
        [AddedToken(texts[i], special=True, normalized=False) for i, t in enumerate(types)
         if t == _CONTROL]
    )  # fmt: skip
    tok.add_tokens(
        [AddedToken(texts[i], special=False, normalized=False) for i, t in enumerate(types)
         if t == _USER_DEFINED]
    )  # fmt: skip
    return tok


def load_gguf_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer stored in a GGUF file's ``tokenizer.*`` metadata.

    ``llama`` (sentencepiece) vocabularies become a ``SentencePieceTokenizer`` over a model
    built from the pieces, scores and types; ``gpt2`` (byte-level BPE) ones an
    ``HFTokenizer`` over the vocabulary and merges, with the pre-tokenizer named by
    ``tokenizer.ggml.pre`` (``llama-bpe``, ``qwen2``, ``gpt-2``, ``gpt-4o``, ``deepseek-v3``); an
    embedded
    ``tokenizer.huggingface.json`` is used as is. BOS / EOS ids, ``add_bos_token`` and the
    chat template come from the metadata. Anything else raises ``ModelLoadError``.
    """
    f = read_gguf(path)
    meta, path = f.metadata, f.path
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if model is None or not isinstance(tokens, list) or not tokens:
        raise ModelLoadError(f"{path}: no tokenizer in the GGUF metadata; pass --tokenizer", path)
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * n
    if len(types) != n:
        raise ModelLoadError(f"{path}: {len(types)} token types for {n} tokens", path)

    def token_id(key: str) -> int | None:
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        return value if isinstance(value, int) and 0 <= value < n else None

    bos, eos = token_id("bos"), token_id("eos")
    config: dict[str, Any] = {
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
    hf_json = meta.get("tokenizer.huggingface.json")
    if isinstance(hf_json, str) or model == "gpt2":
        from tokenizers import Tokenizer as RustTokenizer

        if isinstance(hf_json, str):
            try:
                rust = RustTokenizer.from_str(hf_json)
            except Exception as exc:  # tokenizers raises plain Exception for bad JSON
                raise ModelLoadError(
                    f"{path}: bad tokenizer.huggingface.json: {exc}", path
                ) from exc
        else:
            merges = meta.get("tokenizer.ggml.merges") or []
            pre = str(meta.get("tokenizer.ggml.pre", "gpt-2"))
            rust = _byte_level_bpe(tokens, types, merges, pre, path)
        for key, i in (("bos_token", bos), ("eos_token", eos)):
            if i is not None:
                config[key] = tokens[i].decode("utf-8", errors="replace")
        return HFTokenizer(rust, config)
    if model == "llama":
        unk = token_id("unknown")
        if unk is None:
            unk = next((i for i, t in enumerate(types) if t == _UNKNOWN), None)
        if unk is None:
            raise ModelLoadError(f"{path}: sentencepiece vocabulary without an unknown token", path)
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * n
        proto = sentencepiece_model_proto(
            tokens,
            [float(s) for s in scores],
            [_UNKNOWN if i == unk else int(t) for i, t in enumerate(types)],
            unk_id=unk,
            bos_id=bos,
            eos_id=eos,
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            remove_extra_whitespaces=bool(
                meta.get("tokenizer.ggml.remove_extra_whitespaces", False)
            ),
        )
        try:
            return SentencePieceTokenizer(
                proto, {**config, "bos_token_id": bos, "eos_token_id": eos}
            )
        except ModelLoadError as exc:
            raise ModelLoadError(f"{path}: {exc}", path) from exc
    raise ModelLoadError(
        f"{path}: tokenizer model {model!r} is not supported (llama, gpt2); pass --tokenizer "
        "with the model's Hugging Face tokenizer",
        path,
    )
