"""A plain driver around a hybrid model (Mamba layers and paged attention layers), outside the
engine: the model oracles of ``test_bamba.py``, ``test_granite_moe_hybrid.py`` and
``test_falcon_h1.py`` drive the models through it, a cache per ``kv_cache_specs`` entry
(Falcon-H1 has two a layer); the engine's own runs: ``tests/engine/test_recurrent.py``."""

from __future__ import annotations

from typing import Any

import torch

from foudre.attention import TorchSDPABackend
from foudre.attention.base import BatchLayout
from foudre.attention.cache_spec import RecurrentCache, RecurrentStateSpec
from foudre.layers.mamba import RecurrentBatch, RecurrentStates
from foudre.models.bamba import BambaForCausalLM
from foudre.models.falcon_h1 import FalconH1ForCausalLM
from tests.oracles.ssm_models import hf_logits, prompt, step_metadata

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


def check_mixed_batch(hf: Any, model: Any, long: int = 30) -> None:
    """Rows mid-prefill, starting and decoding in the same forwards (one of ``long`` tokens)
    give transformers' logits of each whole sequence."""
    prompts = [prompt(n, 10 + n) for n in (13, 4, long, 9)]
    driver = HybridDriver(model, 4, max(32, long))
    got: list[list[torch.Tensor]] = [[] for _ in prompts]
    cut = long - 10
    plan = [
        {0: (0, 6), 2: (0, cut)},
        {0: (6, 10), 1: (0, 1), 2: (cut, cut + 7), 3: (0, 6)},
        *(
            {
                0: (10 + i, 11 + i),
                1: (1 + i, 2 + i),
                2: (cut + 7 + i, cut + 8 + i),
                3: (6 + i, 7 + i),
            }
            for i in range(3)
        ),
    ]
    for step in plan:
        rows = [(r, prompts[r][a:b]) for r, (a, b) in step.items()]
        for r, out in zip(step, driver.step(rows), strict=True):
            got[r].append(out)
    for r, p in enumerate(prompts):
        torch.testing.assert_close(torch.cat(got[r]), hf_logits(hf, p), atol=1e-4, rtol=0)


def check_greedy_forked(hf: Any, model: Any, steps: int = 10) -> None:
    """Prompts of different lengths decoded together, one of them forked (n = 2): greedy ids
    of transformers' ``generate``."""
    prompts = [prompt(n, 20 + n) for n in (5, 17, 33, 150)]
    want = []
    for p in prompts:
        out = hf.generate(torch.tensor([p]), max_new_tokens=steps, do_sample=False)
        want.append(out[0, len(p) :].tolist())
    driver = HybridDriver(model, 5, 160)
    logits = driver.step(list(enumerate(prompts)))
    got = [[int(lg[-1].argmax())] for lg in logits]
    driver.fork(1, 4)
    got.append(list(got[1]))
    for _ in range(steps - 1):
        logits = driver.step([(r, [g[-1]]) for r, g in enumerate(got)])
        for g, lg in zip(got, logits, strict=True):
            g.append(int(lg[-1].argmax()))
    assert got[:4] == want
    assert got[4] == want[1]


def check_chunked_prefill(hf: Any, model: Any, sizes: tuple[int, ...]) -> None:
    """A prompt of ``sum(sizes)`` tokens computed in chunks of those sizes (ones: decode
    steps): every position's logits are transformers' over the whole sequence."""
    ids = prompt(sum(sizes), 3)
    driver = HybridDriver(model, 1, sum(sizes) + 2)
    got, at = [], 0
    for size in sizes:
        (out,) = driver.step([(0, ids[at : at + size])])
        got.append(out)
        at += size
    torch.testing.assert_close(torch.cat(got), hf_logits(hf, ids), atol=1e-4, rtol=0)
