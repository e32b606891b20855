"""Per-request latency statistics from the engine's outputs, with the usual definitions.

- TTFT: first token time - arrival time
- ITL: gaps between a request's successive token-bearing outputs
- TPOT: (last token time - first token time) / (output tokens - 1)
- E2E: finished time - arrival time
- queue time: first scheduled time - arrival time
"""

from __future__ import annotations

from dataclasses import dataclass, field

from foudre.outputs import RequestOutput


@dataclass(slots=True)
class RequestEvents:
    """What one output tells about latency: ITL gaps it closes, and when the request finished,
    its whole-request figures (``None`` where undefined, e.g. TTFT of a request aborted before
    its first token)."""

    itl: list[float] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    queue_time: float | None = None
    num_output_tokens: int = 0


class RequestStatsTracker:
    """Turns the stream of outputs (all requests interleaved) into ``RequestEvents``.

    Keeps the last token time of each unfinished request; single-threaded (call it from the
    engine thread only).
    """

    def __init__(self) -> None:
        self._last_token_time: dict[str, float] = {}

    def update(self, out: RequestOutput) -> RequestEvents:
        ev = RequestEvents()
        m = out.metrics
        comp = out.outputs[0] if out.outputs else None
        if m is None or comp is None:
            return ev
        rid = out.request_id
        if comp.delta_token_ids and m.last_token_time is not None:
            prev = self._last_token_time.get(rid)
            if prev is not None:
                ev.itl.append(m.last_token_time - prev)
            self._last_token_time[rid] = m.last_token_time
        if not out.finished:
            return ev
        self._last_token_time.pop(rid, None)
        ev.finished = True
        ev.finish_reason = comp.finish_reason
        ev.num_output_tokens = len(comp.token_ids)
        if m.first_token_time is not None:
            ev.ttft = m.first_token_time - m.arrival_time
        if m.first_scheduled_time is not None:
            ev.queue_time = m.first_scheduled_time - m.arrival_time
        if m.finished_time is not None:
            ev.e2e = m.finished_time - m.arrival_time
        n = ev.num_output_tokens
        if n > 1 and m.first_token_time is not None and m.last_token_time is not None:
            ev.tpot = (m.last_token_time - m.first_token_time) / (n - 1)
        return ev
