"""What the engine keeps beside each ``Request``: its detokenizer, prompt text, output index and
group, and what it belongs to when its outputs are not its own (``best_of`` samples, beams)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from foudre.engine.beam import BeamSearch
from foudre.engine.request import Request
from foudre.loading.detokenizer import IncrementalDetokenizer
from foudre.outputs import RequestOutput


@dataclass(eq=False)
class BestOf:
    """The samples of one prompt when ``best_of`` > ``n``: their final outputs are held until all
    are in, then the ``n`` of highest cumulative log-probability leave under the visible ids."""

    visible_ids: list[str]
    base_index: int
    num_samples: int
    show_logprobs: bool
    finals: list[RequestOutput] = field(default_factory=list)


@dataclass(slots=True)
class Tracked:
    """Engine-side companions of a request."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer | None
    index: int = 0
    group_id: str | None = None
    best_of: BestOf | None = None
    beam: BeamSearch | None = None
    final_only: bool = False  # its caller reads finished outputs only: none built before


class Owner(Protocol):
    """What the engine's core calls for a request, whoever handles its outputs: the output
    processor for ordinary requests and samples, the beam driver for beams."""

    def tokens(
        self, tracked: Tracked, tokens: list[int], lps: list[dict[int, float]] | None
    ) -> list[RequestOutput]:
        """A step's new tokens (and their log-probabilities); the outputs to hand out."""
        ...

    def abort(self, tracked: Tracked) -> list[RequestOutput]: ...

    def fail(self, tracked: Tracked, message: str) -> list[RequestOutput]: ...

    def preempted(self, tracked: Tracked) -> None: ...
