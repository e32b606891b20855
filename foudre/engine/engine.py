"""``LLMEngine``: one step = ``schedule()`` -> ``execute()`` -> ``update()``.

The offline ``LLM`` and the server's async loop both drive this same step; nothing else runs a
model forward.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from foudre.attention import get_backend
from foudre.config import EngineConfig
from foudre.distributed.errors import WorkerFailedError
from foudre.distributed.executor import Executor, ParallelExecutor, start_parallel
from foudre.engine.beam import BeamSearch, Survivor
from foudre.engine.kv_cache import KVCacheManager
from foudre.engine.options import check_config
from foudre.engine.policies import make_policy
from foudre.engine.request import Cohort, Request, RequestStatus
from foudre.engine.scheduler import Scheduler
from foudre.errors import InvalidParameterError, PromptTooLongError
from foudre.loading.detokenizer import IncrementalDetokenizer
from foudre.loading.loader import LoadedModel, default_model, load_model, load_tokenizer_for
from foudre.loading.tokenizer import Tokenizer
from foudre.models.config import ModelConfig
from foudre.outputs import CompletionOutput, RequestMetrics, RequestOutput
from foudre.runner.host_memory import keep_freed_host_memory
from foudre.runner.model_runner import ModelRunner, kv_bytes_per_block, num_kv_blocks
from foudre.runner.step import StepOutput
from foudre.sampling_params import BeamSearchParams, SamplingParams
from foudre.speculative.proposers import Proposer
from foudre.speculative.registry import ProposerContext, make_proposer
from foudre.structured.grammar import GrammarCompiler

logger = logging.getLogger("foudre")

Prompt = str | list[int]

_UNHEALTHY_AFTER = 8  # consecutive failed steps (each isolating or failing its requests)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_max_model_len(config: EngineConfig, mcfg: ModelConfig) -> int:
    """``max_model_len`` as given or the model's (a sliding window does not limit it: every
    attention backend computes the window). ``ValueError`` above the model's positions."""
    max_len = config.max_model_len or mcfg.max_position_embeddings
    if max_len > mcfg.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_len} exceeds the model's "
            f"max_position_embeddings {mcfg.max_position_embeddings}"
        )
    return max_len


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


@dataclass(eq=False)
class _BestOf:
    """The samples of one prompt when ``best_of`` > ``n``: their final outputs are held until all
    are in, then the ``n`` of highest cumulative log-probability leave under the visible ids."""

    visible_ids: list[str]
    base_index: int
    num_samples: int
    show_logprobs: bool
    finals: list[RequestOutput] = field(default_factory=list)


@dataclass(slots=True)
class _Tracked:
    """Engine-side companions of a request: its detokenizer, the prompt text, its group, and
    what it belongs to when its outputs are not its own (best_of samples, beams)."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer | None
    index: int = 0
    group_id: str | None = None
    best_of: _BestOf | None = None
    beam: BeamSearch | None = None


class LLMEngine:
    """Owns the scheduler, the KV-cache manager and the model runner (with
    ``tensor_parallel_size`` or ``pipeline_parallel_size`` above 1, a ``ParallelExecutor`` that
    runs each step on the worker processes too; ``self.model`` is then this process's shard)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        check_config(config, self.device)
        if self.device.type == "cpu":
            keep_freed_host_memory()
        self._parallel: ParallelExecutor | None = None
        if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            loaded, self._parallel = start_parallel(config, self.device)
            self.model_name = loaded.name
        else:
            loaded = self._load(config)
        try:
            self._init(config, loaded)
        except BaseException:
            self.shutdown()
            raise

    def _init(self, config: EngineConfig, loaded: LoadedModel) -> None:
        self.model_config = mcfg = loaded.config
        self.max_model_len = resolve_max_model_len(config, mcfg)
        self.model = loaded.model
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer: Tokenizer | None = (
            None if config.skip_tokenizer_init else load_tokenizer_for(loaded)
        )
        self.eos_token_ids = loaded.eos_token_ids(self.tokenizer)
        if self._parallel is not None:
            num_blocks = self._parallel.num_blocks  # the least any rank can hold
        else:
            num_blocks = num_kv_blocks(self.model, config, self.device, self.max_model_len)
        if num_blocks * config.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * config.block_size} tokens, fewer than "
                f"max_model_len {self.max_model_len}; give more KV memory or a smaller "
                "max_model_len"
            )
        self.kv = self._block_manager(num_blocks)
        self.scheduler = self._scheduler()
        self.runner: Executor = self._parallel or self._runner(num_blocks)
        self.proposer = self._proposer(num_blocks)
        self.stats = EngineStats(spec_accepted_per_position=[0] * config.num_speculative_tokens)
        self._tracked: dict[str, _Tracked] = {}
        self._groups: dict[str, list[str]] = {}  # group id -> its unfinished children
        self._ids = itertools.count()
        self._grammar_compiler: GrammarCompiler | None = None  # built on first use

    def _load(self, config: EngineConfig) -> LoadedModel:
        model, default_tok = (config.model, None) if config.model else default_model()
        self.model_name = model
        return load_model(
            model,
            config.tokenizer or default_tok,
            config.dtype,
            self.device,
            None,
            config.revision,
            config.quantization,
        )

    def _block_manager(self, num_blocks: int) -> KVCacheManager:
        cfg = self.config
        contiguous = cfg.kv_allocation == "contiguous"
        return KVCacheManager(
            num_blocks,
            cfg.block_size,
            cfg.enable_prefix_caching,
            reserve_tokens=self.max_model_len if contiguous else None,
            copy_on_write=cfg.copy_on_write,
        )

    def _runner(self, num_blocks: int) -> ModelRunner:
        cfg = self.config
        return ModelRunner(
            self.model,
            get_backend(cfg.attention_backend, self.device, cfg.kv_cache_dtype),
            num_blocks,
            cfg.block_size,
            self.device,
            self.dtype,
            cfg.seed,
            cfg.kv_cache_dtype,
            decode_graphs=not cfg.enforce_eager,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=self.max_model_len,
        )

    def _proposer(self, num_blocks: int) -> Proposer | None:
        cfg = self.config
        proposer = make_proposer(
            ProposerContext(
                cfg,
                self.device,
                self.dtype,
                self.model_config.vocab_size,
                self.max_model_len,
                num_blocks,
                lambda: KVCacheManager(num_blocks, cfg.block_size, cfg.enable_prefix_caching),
            )
        )
        if proposer is not None:
            free = proposer.free
            self.scheduler.on_free = lambda request: free(request.request_id)
        return proposer

    def _scheduler(self) -> Scheduler:
        cfg = self.config
        max_batched = cfg.max_num_batched_tokens
        if not cfg.enable_chunked_prefill:
            max_batched = max(max_batched, self.max_model_len)
        return Scheduler(
            self.kv,
            max_batched,
            cfg.max_num_seqs,
            self.max_model_len,
            cfg.enable_chunked_prefill,
            make_policy(cfg.scheduling_policy, cfg.max_num_seqs, cfg.batch_wait_ms),
        )

    # -- requests ------------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt) -> tuple[list[int], str | None]:
        """Token ids of ``prompt`` (encoded when text), validated: not empty, in the vocabulary,
        within ``max_model_len`` (``InvalidParameterError`` / ``PromptTooLongError``)."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidParameterError(
                    "prompt", "text prompts need a tokenizer (skip_tokenizer_init=True)"
                )
            ids, text = self.tokenizer.encode(prompt), prompt
        else:
            ids, text = list(prompt), None
        if not ids:
            raise InvalidParameterError("prompt", "prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidParameterError(
                "prompt", f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})"
            )
        if len(ids) > self.max_model_len:
            raise PromptTooLongError(len(ids), self.max_model_len)
        return ids, text

    def _check_params(self, params: SamplingParams) -> None:
        """What ``SamplingParams`` cannot check alone: token ids and ``top_k`` against the
        model's vocabulary (so that no request can make a step index out of range)."""
        vocab = self.model_config.vocab_size
        if params.top_k > vocab:
            raise InvalidParameterError(
                "top_k", f"top_k must be -1, 0 or at most the vocabulary size {vocab}"
            )
        for name, token in params.token_ids_in_use():
            if token >= vocab:
                raise InvalidParameterError(
                    name, f"{name} names token id {token}, outside the vocabulary [0, {vocab})"
                )
        if params.structured_output is not None:  # compiled (and cached) now, or refused
            self._grammars().compile(params.structured_output)

    def _grammars(self) -> GrammarCompiler:
        """The compiler of structured outputs for this model's vocabulary, built on first use
        (it loads the grammar engine and reads every token's bytes)."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise InvalidParameterError(
                    "structured_output",
                    "structured output needs the tokenizer (skip_tokenizer_init=True)",
                )
            self._grammar_compiler = GrammarCompiler(
                self.tokenizer.token_bytes(), self.eos_token_ids, self.model_config.vocab_size
            )
        return self._grammar_compiler

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
        ids, text = self._prompt_ids(prompt)
        self._check_params(params)
        return self._add(ids, text, params, request_id, arrival_time, index, None, None)

    def add_group(
        self,
        group_id: str,
        prompts: Sequence[Prompt],
        params: SamplingParams | BeamSearchParams,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
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
        ``cache_salt`` puts the group's blocks in their own prefix-cache namespace."""
        if group_id in self._groups or group_id in self._tracked:
            raise InvalidParameterError("request_id", f"request id {group_id!r} is already in use")
        if not prompts:
            raise InvalidParameterError("prompt", "prompt must not be empty")
        encoded = [self._prompt_ids(p) for p in prompts]
        if isinstance(params, BeamSearchParams):
            plans = self._plan_beams(group_id, encoded, params, arrival_time, cache_salt)
        else:
            self._check_params(params)
            plans = self._plan_samples(group_id, encoded, params, arrival_time, cache_salt)
        visible = [vid for _, ids in plans for vid in ids]
        members: list[str] = []
        self._groups[group_id] = members
        try:
            for tracked_list, _ in plans:
                parent = tracked_list[0].request
                parent.fork_children = [t.request for t in tracked_list[1:]]
                for t in tracked_list:
                    if t.request.request_id in self._tracked:
                        raise InvalidParameterError(
                            "request_id", f"request id {t.request.request_id!r} is in use"
                        )
                self.scheduler.add_request(parent)
                for t in tracked_list:
                    self._tracked[t.request.request_id] = t
                    members.append(t.request.request_id)
                    self.stats.prompt_tokens += t.request.num_prompt_tokens
        except BaseException:
            self.abort_group(group_id)
            self._groups.pop(group_id, None)
            raise
        return visible

    def _plan_samples(
        self,
        group_id: str,
        encoded: list[tuple[list[int], str | None]],
        params: SamplingParams,
        arrival_time: float | None,
        cache_salt: str | None,
    ) -> list[tuple[list[_Tracked], list[str]]]:
        """Per prompt: its samples (the first is the one the others fork from) and the ids its
        outputs carry. Every child's parameters are checked (seeds) before anything is queued."""
        n, samples = params.n, params.num_samples
        if samples > self.config.max_num_seqs:  # the samples of a prompt run together
            name = "n" if params.best_of is None else "best_of"
            raise InvalidParameterError(
                name, f"{name} {samples} exceeds max_num_seqs {self.config.max_num_seqs}"
            )
        total = len(encoded) * n
        plans = []
        for p, (ids, text) in enumerate(encoded):
            visible = [group_id if total == 1 else f"{group_id}-{p * n + j}" for j in range(n)]
            best_of = None
            base = params
            if samples > n:
                best_of = _BestOf(visible, p * n, samples, params.logprobs is not None)
                if params.logprobs is None:  # ranking needs each token's log-probability
                    base = dataclasses.replace(params, logprobs=0)
            tracked = []
            for j in range(samples):
                child = base
                if samples > 1 and params.seed is not None:
                    child = dataclasses.replace(base, seed=params.seed + j)
                rid = visible[j] if best_of is None else f"{group_id}~{p * samples + j}"
                t = self._make(ids, text, child, rid, arrival_time, p * n + j, group_id, cache_salt)
                t.best_of = best_of
                tracked.append(t)
            plans.append((tracked, visible))
        return plans

    def _plan_beams(
        self,
        group_id: str,
        encoded: list[tuple[list[int], str | None]],
        params: BeamSearchParams,
        arrival_time: float | None,
        cache_salt: str | None,
    ) -> list[tuple[list[_Tracked], list[str]]]:
        if self.proposer is not None:
            raise InvalidParameterError(
                "beam_width", "beam search does not run with speculative decoding"
            )
        if params.beam_width > self.config.max_num_seqs:
            raise InvalidParameterError(
                "beam_width",
                f"beam_width {params.beam_width} exceeds max_num_seqs {self.config.max_num_seqs}",
            )
        plans = []
        for p, (ids, text) in enumerate(encoded):
            room = self.max_model_len - len(ids)
            if room < 1:
                raise PromptTooLongError(len(ids) + 1, self.max_model_len)
            # the beams may diverge from the first token: each may need its own blocks
            length = len(ids) + min(params.max_tokens, room)
            worst = params.beam_width * -(-length // self.config.block_size)
            if worst > self.kv.num_blocks:
                raise InvalidParameterError(
                    "beam_width",
                    f"{params.beam_width} beams of {length} tokens may need {worst} KV blocks; "
                    f"the cache has {self.kv.num_blocks}",
                )
            vid = group_id if len(encoded) == 1 else f"{group_id}-{p}"
            cohort = Cohort(seats=params.beam_width)
            search = BeamSearch(
                vid, p, params, self.eos_token_ids, min(params.max_tokens, room), cohort
            )
            sampling = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
            sampling.logprobs = search.num_candidates  # set after validation: may pass 20
            t = self._make(ids, text, sampling, f"{vid}:0", arrival_time, p, group_id, cache_salt)
            t.beam = search
            t.request.cohort = cohort
            cohort.members.append(t.request)
            search.scores[t.request.request_id] = 0.0
            plans.append(([t], [vid]))
        return plans

    def _make(
        self,
        prompt_ids: list[int],
        text: str | None,
        params: SamplingParams,
        request_id: str,
        arrival_time: float | None,
        index: int,
        group_id: str | None,
        cache_salt: str | None,
    ) -> _Tracked:
        """A request and its companions, not queued yet."""
        req = Request(
            request_id,
            prompt_ids,
            params,
            self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
            cache_salt=cache_salt,
        )
        if params.structured_output is not None:  # each sample walks the grammar on its own
            stops = {*self.eos_token_ids, *params.stop_token_ids}
            req.grammar = self._grammars().matcher(params.structured_output, sorted(stops))
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
        return _Tracked(req, text, detok, index, group_id)

    def _add(
        self,
        prompt_ids: list[int],
        text: str | None,
        params: SamplingParams,
        request_id: str | None,
        arrival_time: float | None,
        index: int,
        group_id: str | None,
        cache_salt: str | None,
    ) -> Request:
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self._tracked:
            raise InvalidParameterError(
                "request_id", f"request id {request_id!r} is already in use"
            )
        t = self._make(
            prompt_ids, text, params, request_id, arrival_time, index, group_id, cache_salt
        )
        self.scheduler.add_request(t.request)
        self._tracked[request_id] = t
        self.stats.prompt_tokens += len(prompt_ids)
        return t.request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its blocks return to the pool at once. Returns its
        final output (a beam's: its search's; a best_of sample's: none until the last)."""
        outputs = self._abort(request_id)
        return outputs[0] if outputs else None

    def _abort(self, request_id: str) -> list[RequestOutput]:
        tracked = self._tracked.get(request_id)
        if tracked is None or tracked.request.is_finished:
            return []
        if tracked.beam is not None:
            return [self._end_beam_search(tracked.beam, "abort")]
        self.scheduler.finish(tracked.request, RequestStatus.FINISHED_ABORTED)
        self._retire(tracked)
        return self._emit(tracked, self._output(tracked, [], ""))

    def abort_group(self, group_id: str) -> list[RequestOutput]:
        """Abort every unfinished member of a group (or the request of that id)."""
        outputs = []
        for rid in list(self._groups.get(group_id, [group_id])):
            outputs += self._abort(rid)
        return outputs

    def _retire(self, tracked: _Tracked) -> None:
        """Forget a finished, aborted or failed request, and drop it from its group (once)."""
        if self._tracked.pop(tracked.request.request_id, None) is None or tracked.group_id is None:
            return
        children = self._groups.get(tracked.group_id, [])
        if tracked.request.request_id in children:
            children.remove(tracked.request.request_id)
        if not children:
            self._groups.pop(tracked.group_id, None)

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
        """Bytes of one KV block across all layers (K and V, scales included)."""
        cfg = self.config
        return kv_bytes_per_block(self.model, cfg.block_size, self.dtype, cfg.kv_cache_dtype)

    def set_draining(self, draining: bool) -> None:
        """``True`` once every request the caller will submit is queued (offline input), so
        that batching policies stop waiting for arrivals; ``False`` when more may come."""
        self.scheduler.set_draining(draining)

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return outputs of requests that produced tokens or finished."""
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        for rid in sched.preempted:  # a preempted beam reports again once recomputed
            tracked = self._tracked.get(rid)
            if tracked is not None and tracked.beam is not None:
                tracked.beam.reported.pop(rid, None)
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
        return self._update(sampled, result)

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
        for rid in list(self._tracked):
            tracked = self._tracked.get(rid)
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
            return self._fail_request(self._tracked[request_ids[0]], message)
        logger.warning(
            "step of %d requests failed (%s); running them one by one to find the cause",
            len(request_ids),
            message,
        )
        self.scheduler.quarantine(request_ids)
        return []

    def _fail_request(self, tracked: _Tracked, message: str) -> list[RequestOutput]:
        """Finish a request with ``finish_reason "error"``; its blocks leave the prefix cache
        (a beam fails its whole search)."""
        req = tracked.request
        req.error = message
        self.stats.num_failed_requests += 1
        if tracked.beam is not None:
            return [self._end_beam_search(tracked.beam, "error", message)]
        # samples not forked yet share its prompt: they fail with it, not one by one later
        unforked = [self._tracked[c.request_id] for c in req.fork_children if not c.is_finished]
        req.fork_children = []
        outputs = []
        for child in unforked:
            child.request.error = message
            self.scheduler.finish(child.request, RequestStatus.FINISHED_ERROR)
            self._retire(child)
            outputs += self._emit(child, self._output(child, [], ""))
        if not req.is_finished:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR, uncache=True)
        else:  # it had finished before the failure: it fails all the same
            req.status = RequestStatus.FINISHED_ERROR
        self._retire(tracked)
        return outputs + self._emit(tracked, self._output(tracked, [], ""))

    def _propose(self) -> None:
        """Drafts for every running request that has caught up, as many as it may still use.
        A proposer that fails costs its drafts, not the requests: they verify none this step."""
        assert self.proposer is not None
        try:
            self._propose_drafts(self.proposer)
        except Exception:
            logger.exception("the proposer failed; no drafts this step")
            for req in self.scheduler.running:
                req.clear_spec()
                self.proposer.free(req.request_id)

    def _propose_drafts(self, proposer: Proposer) -> None:
        k = proposer.num_speculative_tokens
        reqs, limits = [], []
        limit = self.config.speculative_max_batch_size
        # a full batch drafts nothing: the draft catches up when the batch shrinks
        drafting = limit is None or len(self.scheduler.running) <= limit
        for req in self.scheduler.running:
            req.clear_spec()
            if not drafting:
                continue
            if req.num_tokens - req.num_computed_tokens != 1 or req.fork_children:
                continue  # still prefilling, or its samples fork from its next position
            p = req.sampling_params
            # a step emits up to drafts + 1 tokens: stay within max_tokens and max_model_len
            room = self.max_model_len - req.num_tokens - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - len(req.output_token_ids) - 1)
            if room >= 1:
                reqs.append(req)
                limits.append(min(k, room))
        if reqs:
            for req, draft in zip(reqs, proposer.propose(reqs, limits), strict=True):
                req.spec_token_ids = draft.token_ids
                req.spec_probs = draft.probs

    def _update(self, sampled: list[Request], result: StepOutput) -> list[RequestOutput]:
        """Append each sampled request's new tokens, detokenize, stop where it must; a request
        whose output cannot be processed fails alone."""
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
            found = self._tracked.get(req.request_id)
            if found is None:  # ended meanwhile (its beam search finished this step)
                continue
            tracked = found
            try:
                if tracked.beam is not None:
                    assert lps is not None
                    if tracked.beam.report(req, lps[0]):
                        outputs += self._advance_beam_search(tracked.beam)
                    continue
                outputs += self._emit(tracked, self._append(tracked, tokens, lps))
            except Exception as e:
                logger.exception("request %s: its new tokens failed", req.request_id)
                outputs += self._fail_request(tracked, f"{type(e).__name__}: {e}")
        return outputs

    def _emit(self, tracked: _Tracked, out: RequestOutput) -> list[RequestOutput]:
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

    # -- beam search ---------------------------------------------------------------------------
    def _advance_beam_search(self, search: BeamSearch) -> list[RequestOutput]:
        """Every live beam has reported: select the next beams (forking and pruning requests),
        or end the search with its final output."""
        survivors = search.advance()
        if survivors is None:
            return [self._end_beam_search(search, None)]
        by_parent: dict[str, list[Survivor]] = {}
        for s in survivors:
            by_parent.setdefault(s.parent.request_id, []).append(s)
        placed: dict[int, Request] = {}  # survivor position -> its request
        for beam in list(search.beams):
            mine = by_parent.get(beam.request_id)
            if not mine:  # pruned
                del search.scores[beam.request_id]
                self.scheduler.finish(beam, RequestStatus.FINISHED_ABORTED)
                self._retire(self._tracked[beam.request_id])
                continue
            for extra in mine[1:]:  # forked before the parent takes its own token
                placed[id(extra)] = self._fork_beam(search, beam, extra)
            first = mine[0]
            beam.output_token_ids.append(first.token)
            search.scores[beam.request_id] = first.cum_logprob
            placed[id(first)] = beam
        search.cohort.members[:] = [placed[id(s)] for s in survivors]
        self.stats.generation_tokens += len(survivors)
        return []

    def _fork_beam(self, search: BeamSearch, parent: Request, survivor: Survivor) -> Request:
        parent_tracked = self._tracked[parent.request_id]
        rid = search.next_beam_id()
        child = Request(
            rid,
            parent.prompt_token_ids,
            parent.sampling_params,
            parent.eos_token_ids,
            arrival_time=parent.arrival_time,
            cache_salt=parent.cache_salt,
        )
        child.output_token_ids = [*parent.output_token_ids, survivor.token]
        child.first_scheduled_time = parent.first_scheduled_time
        child.cohort = search.cohort
        t = _Tracked(child, parent_tracked.prompt, None, search.index, parent_tracked.group_id)
        t.beam = search
        self._tracked[rid] = t
        if t.group_id is not None:
            self._groups.setdefault(t.group_id, []).append(rid)
        search.cohort.members.append(child)
        search.scores[rid] = survivor.cum_logprob
        self.scheduler.fork(parent, child)
        return child

    def _end_beam_search(
        self, search: BeamSearch, reason: str | None, error: str | None = None
    ) -> RequestOutput:
        """Free every live beam; the search's one final output: its hypotheses, best first
        (``reason`` "abort" or "error": none, that finish reason)."""
        first = search.beams[0] if search.beams else None
        tracked = self._tracked.get(first.request_id) if first is not None else None
        status = (
            RequestStatus.FINISHED_ERROR if reason == "error" else RequestStatus.FINISHED_ABORTED
        )
        for beam in list(search.beams):
            if not beam.is_finished:
                self.scheduler.finish(beam, status, uncache=reason == "error")
            beam_tracked = self._tracked.get(beam.request_id)
            if beam_tracked is not None:
                self._retire(beam_tracked)
        tok = self.tokenizer
        width = search.width
        outputs = [
            CompletionOutput(
                index=search.index * width + i,
                text=tok.decode(h.token_ids, skip_special_tokens=True) if tok else "",
                token_ids=h.token_ids,
                finish_reason=h.finish_reason,
                cumulative_logprob=h.cum_logprob,
                score=h.score,
            )
            for i, h in enumerate(search.finished if reason is None else [])
        ]
        if reason is not None:
            outputs = [CompletionOutput(index=search.index * width, finish_reason=reason)]
        return RequestOutput(
            request_id=search.visible_id,
            prompt=tracked.prompt if tracked is not None else None,
            prompt_token_ids=first.prompt_token_ids if first is not None else [],
            outputs=outputs,
            finished=True,
            error=error,
        )

    def _append(
        self, tracked: _Tracked, tokens: list[int], lps: list[dict[int, float]] | None
    ) -> RequestOutput:
        req = tracked.request
        delta = ""
        status = None
        emitted: list[int] = []
        for i, token in enumerate(tokens):
            req.output_token_ids.append(token)
            emitted.append(token)
            self.stats.generation_tokens += 1
            if lps is not None:
                req.logprobs.append(lps[i])
                req.cumulative_logprob += lps[i][token]
            if req.grammar is not None and not req.grammar.accept(token):
                raise RuntimeError(f"token {token} does not continue the request's grammar")
            status = self._check_stop(req, token)
            if tracked.detok is not None:
                if status is None or req.stop_reason is None:  # stop tokens are not shown
                    delta += tracked.detok.add_tokens([token])
                if tracked.detok.stopped_by is not None:
                    status = RequestStatus.FINISHED_STOPPED
                    req.stop_reason = tracked.detok.stopped_by
                elif status is not None:
                    delta += tracked.detok.flush()
            if status is not None:
                break  # tokens accepted after a stop are dropped
        if status is not None:
            self.scheduler.finish(req, status)
            self._retire(tracked)
        return self._output(tracked, emitted, delta)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        n_out = len(req.output_token_ids)
        is_stop_token = token in p.stop_token_ids or (
            not p.ignore_eos and token in req.eos_token_ids
        )
        if is_stop_token and n_out >= p.min_tokens:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if req.grammar is not None and req.grammar.is_terminated:  # it took a stop token
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if p.max_tokens is not None and n_out >= p.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _output(self, tracked: _Tracked, delta_ids: list[int], delta_text: str) -> RequestOutput:
        req = tracked.request
        finish = req.status.value if req.is_finished else None
        comp = CompletionOutput(
            index=tracked.index,
            text=tracked.detok.text if tracked.detok is not None else "",
            token_ids=list(req.output_token_ids),
            finish_reason=finish,
            stop_reason=req.stop_reason,
            logprobs=list(req.logprobs) if req.sampling_params.logprobs is not None else None,
            cumulative_logprob=(
                req.cumulative_logprob if req.sampling_params.logprobs is not None else None
            ),
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
        )

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
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            # tokens routed to each expert, by layer (mixture-of-experts models; else empty)
            "moe_expert_tokens": self.runner.model.moe_expert_tokens(),
            **self.stats.as_dict(),
        }
