"""The output processor: what becomes of a request's new tokens. It appends them, advances the
request's grammar, decides whether it stops (``stop.check_stop``, then the detokenizer's stop
strings), detokenizes incrementally, builds ``RequestOutput``s, and merges ``best_of`` samples
into their ``n`` best. It also keeps the table of live requests (``tracked``) and of groups
(``groups``: a submission's unfinished members), which the engine and the beam driver share.
It is the ``Owner`` of every request but beams: the core hands it their tokens, aborts and
failures."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from foudre.engine.request import RequestStatus
from foudre.engine.stats import EngineStats
from foudre.engine.stop import check_stop
from foudre.engine.tracked import BestOf, Tracked
from foudre.errors import GrammarDeadEndError
from foudre.outputs import CompletionOutput, RequestMetrics, RequestOutput
from foudre.sampling_params import SamplingParams

Finish = Callable[..., None]  # (request, status, uncache=False): the scheduler's finish


class OutputProcessor:
    def __init__(self, max_model_len: int, stats: EngineStats, finish: Finish) -> None:
        self.max_model_len = max_model_len
        self.stats = stats
        self.finish = finish  # the scheduler's: frees a finished request's blocks
        self.tracked: dict[str, Tracked] = {}
        self.groups: dict[str, list[str]] = {}  # group id -> its unfinished members

    def track(self, tracked: Tracked) -> None:
        rid = tracked.request.request_id
        self.tracked[rid] = tracked
        if tracked.group_id is not None:
            self.groups.setdefault(tracked.group_id, []).append(rid)

    def retire(self, tracked: Tracked) -> None:
        """Forget a finished, aborted or failed request, and drop it from its group (once)."""
        if self.tracked.pop(tracked.request.request_id, None) is None or tracked.group_id is None:
            return
        children = self.groups.get(tracked.group_id, [])
        if tracked.request.request_id in children:
            children.remove(tracked.request.request_id)
        if not children:
            self.groups.pop(tracked.group_id, None)

    def end(
        self, tracked: Tracked, status: RequestStatus, uncache: bool = False
    ) -> list[RequestOutput]:
        """Finish a request now (its blocks return to the pool), retire it; its last output."""
        if not tracked.request.is_finished:
            self.finish(tracked.request, status, uncache=uncache)
        self.retire(tracked)
        return self.emit(tracked, self.output(tracked, [], ""))

    def abort(self, tracked: Tracked) -> list[RequestOutput]:
        return self.end(tracked, RequestStatus.FINISHED_ABORTED)

    def fail(self, tracked: Tracked, message: str) -> list[RequestOutput]:
        """Finish a request with ``finish_reason "error"``; its blocks leave the prefix cache.
        Samples not forked from it yet share its prompt: they fail with it, not one by one
        later. A request that had finished before the failure fails all the same."""
        req = tracked.request
        unforked = [self.tracked[c.request_id] for c in req.fork_children if not c.is_finished]
        req.fork_children = []
        outputs = []
        for child in unforked:
            child.request.error = message
            child.request.error_code, child.request.error_params = req.error_code, req.error_params
            outputs += self.end(child, RequestStatus.FINISHED_ERROR)
        if req.is_finished:
            req.status = RequestStatus.FINISHED_ERROR
        return outputs + self.end(tracked, RequestStatus.FINISHED_ERROR, uncache=True)

    def preempted(self, tracked: Tracked) -> None:
        """Nothing to undo: its tokens stay, it is recomputed."""

    def tokens(
        self, tracked: Tracked, tokens: list[int], lps: list[dict[int, float]] | None
    ) -> list[RequestOutput]:
        """Take a step's new tokens of one request (several after a verification); the outputs
        to hand out (none before the last for a ``final_only`` request). Tokens after a stop
        are dropped; a finished request is retired."""
        req = tracked.request
        delta = ""
        status = None
        emitted: list[int] = []
        for i, token in enumerate(tokens):
            if req.grammar is not None and not req.grammar.accept(token):  # kept out of the output
                raise GrammarDeadEndError(token, grammar_conflict(req.sampling_params))
            req.output_token_ids.append(token)
            emitted.append(token)
            self.stats.generation_tokens += 1
            if lps is not None:
                req.logprobs.append(lps[i])
                req.cumulative_logprob += lps[i][token]
            stop = check_stop(req, token, self.max_model_len)
            if stop is not None:
                status, req.stop_reason = stop
            if tracked.detok is not None:
                if status is None or req.stop_reason is None:  # stop tokens are not shown
                    delta += tracked.detok.add_tokens([token])
                if tracked.detok.stopped_by is not None:
                    status = RequestStatus.FINISHED_STOPPED
                    req.stop_reason = tracked.detok.stopped_by
                elif status is not None:
                    delta += tracked.detok.flush()
            if status is not None:
                break
        if status is not None:
            self.finish(req, status)
            self.retire(tracked)
        elif tracked.final_only:
            return []
        return self.emit(tracked, self.output(tracked, emitted, delta))

    def output(self, tracked: Tracked, delta_ids: list[int], delta_text: str) -> RequestOutput:
        """The request's output as it stands, with what this step added."""
        req = tracked.request
        finish = req.status.value if req.is_finished else None
        show_logprobs = req.sampling_params.logprobs is not None
        comp = CompletionOutput(
            index=tracked.index,
            text=tracked.detok.text if tracked.detok is not None else "",
            token_ids=list(req.output_token_ids),
            finish_reason=finish,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if show_logprobs else None,
            cumulative_logprob=req.cumulative_logprob if show_logprobs else None,
            delta_text=delta_text,
            delta_token_ids=delta_ids,
        )
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=req.first_scheduled_time,
            first_token_time=req.first_token_time,
            last_token_time=req.last_token_time,
            finished_time=time.monotonic() if finish else None,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            num_preemptions=req.num_preemptions,
        )
        return RequestOutput(
            request_id=req.request_id,
            prompt=tracked.prompt,
            prompt_token_ids=req.prompt_token_ids,
            outputs=[comp],
            finished=finish is not None,
            metrics=metrics,
            num_cached_tokens=max(req.num_cached_tokens, 0),
            error=req.error,
            error_code=req.error_code,
            error_params=req.error_params,
        )

    def emit(self, tracked: Tracked, out: RequestOutput) -> list[RequestOutput]:
        """The outputs to hand out for ``out``: itself, or for a best_of sample nothing until
        the last sample is final, then the ``n`` best under the visible ids."""
        best = tracked.best_of
        if best is None:
            return [out]
        if not out.finished:
            return []
        if any(o.request_id == out.request_id for o in best.finals):
            return []  # already in (a sample that failed after finishing)
        best.finals.append(out)
        if len(best.finals) < best.num_samples:
            return []
        return _best_of(best)


def grammar_conflict(params: SamplingParams) -> tuple[str, ...]:
    """The parameters that can leave a request's grammar no token to sample: the grammar, and
    the allowed tokens (min_tokens' bans never do: the sampler lifts them when they would)."""
    if params.allowed_token_ids is None:
        return ("structured_output",)
    return ("structured_output", "allowed_token_ids")


def _best_of(best: BestOf) -> list[RequestOutput]:
    """The ``n`` samples of highest cumulative log-probability, under the visible ids."""

    def rank(o: RequestOutput) -> float:
        c = o.outputs[0]
        usable = c.finish_reason in ("stop", "length") and c.cumulative_logprob is not None
        return c.cumulative_logprob if usable else float("-inf")  # type: ignore[return-value]

    ranked = sorted(best.finals, key=rank, reverse=True)[: len(best.visible_ids)]
    chosen = []
    for i, (vid, o) in enumerate(zip(best.visible_ids, ranked, strict=False)):
        comp = dataclasses.replace(o.outputs[0], index=best.base_index + i)
        if not best.show_logprobs:
            comp.logprobs = comp.cumulative_logprob = None
        chosen.append(dataclasses.replace(o, request_id=vid, outputs=[comp]))
    return chosen
