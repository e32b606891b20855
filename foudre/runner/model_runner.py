"""Owns the model and the KV-cache tensors; turns a ``SchedulerOutput`` into sampled tokens.

One ``execute`` = one forward over the flattened new tokens of every scheduled request, then
logits only at the positions that sample (the last token of each request that has caught up with
its prompt and output, plus every draft position when it verifies speculative tokens), then one
batched ``sample`` (or ``verify`` when drafts are present).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from foudre.engine.kv_cache import KVCacheManager
from foudre.engine.request import Request
from foudre.layers.sampler import sample
from foudre.models.llama import LlamaForCausalLM
from foudre.runner.attention import AttentionBackend, BatchLayout
from foudre.runner.attention.kv_quant import QuantizedKVCache, kv_bytes_per_token_head
from foudre.runner.cpu_decode import NativeDecode
from foudre.spec.rejection import verify

if TYPE_CHECKING:
    from foudre.runner.cuda_graphs import DecodeGraphs


def kv_bytes_per_block(
    model: LlamaForCausalLM, block_size: int, dtype: torch.dtype, kv_cache_dtype: str = "auto"
) -> int:
    cfg = model.config
    per = kv_bytes_per_token_head(cfg.head_dim, kv_cache_dtype, dtype)
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * per


@dataclass(slots=True)
class StepOutput:
    """Per request that sampled: its new tokens (one, or accepted drafts plus one)."""

    requests: list[Request]
    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]] | None]
    num_draft_tokens: list[int]  # drafts verified per request (0 without speculation)
    num_accepted: list[int]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        kv_cache_dtype: str = "auto",
        decode_graphs: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        cfg = model.config
        heads, dim = cfg.num_key_value_heads, cfg.head_dim
        # one block past the pool, never handed out: the scratch K/V of padding rows
        self.padding_block = num_blocks
        self.kv_caches: list[torch.Tensor] | list[QuantizedKVCache]
        if kv_cache_dtype == "auto":
            shape = (2, num_blocks + 1, block_size, heads, dim)
            self.kv_caches = [
                torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)
            ]
        else:
            self.kv_caches = [
                QuantizedKVCache(
                    num_blocks + 1, block_size, heads, dim, kv_cache_dtype, dtype, device
                )
                for _ in range(cfg.num_hidden_layers)
            ]
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # decode steps skip the op-by-op forward where the device and the backend allow it:
        # replayed CUDA graphs on a GPU, the decoder layers in one native call on the CPU
        self.graphs: DecodeGraphs | None = None
        self.native: NativeDecode | None = None
        if decode_graphs and device.type == "cuda" and backend.name == "triton":
            from foudre.runner.cuda_graphs import DecodeGraphs

            max_len = max_model_len or cfg.max_position_embeddings
            self.graphs = DecodeGraphs(self, max_num_seqs, max_len)
        if decode_graphs and device.type == "cpu":
            self.native = NativeDecode.build(model, backend, self.kv_caches)

    @torch.inference_mode()
    def forward(
        self,
        block_tables: Sequence[list[int]],
        starts: Sequence[int],
        token_ids: Sequence[list[int]],
        num_logits: Sequence[int],
    ) -> torch.Tensor | None:
        """Compute ``token_ids[i]`` at positions ``starts[i]...`` of sequence ``i`` (writing
        their K/V through ``block_tables[i]``); return float32 logits of the last
        ``num_logits[i]`` tokens of each sequence, in order (None when none are asked).

        A step of single tokens replays a captured CUDA graph when the runner has them, or runs
        the native decoder layers on the CPU (``cpu_decode.py``)."""
        graphs = self.graphs
        if (
            graphs is not None
            and 0 < len(token_ids) <= graphs.max_batch
            and all(len(ids) == 1 for ids in token_ids)
            and max(len(t) for t in block_tables) <= graphs.max_blocks
        ):
            wanted = [i for i, n in enumerate(num_logits) if n]
            if not wanted:
                return None
            hidden = graphs.run(block_tables, starts, [ids[0] for ids in token_ids])
            if len(wanted) < len(token_ids):
                hidden = hidden[torch.tensor(wanted, device=self.device)]
            return self.model.compute_logits(hidden)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        seq_lens: list[int] = []
        rows: list[int] = []
        for table, start, ids, n_logits in zip(
            block_tables, starts, token_ids, num_logits, strict=True
        ):
            end = start + len(ids)
            input_ids.extend(ids)
            pos = torch.arange(start, end)
            slots.append(torch.tensor(table)[pos // bs] * bs + pos % bs)
            positions.append(pos)
            seq_lens.append(end)
            rows.extend(range(len(input_ids) - n_logits, len(input_ids)))
        layout = BatchLayout(
            query_lens=[len(ids) for ids in token_ids],
            seq_lens=seq_lens,
            block_tables=list(block_tables),
            slot_mapping=torch.cat(slots),
            block_size=bs,
        )
        metadata = self.backend.build_metadata(layout, self.device)
        id_tensor = torch.tensor(input_ids, device=self.device)
        pos_tensor = torch.cat(positions).to(self.device)
        if self.native is not None and self.native.takes(metadata, len(input_ids)):
            hidden = self.native.run(id_tensor, pos_tensor, metadata)
        else:
            hidden = self.model(id_tensor, pos_tensor, self.kv_caches, self.backend, metadata)
        if not rows:
            return None
        return self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])

    @torch.inference_mode()
    def execute(
        self,
        requests: Sequence[Request],
        num_new_tokens: Sequence[int],
        kv: KVCacheManager,
        num_padding_rows: int = 0,
    ) -> StepOutput:
        """Compute the scheduled tokens; return the requests that sampled and their tokens.

        ``num_padding_rows`` throw-away rows (one token each, logits included, K/V written to
        the scratch block) are added to the batch, as a rectangular batch computes the rows of
        its finished members; their results are dropped.
        """
        tables, starts, tokens, num_logits = [], [], [], []
        samplers: list[Request] = []
        for req, n in zip(requests, num_new_tokens, strict=True):
            start = req.num_computed_tokens
            end = start + n
            tables.append(kv.block_ids(req.request_id))
            starts.append(start)
            tokens.append(req.input_token_ids(start, end))
            # a request samples once it reaches its last token; every draft adds one position
            n_logits = end - req.num_tokens + 1 if end >= req.num_tokens else 0
            num_logits.append(n_logits)
            if n_logits:
                assert n_logits == len(req.spec_token_ids) + 1, "drafts scheduled partially"
                samplers.append(req)
        for _ in range(num_padding_rows):
            tables.append([self.padding_block])
            starts.append(0)
            tokens.append([0])
            num_logits.append(1)
        logits = self.forward(tables, starts, tokens, num_logits)
        if logits is not None and num_padding_rows:
            logits = logits[: logits.shape[0] - num_padding_rows]
        if logits is None or logits.shape[0] == 0:
            return StepOutput([], [], [], [], [])
        if not any(r.spec_token_ids for r in samplers):
            out = sample(logits, samplers, self.generator)
            lps = [None if lp is None else [lp] for lp in out.logprobs]
            zeros = [0] * len(samplers)
            return StepOutput(samplers, [[t] for t in out.token_ids], lps, zeros, zeros)
        v = verify(logits, samplers, self.generator)
        return StepOutput(samplers, v.token_ids, v.logprobs, v.num_draft_tokens, v.num_accepted)
