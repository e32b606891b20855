"""``LLMEngine``: the core. One step = ``schedule()`` -> ``execute()`` -> ``update()``.

The offline ``LLM`` and the server's async loop both drive this same step; nothing else runs a
model forward. Around the core: the input processor turns prompts and parameters into requests
(``input_processor``), the output processor turns new tokens into outputs (``output_processor``,
with ``stop.check_stop``), and beam search is a driver over the same interface
(``beam_driver``); ``wiring`` builds the parts from the configuration.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from typing import Any

from foudre.config import EngineConfig
from foudre.distributed.errors import WorkerFailedError
from foudre.distributed.executor import Executor, ParallelExecutor, start_parallel
from foudre.engine import wiring
from foudre.engine.beam_driver import BeamDriver
from foudre.engine.drafts import propose
from foudre.engine.input_processor import InputProcessor, Limits, Prompt
from foudre.engine.options import check_config
from foudre.engine.output_processor import OutputProcessor
from foudre.engine.request import Request
from foudre.engine.state_slots import state_metrics
from foudre.engine.stats import EngineStats
from foudre.engine.tracked import Owner, Tracked
from foudre.errors import GrammarDeadEndError, InvalidParameterError
from foudre.loading.loader import LoadedModel, load_tokenizer_for
from foudre.loading.tokenizer import Tokenizer
from foudre.native import huge_pages
from foudre.outputs import ErrorCode, RequestOutput
from foudre.runner.host_memory import freeze_startup_objects, keep_freed_host_memory
from foudre.runner.model_runner import describe_kv_cache, kv_bytes_per_block, num_kv_blocks
from foudre.runner.step import StepOutput
from foudre.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("foudre")

_UNHEALTHY_AFTER = 8  # consecutive failed steps (each isolating or failing its requests)


class LLMEngine:
    """Owns the scheduler, the KV-cache manager and the model runner (with
    ``tensor_parallel_size`` or ``pipeline_parallel_size`` above 1, a ``ParallelExecutor`` that
    runs each step on the worker processes too; ``self.model`` is then this process's shard)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = wiring.resolve_device(config.device)
        check_config(config, self.device)
        freeze_startup_objects()
        if self.device.type == "cpu":
            keep_freed_host_memory()
        self._parallel: ParallelExecutor | None = None
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            loaded, self._parallel = start_parallel(config, self.device)
            self.model_name = loaded.name
        else:
            self.model_name, loaded = wiring.load(config, self.device)
        try:
            self._init(config, loaded)
        except BaseException:
            self.shutdown()
            raise

    def _init(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.model_config = mcfg = loaded.config
        self.max_model_len = max_len = wiring.resolve_max_model_len(config, mcfg)
        self.model = loaded.model
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer: Tokenizer | None = (
            None if config.skip_tokenizer_init else load_tokenizer_for(loaded)
        )
        self.eos_token_ids = loaded.eos_token_ids(self.tokenizer)
        states = wiring.state_plan(config, self.model, self.device)
        if states is not None and states.num_slots < config.max_num_seqs:  # a seat is a slot
            self.config = config = dataclasses.replace(config, max_num_seqs=states.num_slots)
        if self._parallel is not None:
            num_blocks = self._parallel.num_blocks  # the least any rank can hold
        else:
            state_bytes = 0 if states is None else states.bytes
            num_blocks = num_kv_blocks(self.model, config, self.device, max_len, 1, state_bytes)
        wiring.check_capacity(num_blocks, config, max_len)
        logger.info(describe_kv_cache(self.model, self.dtype, config.kv_cache_dtype, num_blocks))
        groups = wiring.kv_groups(self.model, self._parallel is not None)
        pool_blocks = num_blocks * len(groups)  # the same memory, in blocks of one group
        self.kv = wiring.block_manager(config, pool_blocks, max_len, self.model, groups, states)
        self.scheduler = wiring.scheduler(config, self.kv, max_len)
        self.runner: Executor = self._parallel or wiring.runner(
            config, self.model, pool_blocks, self.device, self.dtype, max_len, groups, states
        )
        self.proposer = wiring.proposer(
            config, self.device, self.dtype, mcfg.vocab_size, max_len, num_blocks
        )
        if self.proposer is not None:
            free = self.proposer.free
            self.scheduler.on_free = lambda request: free(request.request_id)
        self.stats = EngineStats(spec_accepted_per_position=[0] * config.num_speculative_tokens)
        limits = Limits(
            mcfg.vocab_size,
            max_len,
            config.max_num_seqs,
            config.block_size,
            num_blocks,
            self.proposer is not None,
        )
        self.inputs = InputProcessor(self.tokenizer, self.eos_token_ids, limits)
        self.outputs = OutputProcessor(max_len, self.stats, self.scheduler.finish)
        self.beams = BeamDriver(self.scheduler, self.outputs, self.tokenizer)
        self._ids = itertools.count()

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        index: int = 0,
    ) -> Request:
        """Validate and queue one sequence (``params.n`` is not fanned out here: see
        ``add_group``). ``InvalidParameterError`` for an empty or unknown-token prompt,
        ``PromptTooLongError`` for one over ``max_model_len``."""
        ids, text = self.inputs.encode(prompt)
        self.inputs.check(params)
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self.outputs.tracked:
            raise InvalidParameterError(
                "request_id", f"request id {request_id!r} is already in use"
            )
        t = self.inputs.make(ids, text, params, request_id, arrival_time, index, None, None)
        self.scheduler.add_request(t.request)
        self.outputs.track(t)
        self.stats.prompt_tokens += len(ids)
        return t.request

    def add_group(
        self,
        group_id: str,
        prompts: Sequence[Prompt],
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        final_only: bool = False,
    ) -> list[str]:
        """Queue one submission, all or none; return the ids its outputs will carry.

        With ``SamplingParams``: ``n`` samples of each prompt. Output ``i = prompt_index * n +
        sample`` has id ``{group_id}-{i}`` (just ``group_id`` when there is one), seed ``seed +
        sample``. The samples of a prompt are forked from one sequence when it samples its first
        token: the prompt is computed once and its blocks are shared. With ``best_of`` >
        ``n``, ``best_of`` are sampled and the ``n`` of highest cumulative log-probability come
        out, when all are done. With ``BeamSearchParams``: one beam search per prompt, whose one
        final output (``{group_id}-{prompt_index}``, or ``group_id``) holds the hypotheses, best
        first. Each prompt is encoded and validated once, before anything is queued.
        ``cache_salt`` puts the group's blocks in their own prefix-cache namespace.
        ``final_only``: ``step`` returns the group's outputs once they finish, none before (what
        ``LLM.generate`` reads: no output is built for the steps between)."""
        out = self.outputs
        if group_id in out.groups or group_id in out.tracked:
            raise InvalidParameterError("request_id", f"request id {group_id!r} is already in use")
        plans = self.inputs.plan(group_id, list(prompts), params, arrival_time, cache_salt)
        out.groups[group_id] = []
        try:
            for tracked_list, _ in plans:
                parent = tracked_list[0].request
                parent.fork_children = [t.request for t in tracked_list[1:]]
                for t in tracked_list:
                    if t.request.request_id in out.tracked:
                        raise InvalidParameterError(
                            "request_id", f"request id {t.request.request_id!r} is in use"
                        )
                self.scheduler.add_request(parent)
                for t in tracked_list:
                    t.final_only = final_only
                    out.track(t)
                    self.stats.prompt_tokens += t.request.num_prompt_tokens
        except BaseException:
            self.abort_group(group_id)
            out.groups.pop(group_id, None)
            raise
        return [vid for _, ids in plans for vid in ids]

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its blocks return to the pool at once. Returns its
        final output (a beam's: its search's; a best_of sample's: none until the last)."""
        outputs = self._abort(request_id)
        return outputs[0] if outputs else None

    def _abort(self, request_id: str) -> list[RequestOutput]:
        tracked = self.outputs.tracked.get(request_id)
        if tracked is None or tracked.request.is_finished:
            return []
        return self._owner(tracked).abort(tracked)

    def abort_group(self, group_id: str) -> list[RequestOutput]:
        """Abort every unfinished member of a group (or the request of that id)."""
        outputs = []
        for rid in list(self.outputs.groups.get(group_id, [group_id])):
            outputs += self._abort(rid)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def stalled(self) -> bool:
        """Requests are waiting but the last step scheduled none: a batching policy is waiting
        for arrivals, or blocks are short. A driving loop may sleep briefly instead of spinning."""
        return self.has_unfinished_requests() and self.stats.num_scheduled_last_step == 0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash (a cold cache for a measurement); only when no
        request holds blocks. Returns whether it did."""
        return self.kv.reset_prefix_cache()

    @property
    def kv_bytes_per_block(self) -> int:
        """Bytes of one block of the pool (K and V, scales included): across all layers, or
        across one cache group's where the layers form several (``kv_cache_groups``)."""
        cfg = self.config
        per_block = kv_bytes_per_block(self.model, cfg.block_size, self.dtype, cfg.kv_cache_dtype)
        return per_block // self.kv.num_groups

    def set_draining(self, draining: bool) -> None:
        """``True`` once every request the caller will submit is queued (offline input), so
        that batching policies stop waiting for arrivals; ``False`` when more may come."""
        self.scheduler.set_draining(draining)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return outputs of requests that produced tokens or finished."""
        if self.proposer is not None:
            propose(self.proposer, self.scheduler.running, self.max_model_len, self.config)
        sched = self.scheduler.schedule()
        for rid in sched.preempted:
            tracked = self.outputs.tracked.get(rid)
            if tracked is not None:
                self._owner(tracked).preempted(tracked)
        self.stats.num_scheduled_last_step = len(sched.rows)
        if not sched.rows:
            return []
        self.stats.num_model_steps += 1
        try:
            result = self.runner.execute(sched)
        except WorkerFailedError as e:
            return self._workers_failed(e)
        except Exception as e:
            return self._step_failed([row.request_id for row in sched.rows], e)
        self.stats.consecutive_step_failures = 0
        self.stats.num_padding_tokens += sched.num_padding_rows
        sampled = self.scheduler.update(sched, result)
        stats = self.stats
        stats.peak_kv_cache_usage = max(stats.peak_kv_cache_usage, self.kv.usage)
        stats.peak_running = max(stats.peak_running, len(self.scheduler.running))
        outputs = self._update(sampled, result)
        huge_pages.promote_later()  # (the weights into 2 MiB pages: after a first token)
        return outputs

    def _update(self, sampled: list[Request], result: StepOutput) -> list[RequestOutput]:
        """Hand each sampled request's new tokens to its owner (the output processor, or for a
        beam the beam driver); a request whose output cannot be processed fails alone."""
        now = time.monotonic()
        outputs = []
        for req, tokens, lps, n_draft, n_acc in zip(
            sampled,
            result.token_ids,
            result.logprobs,
            result.num_draft_tokens,
            result.num_accepted,
            strict=True,
        ):
            if n_draft:
                self.stats.record_spec(n_draft, n_acc)
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            tracked = self.outputs.tracked.get(req.request_id)
            if tracked is None:  # ended meanwhile (its beam search finished this step)
                continue
            try:
                outputs += self._owner(tracked).tokens(tracked, tokens, lps)
            except GrammarDeadEndError as e:  # the request's own parameters: not logged as a bug
                logger.info("request %s ends: %s", req.request_id, e)
                code = ErrorCode.GRAMMAR_DEAD_END
                outputs += self._fail_request(tracked, str(e), code, e.params)
            except Exception as e:
                logger.exception("request %s: its new tokens failed", req.request_id)
                outputs += self._fail_request(tracked, f"{type(e).__name__}: {e}")
        return outputs

    # -- failures ------------------------------------------------------------------------------
    @property
    def healthy(self) -> bool:
        """False once steps keep failing whatever they run, or a parallel engine lost a worker:
        the engine cannot step at all."""
        if self._parallel is not None and not self._parallel.healthy:
            return False
        return self.stats.consecutive_step_failures < _UNHEALTHY_AFTER

    @property
    def fatal_error(self) -> str | None:
        """What broke the engine for good (a parallel engine's lost or hung worker), None while
        it can step. Unlike ``healthy`` after repeated step failures, nothing recovers from it:
        a server should exit."""
        return self._parallel.failure if self._parallel is not None else None

    def heartbeat(self) -> None:
        """While idle: check that a parallel engine's workers still answer (``fatal_error``
        says when one does not); nothing on one device."""
        if self._parallel is not None:
            self._parallel.heartbeat()

    def shutdown(self) -> None:
        """Stop the worker processes of a parallel engine (nothing to do on one device).
        Idempotent; the engine cannot step after it."""
        if self._parallel is not None:
            self._parallel.shutdown()

    def _workers_failed(self, error: WorkerFailedError) -> list[RequestOutput]:
        """A parallel step failed across ranks: the engine cannot step any more. Every request
        it holds, running or waiting, fails with the error (``finish_reason "error"``)."""
        self.stats.num_step_failures += 1
        message = f"{type(error).__name__}: {error}"
        logger.error("the parallel engine lost a worker; failing every request: %s", message)
        outputs: list[RequestOutput] = []
        for rid in list(self.outputs.tracked):
            tracked = self.outputs.tracked.get(rid)
            if tracked is not None and not tracked.request.is_finished:
                outputs += self._fail_request(tracked, message)
        return outputs

    def _step_failed(self, request_ids: list[str], error: Exception) -> list[RequestOutput]:
        """A forward raised. A request that ran alone is the cause: it fails (``finish_reason
        "error"``). Otherwise the step's requests are quarantined, each to run alone next, so
        that only the one that causes the failure fails; the others resume unchanged."""
        self.stats.num_step_failures += 1
        self.stats.consecutive_step_failures += 1
        message = f"{type(error).__name__}: {error}"
        if len(request_ids) == 1:
            logger.error("step failed for request %s: %s", request_ids[0], message, exc_info=error)
            return self._fail_request(self.outputs.tracked[request_ids[0]], message)
        logger.warning(
            "step of %d requests failed (%s); running them one by one to find the cause",
            len(request_ids),
            message,
        )
        self.scheduler.quarantine(request_ids)
        return []

    def _fail_request(
        self,
        tracked: Tracked,
        message: str,
        code: ErrorCode = ErrorCode.STEP_FAILED,
        params: tuple[str, ...] = (),
    ) -> list[RequestOutput]:
        """Finish a request with ``finish_reason "error"``, its output carrying ``code`` and
        the ``params`` at fault (a beam fails its whole search)."""
        req = tracked.request
        req.error, req.error_code, req.error_params = message, code, params
        if code is ErrorCode.STEP_FAILED:  # (a grammar's dead end is its request's own doing)
            self.stats.num_failed_requests += 1
        return self._owner(tracked).fail(tracked, message)

    def _owner(self, tracked: Tracked) -> Owner:
        """Who handles a request's steps, aborts and failures: the beam driver for a beam, the
        output processor for any other."""
        return self.beams if tracked.beam is not None else self.outputs

    # -- introspection -------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        kv = self.kv
        return {
            "kv_cache_usage": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "num_used_blocks": kv.num_blocks - kv.num_free_blocks,
            "num_shared_blocks": kv.num_shared_blocks,
            "num_cow_copies": kv.num_copies,
            "num_total_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            "kv_bytes_per_token": self.kv_bytes_per_block * kv.num_groups // kv.block_size,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            **state_metrics(self.kv.states),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            # tokens routed to each expert, by layer (mixture-of-experts models; else empty)
            "moe_expert_tokens": self.runner.model.moe_expert_tokens(),
            **self.stats.as_dict(),
        }
