"""Beam search driven on top of the engine core: each beam is an ordinary request in the batch;
once every live beam of a search has reported its candidates, the driver applies the selection
rule (``BeamSearch.advance``) through the scheduler's interface: a surviving beam takes its
token, extra survivors are forked from their parent (sharing its KV blocks), pruned beams finish.
The search's one output (its hypotheses, best first) leaves when it ends. The driver is the
``Owner`` of every beam: the core hands it their steps, aborts and failures."""

from __future__ import annotations

from foudre.engine.beam import BeamSearch, Survivor
from foudre.engine.output_processor import OutputProcessor
from foudre.engine.request import Request, RequestStatus
from foudre.engine.scheduler import Scheduler
from foudre.engine.tracked import Tracked
from foudre.loading.tokenizer import Tokenizer
from foudre.outputs import CompletionOutput, RequestOutput


class BeamDriver:
    def __init__(
        self, scheduler: Scheduler, outputs: OutputProcessor, tokenizer: Tokenizer | None
    ) -> None:
        self.scheduler = scheduler
        self.outputs = outputs
        self.tokenizer = tokenizer

    # -- the Owner of every beam: the core's calls ---------------------------------------------
    def tokens(
        self, tracked: Tracked, tokens: list[int], lps: list[dict[int, float]] | None
    ) -> list[RequestOutput]:
        """A beam's step reports its top next tokens with their log-probabilities (its sampled
        token is not kept: the selection picks); the search's final output when it ends."""
        search = tracked.beam
        assert search is not None and lps is not None
        if search.report(tracked.request, lps[0]):
            return self.advance(search)
        return []

    def abort(self, tracked: Tracked) -> list[RequestOutput]:
        assert tracked.beam is not None
        return [self.end(tracked.beam, "abort")]

    def fail(self, tracked: Tracked, message: str) -> list[RequestOutput]:
        """A beam that fails fails its whole search."""
        assert tracked.beam is not None
        out = self.end(tracked.beam, "error", message)
        out.error_code, out.error_params = tracked.request.error_code, tracked.request.error_params
        return [out]

    def preempted(self, tracked: Tracked) -> None:
        """A preempted beam reports again once recomputed."""
        assert tracked.beam is not None
        tracked.beam.reported.pop(tracked.request.request_id, None)

    # -- the search ----------------------------------------------------------------------------

    def advance(self, search: BeamSearch) -> list[RequestOutput]:
        """Every live beam has reported: select the next beams (forking and pruning requests),
        or end the search with its final output."""
        survivors = search.advance()
        if survivors is None:
            return [self.end(search, None)]
        by_parent: dict[str, list[Survivor]] = {}
        for s in survivors:
            by_parent.setdefault(s.parent.request_id, []).append(s)
        placed: dict[int, Request] = {}  # survivor position -> its request
        for beam in list(search.beams):
            mine = by_parent.get(beam.request_id)
            if not mine:  # pruned
                del search.scores[beam.request_id]
                self.scheduler.finish(beam, RequestStatus.FINISHED_ABORTED)
                self.outputs.retire(self.outputs.tracked[beam.request_id])
                continue
            for extra in mine[1:]:  # forked before the parent takes its own token
                placed[id(extra)] = self._fork(search, beam, extra)
            first = mine[0]
            beam.output_token_ids.append(first.token)
            search.scores[beam.request_id] = first.cum_logprob
            placed[id(first)] = beam
        search.cohort.members[:] = [placed[id(s)] for s in survivors]
        self.outputs.stats.generation_tokens += len(survivors)
        return []

    def _fork(self, search: BeamSearch, parent: Request, survivor: Survivor) -> Request:
        parent_tracked = self.outputs.tracked[parent.request_id]
        child = Request(
            search.next_beam_id(),
            parent.prompt_token_ids,
            parent.sampling_params,
            parent.eos_token_ids,
            arrival_time=parent.arrival_time,
            cache_salt=parent.cache_salt,
        )
        child.output_token_ids = [*parent.output_token_ids, survivor.token]
        child.first_scheduled_time = parent.first_scheduled_time
        child.cohort = search.cohort
        tracked = Tracked(child, parent_tracked.prompt, None, search.index, parent_tracked.group_id)
        tracked.beam = search
        self.outputs.track(tracked)
        search.cohort.members.append(child)
        search.scores[child.request_id] = survivor.cum_logprob
        self.scheduler.fork(parent, child)
        return child

    def end(
        self, search: BeamSearch, reason: str | None, error: str | None = None
    ) -> RequestOutput:
        """Free every live beam; the search's one final output: its hypotheses, best first
        (``reason`` "abort" or "error": none, that finish reason)."""
        first = search.beams[0] if search.beams else None
        tracked = self.outputs.tracked.get(first.request_id) if first is not None else None
        status = (
            RequestStatus.FINISHED_ERROR if reason == "error" else RequestStatus.FINISHED_ABORTED
        )
        for beam in list(search.beams):
            if not beam.is_finished:
                self.scheduler.finish(beam, status, uncache=reason == "error")
            beam_tracked = self.outputs.tracked.get(beam.request_id)
            if beam_tracked is not None:
                self.outputs.retire(beam_tracked)
        return RequestOutput(
            request_id=search.visible_id,
            prompt=tracked.prompt if tracked is not None else None,
            prompt_token_ids=first.prompt_token_ids if first is not None else [],
            outputs=self._hypotheses(search, reason),
            finished=True,
            error=error,
        )

    def _hypotheses(self, search: BeamSearch, reason: str | None) -> list[CompletionOutput]:
        base = search.index * search.width
        if reason is not None:
            return [CompletionOutput(index=base, finish_reason=reason)]
        tok = self.tokenizer
        return [
            CompletionOutput(
                index=base + i,
                text=tok.decode(h.token_ids, skip_special_tokens=True) if tok else "",
                token_ids=h.token_ids,
                finish_reason=h.finish_reason,
                cumulative_logprob=h.cum_logprob,
                score=h.score,
            )
            for i, h in enumerate(search.finished)
        ]
