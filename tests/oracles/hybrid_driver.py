"""A plain driver around a hybrid model (Mamba layers and paged attention layers), outside the
engine: the model oracles of ``test_bamba.py``, ``test_granite_moe_hybrid.py`` and
``test_falcon_h1.py`` drive the models through it, a cache per ``kv_cache_specs`` entry
(Falcon-H1 has two a layer); the engine's own runs: ``tests/engine/test_recurrent.py``."""

from __future__ import annotations

import torch

from foudre.attention import TorchSDPABackend
from foudre.attention.base import BatchLayout
from foudre.attention.cache_spec import RecurrentCache, RecurrentStateSpec
from foudre.layers.mamba import RecurrentBatch, RecurrentStates
from foudre.models.bamba import BambaForCausalLM
from foudre.models.falcon_h1 import FalconH1ForCausalLM
from tests.oracles.ssm_models import step_metadata

BLOCK = 4


class HybridDriver:
    """Per request a state slot and ``max_len / BLOCK`` KV blocks (a
    scattered permutation of the pool); ``step`` runs one forward over rows ``(request, new
    ids)`` and returns the logits of every new token, per row."""

    def __init__(
        self, model: BambaForCausalLM | FalconH1ForCausalLM, requests: int, max_len: int
    ) -> None:
        self.model = model
        per = -(-max_len // BLOCK)
        blocks = torch.randperm(requests * per, generator=torch.Generator().manual_seed(0))
        self.tables = [blocks[i * per : (i + 1) * per].tolist() for i in range(requests)]
        self.specs = model.kv_cache_specs()
        self.states = RecurrentStates.of_model(model, requests)
        recurrent = iter(self.states.caches)
        self.caches = [
            next(recurrent)
            if isinstance(s, RecurrentStateSpec)
            else torch.zeros(s.page_shape(requests * per, BLOCK))
            for s in self.specs
        ]
        self.slots = [self.states.allocate() for _ in range(requests)]
        self.computed = [0] * requests
        self.backend = TorchSDPABackend()

    def fork(self, parent: int, child: int) -> None:
        """``child`` continues ``parent``: its state copied, its KV copied into its own blocks
        (the driver's stand-in for blocks shared by reference)."""
        self.states.free(self.slots[child])
        self.slots[child] = self.states.fork(self.slots[parent])
        for cache in self.caches:
            if isinstance(cache, RecurrentCache):
                continue
            for a, b in zip(self.tables[parent], self.tables[child], strict=True):
                cache[:, b] = cache[:, a]
        self.computed[child] = self.computed[parent]

    def step(
        self,
        rows: list[tuple[int, list[int]]],
        snapshots: list[tuple[int, int, int]] | None = None,
    ) -> list[torch.Tensor]:
        """``snapshots``: the ``RecurrentBatch``'s (row, offset, slot) to fill."""
        lens = [len(ids) for _, ids in rows]
        positions, slot_mapping = [], []
        for req, ids in rows:
            for p in range(self.computed[req], self.computed[req] + len(ids)):
                positions.append(p)
                slot_mapping.append(self.tables[req][p // BLOCK] * BLOCK + p % BLOCK)
        layout = BatchLayout(
            query_lens=lens,
            seq_lens=[self.computed[r] + len(ids) for r, ids in rows],
            block_tables=[self.tables[r] for r, _ in rows],
            slot_mapping=torch.tensor(slot_mapping),
            block_size=BLOCK,
        )
        metadata = self.backend.build_metadata(layout, torch.device("cpu"))
        batch = RecurrentBatch.of_lengths(
            lens, [self.slots[r] for r, _ in rows], torch.device("cpu"), snapshots
        )
        ids = torch.tensor([t for _, new in rows for t in new])
        with torch.no_grad():
            hidden = self.model(
                ids,
                torch.tensor(positions),
                self.caches,
                self.backend,
                step_metadata(self.specs, metadata, batch),
            )
            logits = self.model.compute_logits(hidden)
        for r, ids_ in rows:
            self.computed[r] += len(ids_)
        return list(logits.split(lens))
