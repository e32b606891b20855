"""Which running requests draft tokens this step, and how many: the engine's side of speculative
decoding (the proposers themselves are in ``foudre.speculative``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from foudre.config import EngineConfig
from foudre.engine.request import Request
from foudre.speculative.proposers import Proposer

logger = logging.getLogger("foudre")


def propose(
    proposer: Proposer, running: Sequence[Request], max_model_len: int, config: EngineConfig
) -> None:
    """Drafts for every running request that has caught up, as many as it may still use.
    A proposer that fails costs its drafts, not the requests: they verify none this step."""
    k = proposer.num_speculative_tokens
    limit = config.speculative_max_batch_size
    # a full batch drafts nothing: the draft catches up when the batch shrinks
    drafting = limit is None or len(running) <= limit
    reqs, limits = [], []
    for req in running:
        req.clear_spec()
        if not drafting:
            continue
        if req.num_tokens - req.num_computed_tokens != 1 or req.fork_children:
            continue  # still prefilling, or its samples fork from its next position
        p = req.sampling_params
        # a step emits up to drafts + 1 tokens: stay within max_tokens and max_model_len
        room = max_model_len - req.num_tokens - 1
        if p.max_tokens is not None:
            room = min(room, p.max_tokens - len(req.output_token_ids) - 1)
        if room >= 1:
            reqs.append(req)
            limits.append(min(k, room))
    if not reqs:
        return
    try:
        for req, draft in zip(reqs, proposer.propose(reqs, limits), strict=True):
            req.spec_token_ids = draft.token_ids
            req.spec_probs = draft.probs
    except Exception:
        logger.exception("the proposer failed; no drafts this step")
        for req in running:
            req.clear_spec()
            proposer.free(req.request_id)
