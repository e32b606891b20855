"""Owns the model and the KV-cache tensors; turns a ``SchedulerOutput`` into sampled tokens.

One ``execute`` = one forward over the flattened new tokens of every scheduled request, then
logits only at the positions that sample (the last token of each request that has caught up with
its prompt and output), then one batched ``sample``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from foudre.engine.kv_cache import KVCacheManager
from foudre.engine.request import Request
from foudre.layers.sampler import SamplerOutput, sample
from foudre.models.llama import LlamaForCausalLM
from foudre.runner.attention import AttentionBackend, BatchLayout


def kv_bytes_per_block(model: LlamaForCausalLM, block_size: int, dtype: torch.dtype) -> int:
    cfg = model.config
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


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
    ) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        cfg = model.config
        shape = (2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)
        ]
        self.generator = torch.Generator(device=device).manual_seed(seed)

    @torch.inference_mode()
    def execute(
        self, requests: Sequence[Request], num_new_tokens: Sequence[int], kv: KVCacheManager
    ) -> tuple[list[Request], SamplerOutput | None]:
        """Compute the scheduled tokens; return the requests that sampled and their samples."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        samplers: list[Request] = []
        for req, n in zip(requests, num_new_tokens, strict=True):
            start = req.num_computed_tokens
            end = start + n
            input_ids.extend(req.token_ids_range(start, end))
            pos = torch.arange(start, end)
            table = kv.block_ids(req.request_id)
            slots.append(torch.tensor(table)[pos // bs] * bs + pos % bs)
            positions.append(pos)
            seq_lens.append(end)
            tables.append(table)
            if end == req.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                samplers.append(req)
        layout = BatchLayout(
            query_lens=list(num_new_tokens),
            seq_lens=seq_lens,
            block_tables=tables,
            slot_mapping=torch.cat(slots),
            block_size=bs,
        )
        metadata = self.backend.build_metadata(layout, self.device)
        hidden = self.model(
            torch.tensor(input_ids, device=self.device),
            torch.cat(positions).to(self.device),
            self.kv_caches,
            self.backend,
            metadata,
        )
        if not samplers:
            return [], None
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, device=self.device)])
        return samplers, sample(logits, samplers, self.generator)
