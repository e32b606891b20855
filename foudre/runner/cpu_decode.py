"""Decode steps on the CPU through every decoder layer in one native call.

At batch 1 a decode step spends most of its time reading weights, and most of the rest between
those reads: each layer's four projections stream 50 MB (in the 500M benchmark model), which
evicts the interpreter's and torch's own state from the caches, so the Python and dispatch work
between two projections (norms, RoPE, the K/V write, the attention call, the residual adds,
some thirty ops and module calls per layer) runs from DRAM. Measured in place, that glue took
about 15% of a bfloat16 step, several times what it costs warm.

``NativeDecode`` runs the decoder layers of such a step in ``foudre_decode_layers``
(``layers/cpu_ops.cpp``): the same fused kernels (RMSNorm, the linear kernel, RoPE, SiLU * up)
and the same paged-attention kernel (``attention/cpu_paged_decode.cpp``), in the order and with
the roundings of ``models/llama.py``'s path through them, so the hidden states are the same bits
(tests/engine/test_cpu_decode.py checks that). The embedding, the final norm and the logits stay
in Python. It takes a step when every row is a decode row (one token each, no prefill chunk,
no drafts), of at most ``Linear``'s ``MAX_ROWS``; other steps, and models it cannot run (another
dtype, quantized layers, a quantized KV cache, another attention backend, hooks on a module),
take the model's ``forward``. Like CUDA graphs, it holds addresses: the weights and caches it
was built on are checked by identity at every step, and a replaced one sends the step back to
Python.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from foudre.layers import fused
from foudre.layers.linear import MAX_ROWS, Linear
from foudre.layers.norm import RMSNorm
from foudre.layers.rotary import RotaryEmbedding
from foudre.runner.attention import cpu_paged
from foudre.runner.attention.paged import PagedMetadata

if TYPE_CHECKING:
    from foudre.models.llama import DecoderLayer, LlamaForCausalLM
    from foudre.runner.attention import AttentionBackend


class NativeDecode:
    """The decoder layers of ``model`` for decode steps, over ``kv_caches``; ``build`` returns
    None where they cannot run natively."""

    def __init__(self, model: LlamaForCausalLM, kv_caches: list[torch.Tensor], fn: Any) -> None:
        cfg = model.config
        self.model = model
        self.kv_caches = kv_caches
        self.fn = fn
        self.dtype = model.lm_head.weight.dtype
        self.max_rows = MAX_ROWS[self.dtype]
        self.attention = ctypes.cast(cpu_paged.kernel(self.dtype), ctypes.c_void_p).value
        self.dims = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            cfg.intermediate_size,
        )
        self.eps = cfg.rms_norm_eps
        layers = cast("list[DecoderLayer]", list(model.model.layers))
        self.scale = layers[0].self_attn.scale
        # (owner's parameter dict, name, tensor) for every tensor whose address is passed
        self.held: list[tuple[dict[str, nn.Parameter | None], str, torch.Tensor | None]] = []
        pointers: list[int] = []
        for layer, cache in zip(layers, kv_caches, strict=True):
            attn, mlp = layer.self_attn, layer.mlp
            held: list[tuple[nn.Module | None, str]] = [
                (layer.input_layernorm, "weight"),
                (attn.qkv_proj, "weight"),
                (attn.qkv_proj, "bias"),
                (attn.o_proj, "weight"),
                (layer.post_attention_layernorm, "weight"),
                (mlp.gate_up_proj, "weight"),
                (mlp.down_proj, "weight"),
                (attn.q_norm, "weight"),
                (attn.k_norm, "weight"),
            ]
            for module, name in held:
                tensor = None if module is None else module._parameters[name]
                if module is not None:
                    self.held.append((module._parameters, name, tensor))
                pointers.append(0 if tensor is None else tensor.data_ptr())
            pointers += [cache[0].data_ptr(), cache[1].data_ptr()]
        self.layers = torch.tensor(pointers, dtype=torch.int64)
        self.rotary = model.model.rotary
        self.tables = (self.rotary.cos, self.rotary.sin)

    @classmethod
    def build(
        cls,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: Sequence[object],
    ) -> NativeDecode | None:
        """A ``NativeDecode`` for ``model``, or None where its layers cannot run natively."""
        from foudre.models.llama import MLP, Attention, DecoderLayer, LlamaForCausalLM

        if type(model) is not LlamaForCausalLM or not isinstance(
            backend, cpu_paged.CPUPagedBackend
        ):
            return None
        dtype = model.lm_head.weight.dtype
        fn = fused.decode_layers_fn(dtype)
        if fn is None or dtype not in MAX_ROWS or cpu_paged.kernel(dtype) is None:
            return None
        if not all(isinstance(c, torch.Tensor) and c.dtype == dtype for c in kv_caches):
            return None  # a quantized KV cache
        cfg = model.config
        allowed = (nn.ModuleList, DecoderLayer, Attention, MLP, Linear, RMSNorm, RotaryEmbedding)
        for module in model.model.layers.modules():
            if type(module) not in allowed:
                return None  # a quantized or otherwise replaced layer
            if module._forward_hooks or module._forward_pre_hooks:
                return None  # someone watches the layers (calibration): keep them called
            for p in module.parameters(recurse=False):
                if p.dtype != dtype or not p.is_cpu or not p.is_contiguous():
                    return None
            if isinstance(module, RMSNorm) and module.eps != cfg.rms_norm_eps:
                return None
        for cache in kv_caches:
            assert isinstance(cache, torch.Tensor)
            if not cache.is_contiguous() or cache.shape[-2:] != (
                cfg.num_key_value_heads,
                cfg.head_dim,
            ):
                return None
        return cls(model, cast("list[torch.Tensor]", list(kv_caches)), fn)

    def takes(self, metadata: object, num_tokens: int) -> bool:
        """Whether this step can run here: decode rows only, few enough, nothing replaced."""
        return (
            isinstance(metadata, PagedMetadata)
            and not metadata.groups
            and metadata.decode_tokens is not None
            and 0 < num_tokens <= self.max_rows
            and all(owner[name] is t for owner, name, t in self.held)
            and self.rotary.cos is self.tables[0]
        )

    def run(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: PagedMetadata
    ) -> torch.Tensor:
        """Final hidden states (after the model's last norm) of a step that ``takes`` allows."""
        model = self.model.model
        x = model.embed_tokens(input_ids)
        rows = x.shape[0]
        tables, lens, tokens = metadata.block_tables, metadata.seq_lens, metadata.decode_tokens
        assert tables is not None and lens is not None and tokens is not None
        cos, sin = self.tables
        hidden, heads, kv_heads, head_dim, intermediate = self.dims
        slots = metadata.slot_mapping
        assert positions.dtype == slots.dtype == torch.int64 and positions.is_contiguous()
        failed = self.fn(
            x.data_ptr(),
            rows,
            self.layers.data_ptr(),
            len(self.kv_caches),
            hidden,
            heads,
            kv_heads,
            head_dim,
            intermediate,
            self.eps,
            cos.data_ptr(),
            sin.data_ptr(),
            cos.shape[0],
            positions.data_ptr(),
            slots.data_ptr(),
            self.attention,
            tokens.data_ptr(),
            tables.data_ptr(),
            lens.data_ptr(),
            tables.shape[1],
            self.kv_caches[0].shape[2],
            self.scale,
        )
        if failed:
            raise IndexError(f"RoPE position outside the table of {cos.shape[0]}")
        return model.norm(x)
