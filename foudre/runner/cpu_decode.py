"""Decode steps on the CPU through every decoder layer in one native call.

At batch 1 a decode step spends most of its time reading weights, and most of the rest between
those reads: each layer's four projections stream 50 MB (in the 500M benchmark model), which
evicts the interpreter's and torch's own state from the caches, so the Python and dispatch work
between two projections (norms, RoPE, the K/V write, the attention call, the residual adds,
some thirty ops and module calls per layer) runs from DRAM. Measured in place, that glue took
about 15% of a bfloat16 step, several times what it costs warm.

``NativeDecode`` runs the decoder layers of such a step in ``foudre_decode_layers``
(``native/cpu_ops.cpp``): the same fused kernels (RMSNorm, the linear kernel, RoPE, SiLU * up) and
the same paged-attention kernel (``attention/cpu_paged_decode.cpp``), in the order and with the
roundings of ``models/llama.py``'s path through them, so the hidden states are the same bits
(tests/engine/test_cpu_decode.py checks that), from the embedding rows to the final norm, and on to
the logits where the model's head is quantized (``run_logits``; a float head's logits stay in
Python). A sparse layer (a mixture of experts: router and top-k experts, renormalised or not, a
shared expert or none) runs ``moe_block``, the native call ``layers/moe.py`` makes for it
at decode sizes, and adds to the block's ``expert_tokens`` what its Python path would
(``_counted``). State-space and hybrid stacks too (``_parts``: Mamba-2's blocks, Bamba's and
Granite 4.0's hybrid layers): a Mamba-2 layer runs ``in_proj``, ``foudre_mamba_step``
(``native/cpu_ssm.cpp``: ``ssm_ops.mamba_decode``'s conv window, state update and gated norm on
each row's state slot, then a decode row's snapshot copied) and ``out_proj``; Qwen3-Next's gated
DeltaNet layers likewise (``foudre_deltanet_step``, the call ``GatedDeltaNet`` makes at decode:
conv window, gates, delta rule, gated norm), its attention's output gated by a sigmoid before
``o_proj``, its shared experts' by the sigmoid of their gate (Qwen2-MoE's too), both by
``fused.sigmoid_gate``, which the Python path calls too; attention layers
rotate part of each head or none; Granite's multipliers scale the embedding and each sublayer's
output with torch's rounding. It takes a step
when every row is a decode row (one token each, no prefill chunk, no drafts), of at most
``Linear``'s ``MAX_ROWS`` and below the rows where a ``QuantLinear`` turns to its dequantized GEMM
(``dequantized_gemm_rows``: 64, 32 for group-wise 8 bits, 96-2048 on AVX2, 1024 on AMX's tiles, 160
and 128 for 8 and 4 bits in groups of 32 there, 256 for int4 in groups of 64 in blocks of 16 rows;
with every projection quantized, ``MAX_ROWS`` does
not apply), and with sliding windows while every row's context fits the narrowest window (its layers
attend to every key); other steps, and models it cannot run (another dtype, quantized experts,
another attention backend, hooks on a module, OLMoE's attention, a
vocabulary-parallel embedding), take the model's ``forward``. gpt-oss's layers
(``cpu_decode_gpt_oss.py``) pass their sliding window and sinks to the kernel, and their experts,
float, int8 or MXFP4, run their own kernel. DeepSeek-V3's layers run there
too (``DecodeParts.latent``, ``native/decode_mla.h``): multi-head latent attention in the absorbed
form over the latent pages, the sigmoid group-limited routing, its experts float or quantized
(``QuantExperts``: each expert's projections on their kernels), the shared experts, and each
layer's own MLP size. Quantized projections (``QuantLinear``
on ``quant/cpu_qmatmul``: int8, GGUF's group-wise 8-bit, int4, int6) run the same kernel from C++,
their bias added after, as ``QuantLinear.forward`` does. A quantized KV cache (int8 / fp8) is read
as stored by the paged kernel's codes variant, and the new tokens' K/V are quantized on write in C++
to the codes and scales of ``attention.kv_quant.quantize_kv``, bit for bit. Like CUDA graphs,
it holds addresses: every step checks that the weights, RoPE tables, KV caches, recurrent state
pools and expert counts it was built on are still the modules' and the runner's, at the same
addresses, that the Mamba-2 parameters it holds float32 copies of were not written in place
(their versions; a write through ``.data`` bumps none, and goes unseen here as it does in
``Mamba2Mixer``'s own cache of them), and that no hook or autocast asks for the Python path;
otherwise the step goes back to Python.
"""

from __future__ import annotations

import array
import ctypes
import dataclasses
import itertools
import operator
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import torch
from torch import nn
from torch.nn.modules import module as nn_module
from torch.utils.hooks import RemovableHandle

from foudre.attention import cpu_paged
from foudre.attention.base import slot_mapping, table_tensor
from foudre.attention.cache_spec import RecurrentCache
from foudre.attention.kv_quant import STORAGE_DTYPES
from foudre.attention.quantized_cache import QuantizedKVCache
from foudre.layers import fused, ssm_ops
from foudre.layers.gated_deltanet import GatedDeltaNet, NormThenGate
from foudre.layers.linear import MAX_ROWS, Linear
from foudre.layers.mamba import GatedRMSNorm, Mamba2Mixer
from foudre.layers.mlp import GatedMLP
from foudre.layers.moe import Experts, SparseMoeBlock, silu_mul
from foudre.layers.norm import OffsetRMSNorm, RMSNorm
from foudre.layers.rotary import RotaryEmbedding
from foudre.layers.ssm_ops import DeltaNetDecodeParams, MambaDecodeParams
from foudre.models.llama import DecodeParts, declared_parts
from foudre.quant import cpu_qmatmul
from foudre.quant.experts import QuantExperts
from foudre.quant.qlinear import QuantLinear, uses_native_kernels
from foudre.runner.cpu_decode_gpt_oss import expected_shapes as _oss_shapes
from foudre.runner.cpu_decode_gpt_oss import experts_kinds as _oss_experts_kinds
from foudre.runner.cpu_decode_gpt_oss import inside as _oss_inside
from foudre.runner.cpu_decode_gpt_oss import layer_entries as oss_layer_entries
from foudre.runner.cpu_decode_gpt_oss import max_rows as _oss_rows
from foudre.runner.cpu_decode_gpt_oss import supported as _oss_supported
from foudre.runner.step import ForwardStep

if TYPE_CHECKING:
    from foudre.attention import AttentionBackend
    from foudre.models.deepseek_v3 import LatentAttention
    from foudre.models.llama import LlamaForCausalLM


class NativeDecode:
    """Decode steps of ``model`` from the token ids to the final norm (embedding, decoder layers,
    final RMSNorm) and, with a quantized head, on to the logits (``run_logits``), over
    ``kv_caches`` (the runner's list); ``build`` returns None where they cannot run natively."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        layers: Sequence[DecodeParts],
        kv_caches: Sequence[torch.Tensor | QuantizedKVCache | RecurrentCache],
        fn: Any,
        block_size: int,
        padding_state_slot: int = -1,
        group_of_layer: Sequence[int] | None = None,
    ) -> None:
        cfg = model.config
        self.model = model
        self.fn = fn
        self.dtype = model.model.embed_tokens.weight.dtype
        self.max_rows = MAX_ROWS[self.dtype]  # where the float projections' kernel stops paying
        self._attention(layers, kv_caches)
        self.scale: float = _latent_scale(layers, self.scale)
        self.dims = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            _intermediate(layers),
        )
        self.eps = cfg.rms_norm_eps
        # the RoPE tables, where an attention layer rotates (a model of recurrent layers, or of
        # attention without positions, reads none: NoPE's table holds one position)
        self.rotary = model.model.rotary if any(p.rope for p in layers) else None
        self.embed_scale = _embedding_multiplier(model)
        self.final_offset = int(type(model.model.norm) is OffsetRMSNorm)
        self.mamba = (ssm_ops.mamba_step_fn(self.dtype) or 0) if any(p.mamba for p in layers) else 0
        self.deltanet = any(p.deltanet for p in layers)  # (Qwen3-Next: state slots too)
        self.padding_state_slot = padding_state_slot
        embed, norm = model.model.embed_tokens, cast(RMSNorm, model.model.norm)
        modules = [*model.model.layers.modules(), embed, norm]
        # What _unchanged checks each step (_Checks): every module's hooks, the top model's and
        # its decoder's too (a hook there is called by the Python path), and a leaf's children
        self.checks = checks = _Checks()
        for m in [model, model.model, *modules]:
            checks.watch(m)
        # a module's children as built: a child replaced since (a Linear quantized in place,
        # say) sends the steps back to Python; the model's own too (an embedding, final norm or
        # rotary module replaced: the call holds the built ones' tables)
        owners = [model.model, *(m for m in modules if m._modules)]
        checks.children = [(m._modules, dict(m._modules)) for m in owners]
        layout = _Layout(checks, cpu_qmatmul.function(self.dtype), self.rotary)
        rows = _cache_rows(layers)  # (a parallel layer: two, one a cache)
        groups = list(group_of_layer or [0] * len(rows))
        self.groups = 1 + max((g for g, p in zip(groups, rows, strict=True) if p.attn), default=0)
        for parts, cache, group in zip(rows, kv_caches, groups, strict=True):
            layout.layer(parts, cache, group)
        self.blocks = layout.blocks  # the sparse layers' MLPs, which count
        self.mamba_params = layout.mamba_descriptors  # what the Mamba-2 layers' descriptors name
        self.sections = layout.sections  # (the Falcon-H1 layers' in_proj sections, named too)
        self.deltanet_params = layout.deltanet_descriptors  # (Qwen3-Next's gated DeltaNets')
        self.oss = layout.oss  # gpt-oss's experts descriptors and float32 sinks (kept alive)
        self.latent_params = layout.latent_descriptors  # (DeepSeek-V3's: held alive)
        if self.rotary is not None:
            for name in ("cos", "sin"):
                table = self.rotary._buffers[name]
                assert table is not None
                checks.keep(self.rotary._buffers, name, table, table.data_ptr())
        # the embedding table and the final norm's weight, which the call reads too
        self.vocab = embed.weight.shape[0]
        self.ends = (embed.weight.data_ptr(), norm.weight.data_ptr())
        layout.hold(embed, "weight", passed=False)
        layout.hold(norm, "weight", passed=False)
        self._hold_caches(kv_caches, block_size)
        self.descriptors, self.layers = layout.tensors()
        if checks.quantized:
            self._quantized_rows(model, layers)
        self._hold_head(model, layout)

    def _attention(
        self,
        layers: Sequence[DecodeParts],
        kv_caches: Sequence[torch.Tensor | QuantizedKVCache | RecurrentCache],
    ) -> None:
        """The paged-attention kernel of the caches' kind, the attention scale, and the
        narrowest sliding window: the C++ layers attend to every key, so with sliding windows
        only while every context fits the narrowest one (where the window changes nothing)."""
        attns = [p.attn for p in layers if p.attn is not None]
        self.attention = 0
        first_kv = next((c for c in kv_caches if not isinstance(c, RecurrentCache)), None)
        if first_kv is not None:
            kernel = cpu_paged.kernel(self.dtype, _codes_dtype(first_kv))
            self.attention = ctypes.cast(kernel, ctypes.c_void_p).value or 0
        # (a layer whose window the C++ applies, gpt-oss's, limits no step)
        windows = [
            p.attn.sliding_window for p in layers if p.attn is not None and not p.attention_window
        ]
        self.window = min((w for w in windows if w is not None), default=None)
        self.scale = attns[0].scale if attns else 1.0

    def _quantized_rows(self, model: LlamaForCausalLM, layers: Sequence[DecodeParts]) -> None:
        """Where QuantLinear's forward switches to its dequantized GEMM, so do the steps; with
        every projection quantized (and no experts) up to there, as the float kernel's limit
        then does not apply (32-row int8 steps: 5% more throughput than in Python); and where
        it turns to aten's kernels (``QuantLinear.native_rows``)."""
        quantized = self.checks.quantized
        all_quantized = len(quantized) == len(_projections(model, layers)) and not self.blocks
        # (a latent layer's kv_b_proj stays float: its absorbed products pay up to MAX_ROWS)
        all_quantized = all_quantized and not any(p.latent is not None for p in layers)
        limit = min(m.native_rows() for m, _ in quantized)
        self.max_rows = limit if all_quantized else min(self.max_rows, limit)

    def _hold_caches(
        self,
        kv_caches: Sequence[torch.Tensor | QuantizedKVCache | RecurrentCache],
        block_size: int,
    ) -> None:
        """The runner's list of caches (each step: the same caches in it), and each cache's
        tensors where they are (a quantized cache's codes and scales held as its attributes, a
        recurrent layer's pools)."""
        checks = self.checks
        self.cache_list = kv_caches
        self.caches = tuple(kv_caches)
        self.block_size = block_size
        self.num_slots = 1 << 62  # (no KV cache: no slot to check)
        self.num_state_slots = 0
        for cache in kv_caches:
            if isinstance(cache, RecurrentCache):
                self.num_state_slots = cache.conv.shape[0]
                for tensor in cache:
                    checks.addresses.append((tensor, tensor.data_ptr()))
                continue
            if isinstance(cache, QuantizedKVCache):
                for name in ("codes", "scales"):
                    checks.entry(cache.__dict__, name)
                    tensor = getattr(cache, name)
                    checks.addresses.append((tensor, tensor.data_ptr()))
            else:
                checks.addresses.append((cache, cache.data_ptr()))
            shape = _stored(cache).shape  # [2, blocks, block_size, heads, head_dim]
            self.num_slots = shape[1] * shape[2]

    def _hold_head(self, model: LlamaForCausalLM, layout: _Layout) -> None:
        """The model's head, computed in the call too where it is a QuantLinear on cpu_qmatmul
        (``run_logits``)."""
        # The model's head, computed in the call too where it is a QuantLinear on cpu_qmatmul
        # (run_logits): for steps of rows it runs there (its native_rows) and each row's one
        # logit, while its own checks hold (a hook on it, say, sends the head alone back to
        # Python). Its Python path's module calls and checks took 0.17 ms of a 7.8 ms int4 step
        # (the head's 40 MB stream leaving them cold); a float head's kernel changes with the
        # rows (``linear``), and it is left to ``compute_logits``.
        head = model.lm_head
        self.head: torch.Tensor | None = None  # its descriptor
        self.head_checks = _Checks()
        self.head_rows = self.head_features = 0
        self.head_multiplier = _head_multiplier(model)
        if (
            self.head_multiplier is not None
            and isinstance(head, QuantLinear)
            and _runs_quantized(head, self.dtype, (model.config.hidden_size, head.out_features))
        ):
            self.head_features = head.out_features
            self.head_checks.watch(head)
            self.head_checks.children.append((model._modules, dict(model._modules)))
            self.head = torch.tensor(layout.descriptor(head, self.head_checks), dtype=torch.int64)
            self.head_rows = head.native_rows()

    @classmethod
    def build(
        cls,
        model: nn.Module,
        backend: AttentionBackend,
        kv_caches: list[torch.Tensor] | list[Any],
        block_size: int | None = None,
        padding_state_slot: int = -1,
        group_of_layer: Sequence[int] | None = None,
    ) -> NativeDecode | None:
        """A ``NativeDecode`` for ``model``, or None where its embedding, layers or final norm
        cannot run natively. What it checks here and not at each step (``_unchanged``): the
        modules' classes and settings (an RMSNorm's eps, the embedding's ``max_norm``, tensor
        parallelism), as for the layers' norms. ``block_size``: the KV blocks' tokens (by
        default the first KV cache's); ``padding_state_slot``: the recurrent state slot of the
        rows that pad a step (a model with recurrent layers); ``group_of_layer``: each layer's
        KV cache group (by default all in one: one block table a row)."""
        # the backend's own class: the step builds what its build_metadata would, so a
        # subclass that builds otherwise is not run here
        if type(model) not in _model_classes() or type(backend) is not cpu_paged.CPUPagedBackend:
            return None
        model = cast("LlamaForCausalLM", model)
        cfg = model.config
        if cfg.qk_norm_over_heads or cfg.clip_qkv is not None:
            return None  # olmoe's attention: the C++ layers' is Llama's
        dtype = model.model.embed_tokens.weight.dtype
        fn = fused.decode_layers_fn(dtype)
        if fn is None or dtype not in MAX_ROWS:
            return None
        parts = [declared_parts(layer) for layer in model.model.layers]
        if any(p is None for p in parts):
            return None
        layers = cast("list[DecodeParts]", parts)
        if len(kv_caches) != len(_cache_rows(layers)):
            return None
        if any(p.mamba for p in layers) and ssm_ops.mamba_step_fn(dtype) is None:
            return None
        if any(p.deltanet for p in layers) and ssm_ops.deltanet_step_fn(dtype) is None:
            return None
        if not _caches_supported(kv_caches, _cache_rows(layers), dtype, cfg):
            return None
        if not (_modules_supported(model, layers, dtype) and _shapes_supported(model, layers)):
            return None
        if not _oss_supported(model, layers, dtype):
            return None
        if not _ends_supported(model, dtype, layers):
            return None
        kv = [c for c in kv_caches if not isinstance(c, RecurrentCache)]
        if kv and block_size not in (None, _stored(kv[0]).shape[2]):
            return None  # (the caches' blocks are what the slots index)
        if block_size is None:
            block_size = _stored(kv[0]).shape[2] if kv else 1
        native = cls(model, layers, kv_caches, fn, block_size, padding_state_slot, group_of_layer)
        native.max_rows = min(native.max_rows, _oss_rows(layers))
        return native

    def can_run(self, step: ForwardStep) -> bool:
        """Whether this step can run here: decode rows only, few enough, contexts within the
        sliding window (if any), nothing replaced or moved since ``build``, no hook to call, no
        autocast, and the sparse layers all counting the same rows."""
        return (
            step.decode_only
            and len(step.token_ids) <= self.max_rows
            and (self.window is None or max(step.starts) < self.window)
            and all(offset == 0 for _, offset, _ in step.state_snapshots)
            and not torch.is_autocast_enabled("cpu")
            and not (nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks)
            and self._unchanged()
            and self._counting_alike()
        )

    def _counting_alike(self) -> bool:
        """Whether every sparse layer counts by the model's one ``routed_rows`` (one
        ``counted`` for the call): as built, unless one was given another since."""
        routed = self.model.routed_rows
        return all(b.routed_rows is routed for b in self.blocks)

    def _unchanged(self) -> bool:
        now = self.cache_list
        return (
            len(now) == len(self.caches)
            and all(map(operator.is_, now, self.caches))
            and self.checks.unchanged(self.dtype)
        )

    def _counted(self, rows: int) -> int:
        """How many of the step's rows the sparse layers count: ``SparseMoeBlock.forward``'s
        rule, the same for every block (``can_run`` checked)."""
        routed = self.model.routed_rows
        return 0 if routed is None or not self.blocks else routed.counted(rows)

    def run(self, step: ForwardStep) -> torch.Tensor:
        """Final hidden states (after the model's last norm) of a step that ``can_run`` allows:
        the embedding, the layers and the final norm in the one call."""
        return self._call(step, None)

    def run_logits(self, step: ForwardStep) -> torch.Tensor | None:
        """Float32 logits ``[rows, vocab]`` of a step that ``can_run`` allows, the model's head
        computed in the same call, where it can be (a quantized head, rows within its
        ``native_rows``, every row asking one logit), exactly ``compute_logits``' on ``run``'s
        hidden states; else None."""
        rows = len(step.token_ids)
        if self.head is None or rows > self.head_rows or any(n != 1 for n in step.num_logits):
            return None
        if not self.head_checks.unchanged(self.dtype):
            return None
        logits = torch.empty(rows, self.head_features)  # float32: the C++ widens them
        self._call(step, logits)
        multiplier = self.head_multiplier
        if multiplier is not None and multiplier != 1.0:  # (Falcon-H1's, as compute_logits)
            logits.mul_(multiplier)
        return logits

    def _call(self, step: ForwardStep, logits: torch.Tensor | None) -> torch.Tensor:
        """The call: the final hidden states, and the head's logits into ``logits`` if given."""
        rows = len(step.token_ids)
        longs, ints, width = self._inputs(step)
        states, copies = self._states(step)
        rotary = self.rotary  # (cos, sin, rotated width, positions)
        tables = (0, 0, 0, 1 << 62)
        if rotary is not None:
            cos, sin = rotary.cos, rotary.sin
            tables = (cos.data_ptr(), sin.data_ptr(), rotary.rotary_dim, cos.shape[0])
        hidden, heads, kv_heads, head_dim, intermediate = self.dims
        out = torch.empty(rows, hidden, dtype=self.dtype)
        head = 0 if logits is None or self.head is None else self.head.data_ptr()
        at64, at32 = longs.buffer_info()[0], ints.buffer_info()[0]
        embed, norm = self.ends
        failed = self.fn(
            out.data_ptr(), rows, self.layers.data_ptr(), len(self.caches), hidden, heads,
            kv_heads, head_dim, intermediate, self.eps,
            *tables,
            at64 + 8 * rows,  # positions
            at64 + 16 * rows,  # slots
            self.num_slots,
            self.attention,
            at32,  # each row's flat token index
            at32 + 8 * rows,  # block tables
            at32 + 4 * rows,  # context lengths
            width, self.block_size, self.groups, self.scale,
            self.mamba, states.buffer_info()[0], self.num_state_slots, copies.buffer_info()[0],
            len(copies) // 2,
            self._counted(rows),
            embed, self.embed_scale, self.vocab,
            at64,  # token ids
            norm, self.final_offset, head, self.head_features,
            0 if logits is None else logits.data_ptr(),
        )  # fmt: skip
        if failed == 1:
            raise IndexError(f"RoPE position outside the table of {tables[3]}")
        if failed == 2:
            raise IndexError(f"KV slot outside the cache of {self.num_slots} slots")
        if failed == 4:
            raise IndexError(f"recurrent state slot outside the pools of {self.num_state_slots}")
        if failed:
            raise IndexError(f"token id outside the vocabulary of {self.vocab}")
        return out

    def _states(self, step: ForwardStep) -> tuple[array.array[int], array.array[int]]:
        """Each row's recurrent state slot (the rows past ``step.state_slots`` pad the step:
        the padding slot) and the snapshots' (source, destination) slot pairs: a decode row's
        state after the step copied into its snapshot slot."""
        if not self.mamba and not self.deltanet:
            return _NO_STATES, _NO_STATES
        slots = list(step.state_slots)
        slots += [self.padding_state_slot] * (len(step.token_ids) - len(slots))
        copies: list[int] = []
        for row, _, slot in step.state_snapshots:
            copies += (slots[row], slot)
        return array.array("q", slots), array.array("q", copies)

    def _inputs(self, step: ForwardStep) -> tuple[array.array[int], array.array[int], int]:
        """The step's inputs for the C++ layers in two arrays: int64 token ids and RoPE
        positions (with the rows' ``position_offsets``), then the KV slots of each cache group
        (``rows`` each); int32 flat token indices and context lengths (``rows`` each), then
        each group's block tables (``rows x width``: the step's tables, lists zero-padded).
        What the runner's ``flatten`` and the backend's metadata hold for a decode step, built
        without their dozen tensor ops a row, in ``array.array``s (the tables' rows copied as
        they are, gathered from the runner's per-slot tables). A model without attention
        takes no KV slots (zeros)."""
        bs = self.block_size
        starts = step.starts
        # (a step without tables of its own per group reads group 0's for all, as flatten does)
        groups = [step.block_tables, *step.group_tables][: self.groups]
        if not step.group_tables:
            groups = [step.block_tables] * self.groups
        if len(groups) != self.groups or any(
            len(tables) != len(starts) or len(starts) != len(step.token_ids) for tables in groups
        ):
            raise ValueError(
                f"a step of {len(step.token_ids)} rows with {len(starts)} starts and "
                f"block tables of {[len(t) for t in groups]} rows ({self.groups} groups)"
            )
        # (numpy over the tables' memory: a few small ops, each cheaper than torch's)
        arrays = [table_tensor(tables).to(torch.int32).numpy() for tables in groups]
        width = max(a.shape[1] for a in arrays)
        longs = array.array("q", [ids[0] for ids in step.token_ids])
        offsets = step.position_offsets  # (LongRoPE's past the original context)
        longs.extend(
            starts if not offsets else [s + o for s, o in zip(starts, offsets, strict=True)]
        )
        rows = len(starts)
        at = np.asarray(starts, np.int64)
        for a in arrays:
            if self.attention:
                longs.frombytes(slot_mapping(torch.from_numpy(a), at, bs).numpy().tobytes())
            else:
                longs.extend([0] * rows)
        ints = array.array("i", range(rows))
        ints.extend(s + 1 for s in starts)
        for a in arrays:
            if a.shape[1] < width:  # (groups' tables of other widths)
                a = np.concatenate([a, np.zeros((rows, width - a.shape[1]), np.int32)], axis=1)
            ints.frombytes(a.tobytes())
        return longs, ints, width


_NO_STATES: array.array[int] = array.array("q", [0])  # (an address for the call, never read)


class _Layout:
    """What the C++ layers read, built layer by layer: ``pointers`` (per layer its weights'
    addresses, caches, quantized projections' descriptors and a sparse layer's router, experts
    and counts, in ``cpu_ops.cpp``'s order), the quantized projections' ``descriptors``
    (``QuantSlot``), and every tensor held in ``checks`` as it was built."""

    def __init__(self, checks: _Checks, qmm: int | None, rotary: RotaryEmbedding | None) -> None:
        self.checks = checks
        self.rotary = rotary  # the step's RoPE tables
        self.qmm = qmm
        self.pointers: list[int] = []
        self.descriptors: list[list[int]] = []
        self.patches: list[tuple[int, int]] = []  # (index in pointers, descriptor)
        self.blocks: list[SparseMoeBlock] = []
        self.num_layers = 0
        self.mamba_descriptors: list[tuple[torch.Tensor, MambaDecodeParams]] = []
        self.sections: list[torch.Tensor] = []  # parallel layers' in_proj sections (Falcon-H1)
        self.deltanet_descriptors: list[tuple[torch.Tensor, DeltaNetDecodeParams]] = []
        self.oss: list[torch.Tensor] = []  # gpt-oss's experts descriptors and float32 sinks
        self.latent_descriptors: list[torch.Tensor] = []

    def hold(self, module: nn.Module | None, name: str, passed: bool = True) -> None:
        """Hold ``module``'s parameter ``name`` (absent too); pass its address if ``passed``."""
        tensor = None if module is None else module._parameters.get(name)
        if module is not None:
            address = 0 if tensor is None else tensor.data_ptr()
            self.checks.keep(module._parameters, name, tensor, address)
        if passed:
            self.pointers.append(0 if tensor is None else tensor.data_ptr())

    def descriptor(self, module: QuantLinear, held: _Checks | None = None) -> list[int]:
        """A quantized projection's descriptor, its layout and bias held (in ``held``): its
        cpu_qmatmul view (each step checks that the module still holds it: invalidate_layouts,
        a move or load_state_dict drops it)."""
        held = held or self.checks
        packed = module._native_layout()
        bias = module.bias  # held absent too: one set after the build sends steps back
        held.keep(module._buffers, "bias", bias, 0 if bias is None else bias.data_ptr())
        held.quantize(module, packed)
        z, zc, st, groups, group, s_stride = packed.arguments()
        return [
            self.qmm or 0, cpu_qmatmul.KINDS[packed.kind], packed.w.data_ptr(),
            packed.s.data_ptr(), z, st, groups, group, 0 if bias is None else bias.data_ptr(),
            packed.k, int.from_bytes(struct.pack("<f", zc), "little"), s_stride,
        ]  # fmt: skip

    def describe(self, module: nn.Module | None) -> None:
        """A projection's descriptor slot: 0 for a float one, else patched in ``tensors``."""
        if not isinstance(module, QuantLinear):
            self.pointers.append(0)
            return
        self.patches.append((len(self.pointers), len(self.descriptors)))
        self.pointers.append(0)
        self.descriptors.append(self.descriptor(module))

    def layer(
        self,
        parts: DecodeParts,
        cache: torch.Tensor | QuantizedKVCache | RecurrentCache,
        group: int,
    ) -> None:
        """One decoder layer's entries (``LayerPointer`` order in ``native/cpu_ops.cpp``)."""
        self.num_layers += 1
        hold = self.hold
        attn, mamba, mlp = parts.attn, parts.mamba, parts.mlp
        sparse = mlp if isinstance(mlp, SparseMoeBlock) else None
        dense = _dense(mlp)  # (or a sparse block's shared expert)
        into, out = _mixer_projections(parts)
        hold(parts.norm, "weight")
        hold(into, "weight")
        hold(into, "bias")
        hold(out, "weight")
        hold(parts.post_norm, "weight")
        hold(None if dense is None else dense.gate_up_proj, "weight")
        hold(None if dense is None else dense.down_proj, "weight")
        hold(None if attn is None else attn.q_norm, "weight")
        hold(None if attn is None else attn.k_norm, "weight")
        for module in (dense.gate_up_proj, dense.down_proj) if dense else ():
            hold(module, "bias", passed=False)
        if isinstance(cache, RecurrentCache):
            self.pointers += [0] * 5
        else:
            self.pointers += _cache_pointers(cache)
        for mixer_proj in (into, out):
            self.describe(mixer_proj)
        self.describe(None if dense is None else dense.gate_up_proj)
        self.describe(None if dense is None else dense.down_proj)
        self._sparse(sparse)
        self._mamba(mamba, cache)
        self.pointers[-2:] = _deltanet_widths(parts.deltanet) or self.pointers[-2:]
        self.pointers += [ssm_ops.float_bits(parts.residual), int(parts.rope)]
        self.pointers += [int(parts.offset), int(parts.gelu)]
        hold(parts.mixer_out_norm, "weight")
        hold(parts.mlp_out_norm, "weight")
        self._tables(None if attn is None or attn.rotary is self.rotary else attn.rotary)
        self.pointers.append(group if attn is not None else 0)
        hold(out, "bias")  # (attention's o_proj has none but gpt-oss's: _expected_shapes)
        self._parallel(parts)
        _qwen3_next_entries(self, parts, cache)
        entries, kept = oss_layer_entries(parts, cache, self.checks)  # gpt-oss's (or 0s)
        self.pointers += entries
        self.oss += kept
        self._deepseek(parts, sparse, dense)

    def _parallel(self, parts: DecodeParts) -> None:
        """A row's Falcon-H1 entries (``decode_falcon_h1.h``): 1 for a parallel layer's
        attention row, 2 for its mixer's (0 for any other layer), the row's mixer's (in, out)
        multipliers, the mixer's in_proj sections (their descriptor, or 0) and the MLP's (gate,
        down) multipliers (1 where the row has none)."""
        bits = ssm_ops.float_bits
        if not parts.parallel:
            self.pointers += [0, bits(1.0), bits(1.0), 0, bits(1.0), bits(1.0)]
            return
        mixer = parts.attn is None
        multipliers = parts.mamba_multipliers if mixer else parts.attn_multipliers
        sections = 0
        if mixer and parts.mamba_sections:
            entries = [len(parts.mamba_sections)]
            for lo, hi, m in parts.mamba_sections:
                entries += [lo, hi, bits(m)]
            held = torch.tensor(entries, dtype=torch.int64)
            self.sections.append(held)
            sections = held.data_ptr()
        mlp = parts.mlp_multipliers if mixer else (1.0, 1.0)
        self.pointers += [1 + int(mixer), *map(bits, multipliers), sections, *map(bits, mlp)]

    def _tables(self, rotary: RotaryEmbedding | None) -> None:
        """A layer's own RoPE tables (Gemma's sliding layers), held; 0, 0 for the step's."""
        if rotary is None:
            self.pointers += [0, 0]
            return
        for name in ("cos", "sin"):
            table = rotary._buffers[name]
            assert table is not None
            self.checks.keep(rotary._buffers, name, table, table.data_ptr())
            self.pointers.append(table.data_ptr())

    def _mamba(
        self, mixer: Mamba2Mixer | None, cache: torch.Tensor | QuantizedKVCache | RecurrentCache
    ) -> None:
        """A Mamba-2 layer's descriptor (its pools and small parameters, as ``mamba_decode``
        reads them), in_proj's outputs and out_proj's inputs (all 0 for attention). The
        parameters its float32 copies are made of are held at their addresses and versions."""
        if mixer is None or not isinstance(cache, RecurrentCache):
            self.pointers += [0, 0, 0]
            return
        params = mixer._decode_params()
        small = [mixer.conv1d, mixer.norm]
        for module in small:
            if module is not None:
                for name, tensor in module._parameters.items():
                    self.checks.keep(module._parameters, name, tensor, _address(tensor))
                    self.checks.versioned(tensor)
        for name in ("dt_bias", "A_log", "D"):
            tensor = mixer._parameters[name]
            self.checks.keep(mixer._parameters, name, tensor, _address(tensor))
            self.checks.versioned(tensor)
        descriptor = torch.tensor(params.descriptor(cache), dtype=torch.int64)
        self.mamba_descriptors.append((descriptor, params))  # (their tensors stay alive)
        self.pointers.append(descriptor.data_ptr())
        s = mixer.shape
        self.pointers += [s.projection_size, s.intermediate_size]

    def _sparse(self, sparse: SparseMoeBlock | None) -> None:
        """A sparse layer's router, experts and counts, then its integers (all 0 if dense)."""
        experts = None if sparse is None else cast(Experts, sparse.experts)
        self.hold(None if sparse is None else sparse.gate, "weight")
        self.hold(experts, "gate_up_proj")
        self.hold(experts, "down_proj")
        if sparse is None or experts is None:
            self.pointers += [0] * 5
            return
        self.hold(sparse.gate, "bias", passed=False)
        counts = sparse.expert_tokens
        self.checks.keep(sparse._buffers, "expert_tokens", counts, counts.data_ptr())
        self.blocks.append(sparse)
        self.pointers.append(counts.data_ptr())
        renormalize = int(sparse.renormalize)
        inter = getattr(experts, "intermediate_size", 0)  # (gpt-oss's int8 experts: its own)
        self.pointers += [sparse.num_experts, sparse.top_k, renormalize, inter]

    def _deepseek(
        self, parts: DecodeParts, sparse: SparseMoeBlock | None, dense: GatedMLP | None
    ) -> None:
        """DeepSeek-V3's entries (kMla, kMoeGrouped, kMlpIntermediate): a latent attention's
        descriptor (``MlaSlot`` in native/decode_mla.h), a sparse block's grouped routing
        (``GroupedSlot``), the layer's own MLP size (0: the step's); each 0 where none."""
        latent = cast("LatentAttention | None", parts.latent)
        entries = [0, 0, 0]
        if latent is not None:
            entries[0] = self._held_descriptor(self._latent(latent))
            if dense is not None:
                entries[2] = int(dense.down_proj.in_features)
        if sparse is not None and sparse.e_score_correction_bias is not None:
            self.hold(sparse, "e_score_correction_bias", passed=False)
            _, _, bias, groups, topk_group, scaling = sparse.routing()
            bits = ssm_ops.float_bits(scaling)
            table = self._experts_table(sparse.experts)
            grouped = [bias.data_ptr(), groups, topk_group, bits, table]
            entries[1] = self._held_descriptor(grouped)
        self.pointers += entries

    def _experts_table(self, experts: nn.Module) -> int:
        """Quantized experts' table (``quant_moe_experts``: each expert's gate_up descriptor's
        address, then each one's down's), held; 0 for float experts."""
        if not isinstance(experts, QuantExperts):
            return 0
        projections = [*experts.gate_up, *experts.down]
        return self._held_descriptor([self._projection(q)[2] for q in projections])

    def _held_descriptor(self, values: list[int]) -> int:
        """The address of an int64 tensor of ``values``, held as long as the layout."""
        tensor = torch.tensor(values, dtype=torch.int64)
        self.latent_descriptors.append(tensor)
        return tensor.data_ptr()

    def _latent(self, latent: LatentAttention) -> list[int]:
        """A latent attention's ``MlaSlot`` entries, its tensors held (its quantized
        projections' descriptors too)."""
        address, project = self._address, self._projection
        entries = [*project(latent.q_a_proj), address(latent.q_a_layernorm, "weight")]
        q_b = project(latent.q_b_proj)  # (no bias)
        entries += [q_b[0], q_b[2], *project(latent.kv_a_proj_with_mqa)]
        entries.append(address(latent.kv_a_layernorm, "weight"))
        entries.append(self._address(latent.kv_b_proj, "weight"))
        q_rank = 0 if latent.q_a_proj is None else latent.q_a_proj.out_features
        entries += [q_rank, latent.rank, latent.rope, latent.nope, latent.v_head_dim]
        for norm in (latent.q_a_layernorm, latent.kv_a_layernorm):
            entries.append(ssm_ops.float_bits(1.0 if norm is None else norm.eps))
        return entries

    def _projection(self, proj: nn.Module | None) -> list[int]:
        """A projection's weight, bias and QuantSlot descriptor addresses (0: none), held."""
        if proj is None:
            return [0, 0, 0]
        quantized = proj if isinstance(proj, QuantLinear) else None
        descriptor = self._held_descriptor(self.descriptor(quantized)) if quantized else 0
        return [self._address(proj, "weight"), self._address(proj, "bias"), descriptor]

    def _address(self, module: nn.Module | None, name: str) -> int:
        """``module``'s parameter ``name``'s address (0: none), held."""
        self.hold(module, name, passed=False)
        tensor = None if module is None else module._parameters.get(name)
        return 0 if tensor is None else tensor.data_ptr()

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The descriptors ``[n, 12]`` and the pointers, each descriptor's address patched in."""
        descriptors = torch.tensor(self.descriptors, dtype=torch.int64).reshape(-1, 12)
        pointers = list(self.pointers)
        assert len(pointers) == self.num_layers * fused.decode_layer_pointers(), "drifted"
        for at, row in self.patches:
            pointers[at] = descriptors[row].data_ptr()
        return descriptors, torch.tensor(pointers, dtype=torch.int64)


class _Checks:
    """What a native step checks is as it was built, each kind of check one pass of C loops
    (``map``, ``all``, ``any``) over tuples made once. What the checks cost is the cache misses
    of the objects they touch, cold after the weights have streamed through (an int4 step's
    checks: 30-40 us warm, ~250 us cold), so they touch as few as they can: the hooks' dicts only
    when torch has made a hook handle since they were last seen empty (``_handles``).

    ``empty``: the dicts that must stay empty: a leaf's children, and the parameters or buffers
    of a module where the C++ assumes entries absent and there are none at all (checking the
    whole dict is empty is one look, and stricter than the names). ``hooks``: the modules' hook
    dicts, which must stay empty too. The dict objects themselves are held: hooks put into a
    dict that replaced a module's own (``m._forward_hooks = {...}``), or put into one without
    a handle (``m._forward_hooks[k] = f``), which torch never does, go unseen. ``children``:
    modules' children dicts and their entries as built. ``entries``: (dict, name, what it held
    at the build, ``_MISSING`` if absent) that must hold the same object: the tensors whose
    address the call takes, the parameters it assumes absent (the biases the C++ does not add),
    and what a quantized projection's forward reads to choose its kernel (``_feeds_kernel``'s
    buffers and attributes, its cpu_qmatmul layout: invalidate_layouts, a move or
    load_state_dict drops it; and a quantized KV cache's ``codes`` and ``scales`` attributes).
    ``addresses``: (tensor, address) of every tensor the call reads, whose storage a ``set_`` or
    ``.data =`` could move under the same object (a quantized layout's codes and scales too:
    before, only the module's holding the layout was checked; the KV caches' tensors), and their
    dtypes. ``quantized``: the quantized projections and their layouts."""

    def __init__(self) -> None:
        self.empty: list[dict[Any, Any]] = []
        self.hooks: list[dict[Any, Any]] = []
        self._handles = -1  # RemovableHandle.next_id when the hooks were last seen empty
        self.children: list[tuple[dict[str, Any], dict[str, Any]]] = []
        self.quantized: list[tuple[QuantLinear, cpu_qmatmul.Packed]] = []
        self.entries: list[tuple[dict[str, Any], str, object]] = []
        self.addresses: list[tuple[torch.Tensor, int]] = []
        # parameters the call reads float32 copies of (a Mamba-2 mixer's small ones): their
        # versions as built (an in-place write since leaves the copies stale)
        self.versions: list[tuple[torch.Tensor, int]] = []
        self._emptied: set[int] = set()
        self._frozen: tuple[tuple[Any, ...], ...] | None = None  # the tuples, at the first step
        # (a step checks from another thread than the one that registers hooks: a handle taken
        # before its hook is in the dict may leave that hook unseen until the next handle)

    def watch(self, module: nn.Module) -> None:
        """``module``'s hooks stay empty, and its children if it has none."""
        self.hooks += [module._forward_hooks, module._forward_pre_hooks]
        if not module._modules:
            self._empty(module._modules)

    def keep(
        self, owner: dict[str, Any], name: str, tensor: torch.Tensor | None, address: int
    ) -> None:
        """Hold an entry and its address; an absent one in a dict with no entries at all as
        that dict staying empty."""
        if tensor is not None or owner:
            self.entry(owner, name)
            if tensor is not None:
                self.addresses.append((tensor, address))
        else:
            self._empty(owner)

    def entry(self, owner: dict[str, Any], name: str) -> None:
        """``owner[name]`` stays the object it is now (absent stays absent)."""
        self.entries.append((owner, name, owner.get(name, _MISSING)))

    def quantize(self, module: QuantLinear, packed: cpu_qmatmul.Packed) -> None:
        """A quantized projection run on ``packed``: its layout and what its forward reads to
        choose its kernel stay as built (``_feeds_kernel`` held them then), and the tensors of
        the layout where they are."""
        self.quantized.append((module, packed))
        for name in ("qweight", "input_scale", "perm"):
            self.entry(module._buffers, name)
        for name in ("compute_dtype", "_native"):
            self.entry(module.__dict__, name)
        for t in (packed.w, packed.s, packed.z):
            if t is not None:
                self.addresses.append((t, t.data_ptr()))

    def versioned(self, tensor: torch.Tensor | None) -> None:
        """``tensor`` is not written in place from now on."""
        if tensor is not None:
            self.versions.append((tensor, tensor._version))

    def _empty(self, d: dict[Any, Any]) -> None:
        if id(d) not in self._emptied:
            self._emptied.add(id(d))
            self.empty.append(d)

    def unchanged(self, dtype: torch.dtype) -> bool:
        """Whether everything is as built, for steps of ``dtype`` activations."""
        frozen = self._frozen
        if frozen is None:
            frozen = self._frozen = (
                tuple(now for now, _ in self.children),
                tuple(built for _, built in self.children),
                tuple(d for d, _, _ in self.entries),
                tuple(name for _, name, _ in self.entries),
                tuple(value for _, _, value in self.entries),
                tuple(t for t, _ in self.addresses),
                tuple(address for _, address in self.addresses),
                tuple(t.dtype for t, _ in self.addresses),
                tuple(t for t, _ in self.versions),
                tuple(v for _, v in self.versions),
            )
        now, built, dicts, names, values, tensors, addresses, dtypes, read, versions = frozen
        if any(self.empty) or not all(map(operator.eq, now, built)):
            return False
        handles = _handles()
        if handles != self._handles or handles < 0:
            if any(self.hooks):
                return False
            self._handles = handles
        if self.quantized and not uses_native_kernels(dtype):
            return False
        held = map(dict.get, dicts, names, itertools.repeat(_MISSING))
        if not all(map(operator.is_, held, values)):
            return False
        # (each tensor's dtype too, as the C++ reads it: ``.data =`` a view in another dtype
        # keeps the address; the lines are warm from the addresses)
        if tuple(map(_VERSION, read)) != versions:
            return False
        return tuple(map(_ADDRESS, tensors)) == addresses and tuple(map(_DTYPE, tensors)) == dtypes


_ADDRESS = torch.Tensor.data_ptr
_DTYPE = operator.attrgetter("dtype")
_VERSION = operator.attrgetter("_version")


def _address(tensor: torch.Tensor | None) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _handles() -> int:
    """How many hook handles torch has made (``RemovableHandle.next_id``: every
    ``register_forward_hook`` and the like takes the next id), -1 where it does not count them.
    While it stands still no hook was registered anywhere, so hook dicts seen empty stay empty,
    and a step need not look at them again: they are a cold cache line each after the weights
    have streamed through (some 300 dicts, ~30 us of a 5 ms int4 step, cold)."""
    count = getattr(RemovableHandle, "next_id", None)
    return count if isinstance(count, int) else -1


def _model_classes() -> tuple[type[nn.Module], ...]:
    """The models whose forward (embedding, layers, final norm) the call computes."""
    from foudre.models.bamba import BambaForCausalLM
    from foudre.models.deepseek_v3 import DeepseekV3ForCausalLM
    from foudre.models.falcon_h1 import FalconH1ForCausalLM
    from foudre.models.gemma3 import Gemma3ForCausalLM
    from foudre.models.gpt_oss import GptOssForCausalLM
    from foudre.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM
    from foudre.models.llama import LlamaForCausalLM
    from foudre.models.mamba2 import Mamba2ForCausalLM
    from foudre.models.phi3 import Phi3ForCausalLM
    from foudre.models.qwen3_next import Qwen3NextForCausalLM

    return (
        LlamaForCausalLM,
        Phi3ForCausalLM,
        Gemma3ForCausalLM,
        Mamba2ForCausalLM,
        BambaForCausalLM,
        GraniteMoeHybridForCausalLM,
        FalconH1ForCausalLM,
        Qwen3NextForCausalLM,
        GptOssForCausalLM,
        DeepseekV3ForCausalLM,
    )


def _llama_logits() -> Any:
    from foudre.models.llama import LlamaForCausalLM

    return LlamaForCausalLM.compute_logits


def _head_multiplier(model: LlamaForCausalLM) -> float | None:
    """What the model's ``compute_logits`` multiplies the head's float32 logits by: 1 for
    Llama's own, Falcon-H1's ``lm_head_multiplier``; None for another (Granite divides them)."""
    from foudre.models.falcon_h1 import FalconH1ForCausalLM

    compute = type(model).compute_logits
    if compute is _llama_logits():
        return 1.0
    if compute is FalconH1ForCausalLM.compute_logits:
        return float(model.config.lm_head_multiplier)
    return None


def _embedding_multiplier(model: LlamaForCausalLM) -> float:
    """What ``model.embed`` multiplies the embedding rows by (Granite 4.0's and Falcon-H1's
    ``embedding_multiplier``, Gemma's ``sqrt(hidden)`` in the model's dtype; 1 for the others)."""
    from foudre.models.falcon_h1 import FalconH1ForCausalLM
    from foudre.models.gemma3 import Gemma3ForCausalLM, embed_scale
    from foudre.models.granite_moe_hybrid import GraniteMoeHybridForCausalLM

    if isinstance(model, GraniteMoeHybridForCausalLM | FalconH1ForCausalLM):
        return float(model.config.embedding_multiplier)
    if isinstance(model, Gemma3ForCausalLM):
        return embed_scale(model.config.hidden_size, model.model.embed_tokens.weight.dtype)
    return 1.0


def _dense(mlp: nn.Module | None) -> GatedMLP | None:
    """A layer's dense MLP: the MLP itself, or a sparse block's shared expert."""
    if isinstance(mlp, SparseMoeBlock):
        return mlp.shared_expert
    return mlp if isinstance(mlp, GatedMLP) else None


def _intermediate(layers: Sequence[DecodeParts]) -> int:
    """The dense MLPs' intermediate size (shared experts' too; 0 without one):
    ``_shapes_supported`` checks that they all share it."""
    for p in layers:
        dense = _dense(p.mlp)
        if dense is not None:
            return int(dense.down_proj.in_features)
    return 0


def _cache_rows(layers: Sequence[DecodeParts]) -> list[DecodeParts]:
    """The rows of the call's table, one a cache entry: a layer's parts, or for a parallel
    layer (Falcon-H1: its KV cache at entry ``2 i``, its state at ``2 i + 1``) two rows, its
    attention's (its KV cache and group) then its Mamba-2 mixer's with the MLP (its state)."""
    rows: list[DecodeParts] = []
    for p in layers:
        if p.parallel:
            attn = dataclasses.replace(p, mamba=None, post_norm=None, mlp=None)
            rows += [attn, dataclasses.replace(p, attn=None)]
        else:
            rows.append(p)
    return rows


def _caches_supported(
    kv_caches: Sequence[Any], layers: Sequence[DecodeParts], dtype: torch.dtype, cfg: Any
) -> bool:
    """Whether every cache is one the kernels read: the attention layers' of one kind (float
    in ``dtype``, or codes with scales), contiguous ``[2, blocks, block_size, kv_heads,
    head_dim]`` on the CPU; the Mamba-2 layers' pools on the CPU, the conv window in ``dtype``,
    the state float32, each slot contiguous, all of as many slots."""
    if any(p.latent is not None for p in layers):
        return _latent_caches_supported(kv_caches, layers, dtype)
    kv = [c for c, p in zip(kv_caches, layers, strict=True) if p.attn is not None]
    states = [(c, _recurrent(p)) for c, p in zip(kv_caches, layers, strict=True) if _recurrent(p)]
    if len(kv) + len(states) != len(layers):
        return False
    if not all(_pool_supported(c, m, dtype) for c, m in states):
        return False
    if len({c.conv.shape[0] for c, _ in states}) > 1:
        return False
    if not kv:
        return True
    codes = _codes_dtype(kv[0])
    if cpu_paged.kernel(dtype, codes) is None:
        return False
    for c in kv:
        if not isinstance(c, torch.Tensor | QuantizedKVCache) or _codes_dtype(c) != codes:
            return False  # caches of several kinds
        stored = _stored(c)
        if isinstance(c, QuantizedKVCache):
            if c.dtype != dtype or not c.scales.is_contiguous() or not c.scales.is_cpu:
                return False
        elif stored.dtype != dtype:
            return False
        if not stored.is_contiguous() or stored.dim() != 5 or not stored.is_cpu:
            return False  # a layout the kernel does not read
        if tuple(stored.shape[-2:]) != (cfg.num_key_value_heads, cfg.head_dim):
            return False
    return True


def _pool_supported(
    cache: object, mixer: Mamba2Mixer | GatedDeltaNet | None, dtype: torch.dtype
) -> bool:
    """Whether ``cache`` is the pools of ``mixer``'s state as the C++ reads them: the conv
    windows in ``dtype`` and the states in float32, contiguous on the CPU, of its sizes."""
    if not isinstance(cache, RecurrentCache) or mixer is None:
        return False
    conv, ssm = cache
    if not (conv.is_cpu and ssm.is_cpu) or conv.dtype != dtype or ssm.dtype != torch.float32:
        return False
    spec = mixer.shape.state_spec()
    if tuple(conv.shape[1:]) != (spec.conv_window, spec.conv_dim):
        return False
    if tuple(ssm.shape[1:]) != (spec.num_heads, spec.head_dim, spec.state_size):
        return False
    return conv.is_contiguous() and ssm.is_contiguous() and conv.shape[0] == ssm.shape[0]


def _modules_supported(
    model: LlamaForCausalLM, layers: Sequence[DecodeParts], dtype: torch.dtype
) -> bool:
    """Whether every module of the decoder layers is one the C++ layers compute as its
    ``forward`` does: a layer that declares its parts (``decode_parts``), the part classes they
    know, quantized projections on ``cpu_qmatmul``, no hook, parameters contiguous in ``dtype``
    on the CPU, the model's norm epsilon."""
    from foudre.models.falcon_h1 import FalconH1Mixer, FalconH1MLP
    from foudre.models.gemma3 import GeGLUMLP, Gemma3Attention
    from foudre.models.gpt_oss import GptOssAttention
    from foudre.models.granite_moe_hybrid import GraniteAttention
    from foudre.models.llama import Attention

    allowed: tuple[type[nn.Module], ...] = (
        nn.ModuleList, Attention, GatedMLP, Linear, RMSNorm, RotaryEmbedding, SparseMoeBlock,
        Experts, QuantLinear, Mamba2Mixer, nn.Conv1d, GatedRMSNorm, GraniteAttention,
        Gemma3Attention, GeGLUMLP, OffsetRMSNorm, GptOssAttention, *_oss_experts_kinds(),
        *_latent_classes(),
        FalconH1Mixer, FalconH1MLP,  # (only in a parallel layer, whose parts say their multipliers)
    )  # fmt: skip
    allowed += _qwen3_next_classes()
    projections = _projections(model, layers)
    inside = _oss_inside(layers)  # (gpt-oss's int8 experts' projections: _oss_supported's)
    own_eps, float32 = _latent_exempt(layers)
    for module in model.model.layers.modules():
        if module in inside:
            continue
        if type(module) not in allowed and "decode_parts" not in type(module).__dict__:
            return False  # a replaced layer (quantized experts, ...)
        if isinstance(module, QuantLinear) and (
            module not in projections or not _runs_quantized(module, dtype, projections[module])
        ):
            return False
        if module._forward_hooks or module._forward_pre_hooks:
            return False  # someone watches the layers (calibration): keep them called
        for p in module.parameters(recurse=False):
            if p.dtype != (torch.float32 if id(p) in float32 else dtype):
                return False
            if not p.is_cpu or not p.is_contiguous():
                return False
        norm = isinstance(module, RMSNorm | OffsetRMSNorm) and module not in own_eps
        if norm and module.eps != model.config.rms_norm_eps:
            return False
    return True


def _shapes_supported(model: LlamaForCausalLM, layers: Sequence[DecodeParts]) -> bool:
    """Whether every layer holds exactly the parameters the C++ layers read, in their shapes
    (a bias the C++ lacks, or another shape: no), one attention scale, one
    intermediate size of the dense MLPs, and a sparse layer's counts as int64 on the CPU."""
    cfg = model.config
    attns = [p.attn for p in layers if p.attn is not None]
    if attns and any(a.scale != attns[0].scale for a in attns):
        return False
    for declared in layers:
        attn = declared.attn
        if attn is not None and attn.sinks is not None and not declared.attention_window:
            return False  # (sinks: gpt-oss's layers only)
    if not _latent_shapes_supported(model, layers):
        return False
    intermediate = _intermediate(layers)
    for layer, parts in zip(model.model.layers, layers, strict=True):
        dense = _dense(parts.mlp)
        inter = _own_intermediate(parts, intermediate)
        if dense is not None and (
            dense.gate_up_proj.out_features != 2 * inter or dense.down_proj.in_features != inter
        ):
            return False  # (the C++ runs one size: quantized projections have no weight shape)
        expected = _expected_shapes(layer, parts, cfg, inter)
        for name, p in layer.named_parameters():
            if tuple(p.shape) != expected.get(name):
                return False
        if isinstance(parts.mlp, SparseMoeBlock):  # the counts the C++ adds to
            counts = parts.mlp.expert_tokens
            if counts.dtype != torch.int64 or not counts.is_cpu or not counts.is_contiguous():
                return False
            if counts.shape != (cfg.num_experts,):
                return False
    return True


def _expected_shapes(
    layer: nn.Module, parts: DecodeParts, cfg: Any, intermediate: int
) -> dict[str, tuple[int, ...]]:
    """The shape of every parameter the C++ reads in ``layer``, by its name in ``layer``."""
    hidden, heads, kv_heads, head_dim = (
        cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
    )  # fmt: skip
    names = {module: name for name, module in layer.named_modules()}
    expected: dict[str, tuple[int, ...]] = {}

    def put(module: nn.Module | None, param: str, *shape: int) -> None:
        if module is not None:
            expected[f"{names[module]}.{param}".lstrip(".")] = shape

    for norm in (parts.norm, parts.post_norm, parts.mixer_out_norm, parts.mlp_out_norm):
        put(norm, "weight", hidden)
    attn, mamba, mlp = parts.attn, parts.mamba, parts.mlp
    if attn is not None:
        qkv = (heads + 2 * kv_heads) * head_dim
        put(attn.qkv_proj, "weight", qkv, hidden)
        put(attn.qkv_proj, "bias", qkv)
        put(attn.o_proj, "weight", hidden, heads * head_dim)
        put(attn.q_norm, "weight", head_dim)
        put(attn.k_norm, "weight", head_dim)
    if mamba is not None:
        s = mamba.shape
        put(mamba.in_proj, "weight", s.projection_size, hidden)
        put(mamba.in_proj, "bias", s.projection_size)
        put(mamba.conv1d, "weight", s.conv_dim, 1, s.conv_kernel)
        put(mamba.conv1d, "bias", s.conv_dim)
        for name in ("dt_bias", "A_log", "D"):
            put(mamba, name, s.num_heads)
        put(mamba.norm, "weight", s.intermediate_size)
        put(mamba.out_proj, "weight", hidden, s.intermediate_size)
        put(mamba.out_proj, "bias", hidden)
    _qwen3_next_shapes(parts, cfg, put)
    dense = _dense(mlp)
    if dense is not None:
        put(dense.gate_up_proj, "weight", 2 * intermediate, hidden)
        put(dense.down_proj, "weight", hidden, intermediate)
    if isinstance(mlp, SparseMoeBlock):  # the router and routed experts
        experts, inter = cfg.num_experts, cfg.moe_intermediate_size
        put(mlp.gate, "weight", experts, hidden)
        put(mlp.experts, "gate_up_proj", experts, 2 * inter, hidden)
        put(mlp.experts, "down_proj", experts, hidden, inter)
        put(
            mlp if mlp.e_score_correction_bias is not None else None,
            "e_score_correction_bias",
            experts,
        )
    _oss_shapes(put, parts, cfg)
    _latent_expected(parts, cfg, put)
    return expected


def _ends_supported(
    model: LlamaForCausalLM, dtype: torch.dtype, layers: Sequence[DecodeParts]
) -> bool:
    """Whether the embedding, the final norm and the RoPE tables (where a layer rotates) are
    what the call reads: a plain embedding (not vocabulary-parallel nor renormalising), an
    RMSNorm (or Gemma's) of the model's epsilon, no hook, ``dtype`` weights contiguous on the
    CPU, float32 tables of the rotated width, a layer's own as long as the step's."""
    cfg = model.config
    embed, norm = model.model.embed_tokens, model.model.norm
    if model.tp is not None or type(embed) is not nn.Embedding or embed.max_norm is not None:
        return False
    if not isinstance(norm, RMSNorm | OffsetRMSNorm) or norm.eps != cfg.rms_norm_eps:
        return False
    if type(norm) not in (RMSNorm, OffsetRMSNorm):
        return False  # (a subclass: another forward)
    for module, shape in ((embed, (cfg.vocab_size, cfg.hidden_size)), (norm, (cfg.hidden_size,))):
        w = module.weight
        if module._forward_hooks or module._forward_pre_hooks or tuple(w.shape) != shape:
            return False
        if w.dtype != dtype or not w.is_cpu or not w.is_contiguous():
            return False
    if not any(p.rope for p in layers):
        return True
    rotary = model.model.rotary  # the step's, whose rows the positions are checked against
    own = {id(p.attn.rotary): p.attn.rotary for p in layers if p.rope and p.attn is not None}
    for r in [rotary, *own.values()]:  # (Gemma's sliding layers: tables of their own)
        if type(r) is not RotaryEmbedding or r.rotary_dim != rotary.rotary_dim:
            return False
        for table in (r.cos, r.sin):
            if table.dtype != torch.float32 or not table.is_contiguous() or table.dim() != 2:
                return False
            if table.shape[1] != r.rotary_dim or not table.is_cpu:
                return False
            if table.shape[0] < rotary.cos.shape[0]:
                return False
    return True


def _stored(cache: torch.Tensor | QuantizedKVCache) -> torch.Tensor:
    """What holds a layer's K/V: the cache, or a quantized cache's codes."""
    return cache.codes if isinstance(cache, QuantizedKVCache) else cache


def _codes_dtype(cache: torch.Tensor | QuantizedKVCache) -> torch.dtype | None:
    """A quantized cache's codes as the kernels view them (int8, float8_e4m3fn); None if float."""
    return STORAGE_DTYPES[cache.kind] if isinstance(cache, QuantizedKVCache) else None


# the C++ layers' kind of KV cache (KVCodes in native/cpu_ops.cpp), by quantized kind
_KV_CODES = {"int8": 1, "fp8": 2}


def _projections(
    model: LlamaForCausalLM, layers: Sequence[DecodeParts]
) -> dict[nn.Module, tuple[int, int]]:
    """The decoder layers' projections (of ``layers``, their declared parts) the C++ layers
    may run quantized, with the (in, out) features they take."""
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    found: dict[nn.Module, tuple[int, int]] = {}
    inter = _intermediate(layers)  # the one size the C++ runs every dense MLP at
    for parts in layers:
        attn, mamba, mlp = parts.attn, parts.mamba, parts.mlp
        if attn is not None:
            found[attn.qkv_proj] = (cfg.hidden_size, q + 2 * kv)
            found[attn.o_proj] = (q, cfg.hidden_size)
        if mamba is not None:
            s = mamba.shape
            found[mamba.in_proj] = (cfg.hidden_size, s.projection_size)
            found[mamba.out_proj] = (s.intermediate_size, cfg.hidden_size)
        dense = _dense(mlp)
        own = _own_intermediate(parts, inter)
        if dense is not None:
            found[dense.gate_up_proj] = (cfg.hidden_size, 2 * own)
            found[dense.down_proj] = (own, cfg.hidden_size)
        found.update(_qwen3_next_projections(parts, cfg))
        found.update(_latent_projections(parts, cfg))
    return found


def _runs_quantized(mod: QuantLinear, dtype: torch.dtype, shape: tuple[int, int]) -> bool:
    """Whether the C++ layers compute ``mod`` as its ``forward`` does on ``dtype`` activations:
    one of the projections with the features expected (``shape``), on
    ``cpu_qmatmul`` (no activation cast, scaling or permutation first), a bias in ``dtype``."""
    if (mod.in_features, mod.out_features) != shape:
        return False
    return uses_native_kernels(dtype) and _feeds_kernel(mod, dtype)


def _feeds_kernel(mod: QuantLinear, dtype: torch.dtype) -> bool:
    """``_runs_quantized``'s checks of the module itself, at the build (each step then checks
    that what they read is the same: ``_Checks.quantize``). A name no longer a buffer (a
    Parameter assigned to it, or deleted) fails the check."""
    buffers = mod._buffers
    input_scale = buffers.get("input_scale", _MISSING)
    perm, bias = buffers.get("perm", _MISSING), buffers.get("bias", _MISSING)
    qweight = buffers.get("qweight")
    if mod.compute_dtype not in (None, dtype) or input_scale is not None or perm is not None:
        return False
    if qweight is None or not qweight.is_cpu:
        return False
    if bias is None:
        return True
    return isinstance(bias, torch.Tensor) and bias.dtype == dtype and bias.is_contiguous()


_MISSING = object()  # a buffer's name absent from ``_buffers``


def _cache_pointers(cache: torch.Tensor | QuantizedKVCache) -> list[int]:
    """A layer's cache entries for the C++ layers: K and V (a quantized cache's codes), their
    scales (0 without), and the kind of cache (0: float)."""
    if isinstance(cache, QuantizedKVCache):
        codes, scales = cache.codes, cache.scales
        return [
            codes[0].data_ptr(),
            codes[1].data_ptr(),
            scales[0].data_ptr(),
            scales[1].data_ptr(),
            _KV_CODES[cache.kind],
        ]
    return [cache[0].data_ptr(), cache[1].data_ptr(), 0, 0, 0]


# ---------------------------------------------------------------- Qwen3-Next


def _recurrent(parts: DecodeParts) -> Mamba2Mixer | GatedDeltaNet | None:
    """A layer's recurrent mixer (its state pools), if it has one."""
    return parts.mamba if parts.mamba is not None else parts.deltanet


def _deltanet_widths(delta: GatedDeltaNet | None) -> list[int] | None:
    """A gated DeltaNet's kMambaWidth (both its input projections' outputs, which the step's
    buffer holds one after the other) and kMambaInner (out_proj's inputs); None for others."""
    if delta is None:
        return None
    s = delta.shape
    return [2 * s.key_dim + 2 * s.value_dim + 2 * s.num_v_heads, s.value_dim]


def _qwen3_next_entries(
    layout: _Layout,
    parts: DecodeParts,
    cache: torch.Tensor | QuantizedKVCache | RecurrentCache,
) -> None:
    """A layer's Qwen3-Next entries (kDeltaNet .. kSharedGate in ``native/cpu_ops.cpp``): a
    gated DeltaNet's descriptor (``ssm_ops.DeltaNetDecodeParams``), its DeltaStep and
    in_proj_ba (float or quantized) and that one's outputs; the attention's output gate;
    the sparse block's shared-expert gate (all 0 where the layer has none)."""
    delta, hold = parts.deltanet, layout.hold
    if delta is not None and isinstance(cache, RecurrentCache):
        params = delta._decode_params()
        for owner, name in ((delta.conv1d, "weight"), (delta, "A_log"), (delta, "dt_bias")):
            tensor = owner._parameters[name]  # (read as float32 copies)
            layout.checks.keep(owner._parameters, name, tensor, _address(tensor))
            layout.checks.versioned(tensor)
        for module in (delta.conv1d, delta.in_proj_ba):
            hold(module, "bias", passed=False)
        norm_w = delta.norm._parameters["weight"]
        layout.checks.keep(delta.norm._parameters, "weight", norm_w, _address(norm_w))
        descriptor = torch.tensor(params.descriptor(cache), dtype=torch.int64)
        layout.deltanet_descriptors.append((descriptor, params))  # (their tensors stay alive)
        step = ssm_ops.deltanet_step_fn(delta.A_log.dtype) or 0
        layout.pointers += [descriptor.data_ptr(), step]
    else:
        layout.pointers += [0, 0]
    ba = None if delta is None else delta.in_proj_ba
    hold(ba, "weight")
    layout.describe(ba)
    layout.pointers.append(0 if delta is None else 2 * delta.shape.num_v_heads)
    hold(parts.output_gate, "weight")
    layout.describe(parts.output_gate)
    if parts.output_gate is not None:
        hold(parts.output_gate, "bias", passed=False)
    mlp = parts.mlp
    gate = mlp.shared_expert_gate if isinstance(mlp, SparseMoeBlock) else None
    hold(gate, "weight")
    if gate is not None:
        hold(gate, "bias", passed=False)


def _qwen3_next_classes() -> tuple[type[nn.Module], ...]:
    """The module classes of Qwen3-Next's layers the C++ layers compute."""
    from foudre.models.qwen3_next import GatedAttention

    return (GatedAttention, GatedDeltaNet, NormThenGate)


def _qwen3_next_shapes(parts: DecodeParts, cfg: Any, put: Any) -> None:
    """The shapes of the Qwen3-Next parameters the C++ reads (``put(module, name, *shape)``):
    a gated DeltaNet's, the attention's output gate, the shared expert's gate."""
    hidden, delta = cfg.hidden_size, parts.deltanet
    if delta is not None:
        s = delta.shape
        put(delta.in_proj_qkvz, "weight", 2 * s.key_dim + 2 * s.value_dim, hidden)
        put(delta.in_proj_ba, "weight", 2 * s.num_v_heads, hidden)
        put(delta.conv1d, "weight", s.conv_dim, 1, s.conv_kernel)
        for name in ("dt_bias", "A_log"):
            put(delta, name, s.num_v_heads)
        put(delta.norm, "weight", s.value_head_dim)
        put(delta.out_proj, "weight", hidden, s.value_dim)
    put(parts.output_gate, "weight", cfg.num_attention_heads * cfg.head_dim, hidden)
    mlp = parts.mlp
    if isinstance(mlp, SparseMoeBlock):
        put(mlp.shared_expert_gate, "weight", 1, hidden)


def _qwen3_next_projections(parts: DecodeParts, cfg: Any) -> dict[nn.Module, tuple[int, int]]:
    """A layer's Qwen3-Next projections the C++ may run quantized, with their (in, out)."""
    found: dict[nn.Module, tuple[int, int]] = {}
    hidden, delta = cfg.hidden_size, parts.deltanet
    if delta is not None:
        s = delta.shape
        found[delta.in_proj_qkvz] = (hidden, 2 * s.key_dim + 2 * s.value_dim)
        found[delta.in_proj_ba] = (hidden, 2 * s.num_v_heads)
        found[delta.out_proj] = (s.value_dim, hidden)
    if parts.output_gate is not None:
        found[parts.output_gate] = (hidden, cfg.num_attention_heads * cfg.head_dim)
    return found


# DeepSeek-V3's multi-head latent attention (``DecodeParts.latent``): native/decode_mla.h


def _mixer_projections(parts: DecodeParts) -> tuple[nn.Module | None, nn.Module]:
    """A layer's mixer's input and output projections at kQKV and kO: attention's q|k|v and
    o_proj, a Mamba-2 mixer's in_proj and out_proj, a gated DeltaNet's in_proj_qkvz and
    out_proj, a latent attention's o_proj alone (its others are in its descriptor)."""
    if parts.attn is not None:
        return parts.attn.qkv_proj, parts.attn.o_proj
    if parts.latent is not None:
        return None, cast("LatentAttention", parts.latent).o_proj
    if parts.deltanet is not None:
        return parts.deltanet.in_proj_qkvz, parts.deltanet.out_proj
    mamba = cast(Mamba2Mixer, parts.mamba)
    return mamba.in_proj, mamba.out_proj


def _latent_classes() -> tuple[type[nn.Module], ...]:
    """DeepSeek-V3's modules the C++ runs (quantized experts only in its sparse blocks:
    ``_latent_shapes_supported``)."""
    from foudre.models.deepseek_v3 import LatentAttention, LatentProjection

    return LatentAttention, LatentProjection, QuantExperts


def _latents(layers: Sequence[DecodeParts]) -> list[LatentAttention]:
    return [cast("LatentAttention", p.latent) for p in layers if p.latent is not None]


def _latent_scale(layers: Sequence[DecodeParts], scale: float) -> float:
    """The latent attention's softmax scale (``_latent_shapes_supported``: one for all), else
    ``scale``."""
    latents = _latents(layers)
    return latents[0].scale if latents else scale


def _latent_exempt(layers: Sequence[DecodeParts]) -> tuple[set[nn.Module], set[int]]:
    """The norms whose epsilon the C++ takes from the module (the latent attention's, of their
    own epsilon) and the ids of the parameters it reads in float32 whatever the model's dtype
    (a DeepSeek-V3 router's correction bias)."""
    norms: set[nn.Module] = set()
    for latent in _latents(layers):
        norms.add(latent.kv_a_layernorm)
        if latent.q_a_layernorm is not None:
            norms.add(latent.q_a_layernorm)
    float32 = {
        id(p.mlp.e_score_correction_bias)
        for p in layers
        if isinstance(p.mlp, SparseMoeBlock) and p.mlp.e_score_correction_bias is not None
    }
    return norms, float32


def _own_intermediate(parts: DecodeParts, intermediate: int) -> int:
    """A layer's dense MLP size: a latent layer's own (kMlpIntermediate: DeepSeek-V3's dense
    first layers and shared experts differ), the step's one size for the others."""
    dense = _dense(parts.mlp)
    if parts.latent is None or dense is None:
        return intermediate
    return int(dense.down_proj.in_features)


def _latent_shapes_supported(model: LlamaForCausalLM, layers: Sequence[DecodeParts]) -> bool:
    """Whether the latent attention layers are what the C++ runs: every layer of the model
    one (no other mixer beside them), one softmax scale, the model's RoPE tables over the
    rope parts, RMSNorms of the plain kind, and sparse blocks routed by DeepSeek's sigmoid
    (the only ones with a correction bias) only there."""
    latents = _latents(layers)
    sigmoid = [
        p for p in layers if isinstance(p.mlp, SparseMoeBlock) and p.mlp.scoring == "sigmoid"
    ]
    if not latents:  # (quantized experts: DeepSeek's, and gpt-oss's: cpu_decode_gpt_oss)
        quantized = [
            p
            for p in layers
            if not p.attention_window
            and isinstance(p.mlp, SparseMoeBlock)
            and type(p.mlp.experts) is QuantExperts
        ]
        return not sigmoid and not quantized
    if len(latents) != len(layers) or any(
        p.mamba is not None or p.attn is not None for p in layers
    ):
        return False
    rotary = model.model.rotary
    for latent in latents:
        if latent.scale != latents[0].scale or latent.rotary is not rotary:
            return False
        if rotary.rotary_dim != latent.rope or latent.rope % 2:
            return False
        norms = (latent.q_a_layernorm, latent.kv_a_layernorm)
        if any(n is not None and type(n) is not RMSNorm for n in norms):
            return False
    for p in sigmoid:
        block = cast(SparseMoeBlock, p.mlp)
        if not block._grouped_native() or block.shared_expert_gate is not None:
            return False
        if type(block.experts) is not Experts and not _silu_quantized(block.experts):
            return False
    for p in layers:  # a softmax-routed block there: float experts only (the plain moe_block)
        mlp = p.mlp
        softmax = isinstance(mlp, SparseMoeBlock) and mlp.scoring != "sigmoid"
        if softmax and type(cast(SparseMoeBlock, mlp).experts) is not Experts:
            return False
    return True


def _silu_quantized(experts: nn.Module) -> bool:
    """Whether ``experts`` are ``QuantExperts`` as ``quant_moe_experts`` runs them: SiLU
    between the projections, no biases (each projection's kernel checked with the others')."""
    if type(experts) is not QuantExperts or experts.activation is not silu_mul:
        return False
    return all(cast(QuantLinear, q).bias is None for q in [*experts.gate_up, *experts.down])


def _latent_expected(parts: DecodeParts, cfg: Any, put: Any) -> None:
    """The shapes of a latent attention's parameters, by ``_expected_shapes``' ``put``."""
    latent = cast("LatentAttention | None", parts.latent)
    if latent is None:
        return
    hidden, heads = cfg.hidden_size, latent.num_heads
    rank, d = latent.rank, latent.rank + latent.rope
    q_in = hidden
    if latent.q_a_proj is not None and latent.q_a_layernorm is not None:
        q_in = latent.q_a_proj.out_features
        put(latent.q_a_proj, "weight", q_in, hidden)
        put(latent.q_a_proj, "bias", q_in)
        put(latent.q_a_layernorm, "weight", q_in)
    put(latent.q_b_proj, "weight", heads * latent.qk_head_dim, q_in)
    put(latent.kv_a_proj_with_mqa, "weight", d, hidden)
    put(latent.kv_a_proj_with_mqa, "bias", d)
    put(latent.kv_a_layernorm, "weight", rank)
    put(latent.kv_b_proj, "weight", heads * (latent.nope + latent.v_head_dim), rank)
    put(latent.o_proj, "weight", hidden, heads * latent.v_head_dim)
    put(latent.o_proj, "bias", hidden)


def _latent_projections(parts: DecodeParts, cfg: Any) -> dict[nn.Module, tuple[int, int]]:
    """A latent attention's projections the C++ may run quantized, with their (in, out)."""
    latent = cast("LatentAttention | None", parts.latent)
    if latent is None:
        return {}
    hidden, heads = cfg.hidden_size, latent.num_heads
    found: dict[nn.Module, tuple[int, int]] = {}
    q_in = hidden
    if latent.q_a_proj is not None:
        q_in = latent.q_a_proj.out_features
        found[latent.q_a_proj] = (hidden, q_in)
    found[latent.q_b_proj] = (q_in, heads * latent.qk_head_dim)
    found[latent.kv_a_proj_with_mqa] = (hidden, latent.rank + latent.rope)
    found[latent.o_proj] = (heads * latent.v_head_dim, hidden)
    experts = parts.mlp.experts if isinstance(parts.mlp, SparseMoeBlock) else None
    if isinstance(experts, QuantExperts):  # (_silu_quantized checks the rest)
        inter = experts.intermediate_size
        found.update((q, (hidden, 2 * inter)) for q in experts.gate_up)
        found.update((q, (inter, hidden)) for q in experts.down)
    return found


def _latent_caches_supported(
    kv_caches: Sequence[Any], layers: Sequence[DecodeParts], dtype: torch.dtype
) -> bool:
    """Whether every layer's cache is latent pages the C++ reads: float in ``dtype`` (no
    quantized cache), ``[2, blocks, block_size, 1, rank + rope]`` on the CPU, K and V the same
    contiguous pages (``LatentAttentionSpec.allocate``), all of one shape."""
    if cpu_paged.kernel(dtype) is None:
        return False
    shapes = set()
    for cache, parts in zip(kv_caches, layers, strict=True):
        latent = cast("LatentAttention | None", parts.latent)
        if latent is None or type(cache) is not torch.Tensor:
            return False
        if cache.dtype != dtype or not cache.is_cpu or cache.dim() != 5:
            return False
        if tuple(cache.shape[-2:]) != (1, latent.rank + latent.rope):
            return False
        if cache[0].data_ptr() != cache[1].data_ptr() or not cache[0].is_contiguous():
            return False
        shapes.add(tuple(cache.shape))
    return len(shapes) == 1
