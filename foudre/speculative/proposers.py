"""Proposers: cheap guesses of a request's next tokens, verified by the target afterwards.

Every engine step, before scheduling, the engine asks the proposer for drafts for each running
request that has caught up (only its last sampled token is left to compute). A proposer returns
one ``Draft`` per request: at most the number of tokens asked, possibly none, and the
distributions it drew them from (None: deterministic, i.e. one-hot). Proposers read requests
through ``SpecRequest`` and keep their own state by request id; they never write the engine's
requests.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from foudre.attention import AttentionBackend
from foudre.models.llama import LlamaForCausalLM
from foudre.runner.model_runner import ModelRunner
from foudre.sample.sampler import SamplingRow, draw, warp_probs


class SpecRequest(SamplingRow, Protocol):
    """What a proposer reads of a request (``engine.Request`` is one)."""

    @property
    def request_id(self) -> str: ...
    @property
    def prompt_token_ids(self) -> list[int]: ...
    @property
    def cache_salt(self) -> str | None: ...
    def token_ids_range(self, start: int, end: int) -> list[int]: ...


class BlockManager(Protocol):
    """The paged-KV bookkeeping a draft model needs for its own cache (``KVCacheManager``)."""

    block_size: int

    def get_computed_blocks(self, request: Any) -> tuple[list[Any], int]: ...
    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        computed_blocks: list[Any] | None = None,
        num_final_tokens: int | None = None,
    ) -> bool: ...
    def free(self, request: Any) -> None: ...
    def block_ids(self, request_id: str) -> list[int]: ...


@dataclass(slots=True)
class Draft:
    """Proposed tokens for one request and the distributions they were drawn from ([k, vocab];
    None: one-hot at each token)."""

    token_ids: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None


@dataclass(slots=True, eq=False)
class _Shadow:
    """The draft model's view of a request in its own cache: the target's token lists, shared
    (so the draft sees new tokens), and its own count of computed tokens."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    cache_salt: str | None = None  # the target's: the draft's prefix cache is partitioned alike
    num_computed_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_range(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]


class Proposer(ABC):
    name = "abstract"

    def __init__(self, num_speculative_tokens: int) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(
                f"num_speculative_tokens must be positive, got {num_speculative_tokens}"
            )
        self.num_speculative_tokens = num_speculative_tokens

    @abstractmethod
    def propose(self, requests: Sequence[SpecRequest], max_drafts: Sequence[int]) -> list[Draft]:
        """Up to ``max_drafts[i]`` draft tokens for ``requests[i]`` (each ``>= 1``)."""

    def free(self, request_id: str) -> None:  # noqa: B027 (optional hook)
        """Forget the request (finished, aborted or preempted)."""


class NgramProposer(Proposer):
    """Prompt lookup: find the longest recent n-gram (``ngram_max`` down to ``ngram_min``) that
    ends the sequence and occurred earlier; propose the tokens that followed its latest earlier
    occurrence. No model, no state: strong on copy-heavy work (summaries, edits, code)."""

    name = "ngram"

    def __init__(self, num_speculative_tokens: int, ngram_min: int = 1, ngram_max: int = 4):
        super().__init__(num_speculative_tokens)
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(
                f"need 1 <= ngram_min <= ngram_max, got ngram_min={ngram_min}, "
                f"ngram_max={ngram_max}"
            )
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """The (at most ``k``) tokens that followed the latest earlier match of the suffix."""
        n_tok = len(tokens)
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.ngram_max, n_tok - 1), self.ngram_min - 1, -1):
            # windows starting at 0 .. n_tok - n - 1: every occurrence but the suffix itself
            windows = sliding_window_view(arr[: n_tok - 1], n)
            hits = np.flatnonzero((windows == arr[n_tok - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return arr[start : start + k].tolist()
        return []

    def propose(self, requests: Sequence[SpecRequest], max_drafts: Sequence[int]) -> list[Draft]:
        return [
            Draft(self.lookup(req.all_token_ids, k))
            for req, k in zip(requests, max_drafts, strict=True)
        ]


class DraftModelProposer(Proposer):
    """A small model with the target's tokenizer, with its own paged KV cache.

    Per request, the draft's cache (``kv``, a block manager of its own) holds a shadow that
    shares the target's token lists. Each proposal first catches the draft up on the tokens it
    has not computed (the whole prompt the first time, then the one or two tokens the last
    verification added), drawing draft 1 from the last position, then runs ``k - 1``
    single-token steps; all requests go in one batch per step. Drafts that the target rejected
    are rolled back lazily at the next proposal, by comparing them with the tokens the request
    actually got.
    """

    name = "draft"

    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        num_speculative_tokens: int,
        kv: BlockManager,
        num_blocks: int,
        device: torch.device,
        dtype: torch.dtype,
        target_vocab_size: int,
        seed: int = 0,
        decode_graphs: bool = False,
        max_num_seqs: int = 256,
        max_model_len: int | None = None,
    ) -> None:
        super().__init__(num_speculative_tokens)
        self.model = model
        self.vocab_size = target_vocab_size
        # a draft with a smaller (padded) vocabulary never sees ids it has no embedding for
        self._max_input_id = model.config.vocab_size - 1
        self.kv = kv
        self.runner = ModelRunner(
            model,
            backend,
            num_blocks,
            kv.block_size,
            device,
            dtype,
            seed,
            decode_graphs=decode_graphs,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        )
        self.generator = torch.Generator(device=device).manual_seed(seed + 1)
        self._shadows: dict[str, _Shadow] = {}
        self._last: dict[str, tuple[int, list[int]]] = {}  # request id -> (num_tokens, drafts)

    def free(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        self._last.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def _prepare(self, req: SpecRequest, k: int) -> _Shadow | None:
        """Roll the shadow back to what is still valid and reserve slots for this proposal."""
        n = req.num_tokens
        shadow = self._shadows.get(req.request_id)
        hits = None
        num_cached = 0
        if shadow is None:
            shadow = _Shadow(
                req.request_id, req.prompt_token_ids, req.output_token_ids, req.cache_salt
            )
            hits, num_cached = self.kv.get_computed_blocks(shadow)
            shadow.num_computed_tokens = 0
            need = n - num_cached + k - 1
        else:
            n0, drafts = self._last[req.request_id]
            actual = req.token_ids_range(n0, min(n, n0 + len(drafts) - 1))
            m = 0
            while m < len(actual) and actual[m] == drafts[m]:
                m += 1
            shadow.num_computed_tokens = min(shadow.num_computed_tokens, n0 + m, n - 1)
            need = n + k - 1 - shadow.num_computed_tokens
        if not self.kv.allocate_slots(shadow, need, hits, num_final_tokens=n):
            if hits is not None:
                self.kv.free(shadow)  # drops the hashes computed for the lookup
            return None
        if hits is not None:
            shadow.num_computed_tokens = num_cached
            self._shadows[req.request_id] = shadow
        return shadow

    def _draw(
        self, logits: torch.Tensor, reqs: Sequence[SpecRequest]
    ) -> tuple[list[int], list[torch.Tensor | None]]:
        """One draft token per row; its distribution (None for greedy requests)."""
        v = self.vocab_size
        if logits.shape[1] > v:
            logits = logits[:, :v]
        elif logits.shape[1] < v:
            pad = logits.new_full((logits.shape[0], v - logits.shape[1]), float("-inf"))
            logits = torch.cat([logits, pad], dim=1)
        params = [r.sampling_params for r in reqs]
        tokens = logits.argmax(dim=-1)
        probs: torch.Tensor | None = None
        if not all(p.greedy for p in params):
            probs = warp_probs(logits, params)
            sampled = draw(probs, [r.generator for r in reqs], self.generator)
            is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
            tokens = torch.where(is_greedy, tokens, sampled)
        rows = [None if p.greedy or probs is None else probs[i] for i, p in enumerate(params)]
        return tokens.tolist(), rows

    @torch.inference_mode()
    def propose(self, requests: Sequence[SpecRequest], max_drafts: Sequence[int]) -> list[Draft]:
        active: list[tuple[SpecRequest, _Shadow, int]] = []
        for req, k in zip(requests, max_drafts, strict=True):
            shadow = self._prepare(req, k)
            if shadow is not None:
                active.append((req, shadow, k))
        if not active:
            return [Draft() for _ in requests]
        drafts: dict[str, list[int]] = {r.request_id: [] for r, _, _ in active}
        dists: dict[str, list[torch.Tensor | None]] = {r.request_id: [] for r, _, _ in active}
        # step 0 catches up; step j feeds draft j back in
        step = active
        for j in range(max(k for _, _, k in active)):
            step = [(r, s, k) for r, s, k in step if k > j]
            tables = [self.kv.block_ids(s.request_id) for _, s, _ in step]
            starts = [s.num_computed_tokens for _, s, _ in step]
            if j == 0:
                inputs = [
                    r.token_ids_range(s.num_computed_tokens, r.num_tokens) for r, s, _ in step
                ]
            else:
                inputs = [[drafts[r.request_id][-1]] for r, _, _ in step]
            if self._max_input_id < self.vocab_size - 1:
                inputs = [[min(t, self._max_input_id) for t in ids] for ids in inputs]
            logits = self.runner.forward(tables, starts, inputs, [1] * len(step))
            assert logits is not None
            tokens, rows = self._draw(logits, [r for r, _, _ in step])
            for (r, s, _), ids, t, q in zip(step, inputs, tokens, rows, strict=True):
                s.num_computed_tokens += len(ids)
                drafts[r.request_id].append(t)
                dists[r.request_id].append(q)
        out = []
        for req in requests:
            proposed = drafts.get(req.request_id)
            if proposed is None:  # no room in the draft's cache: no drafts this step
                out.append(Draft())
                continue
            dist = dists[req.request_id]
            probs = None if dist[0] is None else torch.stack([d for d in dist if d is not None])
            out.append(Draft(proposed, probs))
            self._last[req.request_id] = (req.num_tokens, proposed)
        return out
