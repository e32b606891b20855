"""``EngineStats``: the engine's counters since it started, reported by ``LLMEngine.metrics``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class EngineStats:
    """Counters since the engine started (reported by ``LLMEngine.metrics``)."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    peak_kv_cache_usage: float = 0.0
    peak_running: int = 0  # most sequences running at once
    num_model_steps: int = 0  # target forwards run
    num_padding_tokens: int = 0  # throw-away tokens of rectangular batches (static/dynamic)
    num_scheduled_last_step: int = 0  # 0 while requests wait on a batching policy or blocks
    num_step_failures: int = 0  # steps whose forward raised (their requests were isolated)
    num_failed_requests: int = 0  # requests that failed a step alone (finish_reason "error")
    consecutive_step_failures: int = 0
    spec_num_drafts: int = 0  # verifications with at least one draft token
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_position: list[int] = field(default_factory=list)  # at position 1..k

    def record_spec(self, num_draft: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_draft_tokens += num_draft
        self.spec_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.spec_accepted_per_position[j] += 1

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["spec_accepted_per_position"] = list(self.spec_accepted_per_position)
        # tokens per verification step: accepted drafts plus the target's own token
        out["spec_mean_acceptance_length"] = (
            1.0 + self.spec_accepted_tokens / self.spec_num_drafts if self.spec_num_drafts else 0.0
        )
        return out
