"""``LLMEngine``: one step = ``schedule()`` -> ``execute()`` -> ``update()``.

The offline ``LLM`` and the server's async loop both drive this same step; nothing else runs a
model forward.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from foudre.config import EngineConfig
from foudre.engine.kv_cache import KVCacheManager
from foudre.engine.policies import make_policy
from foudre.engine.request import Request, RequestStatus
from foudre.engine.scheduler import Scheduler
from foudre.loading.detokenizer import IncrementalDetokenizer
from foudre.loading.loader import default_model, load_model, load_tokenizer_for
from foudre.loading.tokenizer import Tokenizer
from foudre.outputs import CompletionOutput, RequestMetrics, RequestOutput
from foudre.runner.attention import get_backend
from foudre.runner.host_memory import keep_freed_host_memory
from foudre.runner.model_runner import ModelRunner, StepOutput, kv_bytes_per_block
from foudre.sampling_params import SamplingParams
from foudre.spec.proposers import DraftModelProposer, NgramProposer, Proposer

logger = logging.getLogger("foudre")

_CPU_DEFAULT_KV_BYTES = 2 << 30


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[1])
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


@dataclass(slots=True)
class _Tracked:
    """Engine-side companions of a request: its detokenizer and the prompt text."""

    request: Request
    prompt: str | None
    detok: IncrementalDetokenizer | None
    index: int = 0


class LLMEngine:
    """Owns the scheduler, the KV-cache manager and the model runner."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_host_memory()
        model_name, default_tok = (config.model, None) if config.model else default_model()
        loaded = load_model(
            model_name,
            config.tokenizer or default_tok,
            config.dtype,
            self.device,
            None,
            config.revision,
            config.quantization,
        )
        mcfg = loaded.config
        self.model_config = mcfg
        self.model_name = model_name
        self.max_model_len = config.max_model_len or mcfg.max_position_embeddings
        if mcfg.sliding_window is not None and self.max_model_len > mcfg.sliding_window:
            # within the window, full causal attention is exactly the model's attention
            logger.warning(
                "capping max_model_len from %d to the model's sliding window of %d tokens",
                self.max_model_len,
                mcfg.sliding_window,
            )
            self.max_model_len = mcfg.sliding_window
        if self.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"max_position_embeddings {mcfg.max_position_embeddings}"
            )
        self.model = loaded.model
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer: Tokenizer | None = (
            None if config.skip_tokenizer_init else load_tokenizer_for(loaded)
        )
        eos = set(mcfg.eos_token_ids)
        gen_eos = loaded.generation_config.get("eos_token_id")
        if isinstance(gen_eos, int):
            eos.add(gen_eos)
        elif isinstance(gen_eos, list):
            eos.update(gen_eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)

        bs = config.block_size
        num_blocks = self._num_blocks(bs)
        if num_blocks * bs < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * bs} tokens, fewer than max_model_len "
                f"{self.max_model_len}; give more KV memory or a smaller max_model_len"
            )
        max_batched = config.max_num_batched_tokens
        if not config.enable_chunked_prefill:
            max_batched = max(max_batched, self.max_model_len)
        contiguous = config.attention_backend == "contiguous"
        self.kv = KVCacheManager(
            num_blocks,
            bs,
            config.enable_prefix_caching,
            reserve_tokens=self.max_model_len if contiguous else None,
        )
        self.scheduler = Scheduler(
            self.kv,
            max_batched,
            config.max_num_seqs,
            self.max_model_len,
            config.enable_chunked_prefill,
            make_policy(config.scheduling_policy, config.max_num_seqs, config.batch_wait_ms),
        )
        self.runner = ModelRunner(
            self.model,
            get_backend(config.attention_backend, self.device, config.kv_cache_dtype),
            num_blocks,
            bs,
            self.device,
            self.dtype,
            config.seed,
            config.kv_cache_dtype,
            decode_graphs=not config.enforce_eager,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
        )
        self.proposer = self._make_proposer(num_blocks)
        if self.proposer is not None:
            self.scheduler.on_free = self.proposer.free
        k = config.num_speculative_tokens
        self.spec_num_drafts = 0  # verifications with at least one draft token
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_accepted_per_position = [0] * k  # drafts accepted at position 1..k
        self._tracked: dict[str, _Tracked] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.peak_kv_usage = 0.0
        self.num_model_steps = 0  # target forwards run
        self.num_padding_tokens = 0  # throw-away tokens of rectangular batches (static/dynamic)
        self.last_num_scheduled = 0  # 0 while requests wait on a batching policy or on blocks

    def _make_proposer(self, num_blocks: int) -> Proposer | None:
        cfg = self.config
        if cfg.speculative_method is None:
            return None
        k = cfg.num_speculative_tokens
        if cfg.speculative_method == "ngram":
            return NgramProposer(k, cfg.ngram_min, cfg.ngram_max)
        draft_name = cfg.speculative_model
        if draft_name is None:
            embedded = default_model()[0]
            if cfg.model is not None or not embedded.endswith("target"):
                raise ValueError(
                    "speculative_method='draft' needs speculative_model (a draft model with the "
                    "target's tokenizer); only the embedded target has a default draft"
                )
            draft_name = str(Path(embedded).parent / "draft")
        draft = load_model(
            draft_name,
            None,
            cfg.dtype if cfg.dtype != "auto" else str(self.dtype).removeprefix("torch."),
            self.device,
            None,
            None,
            cfg.speculative_quantization,
        )
        if draft.config.max_position_embeddings < self.max_model_len:
            raise ValueError(
                f"the draft model's max_position_embeddings {draft.config.max_position_embeddings}"
                f" is below max_model_len {self.max_model_len}"
            )
        dtype = next(draft.model.parameters()).dtype
        backend = cfg.attention_backend if cfg.attention_backend != "contiguous" else "auto"
        return DraftModelProposer(
            draft.model,
            get_backend(backend, self.device),
            k,
            num_blocks,
            cfg.block_size,
            self.device,
            dtype,
            self.model_config.vocab_size,
            cfg.enable_prefix_caching,
            cfg.seed,
            decode_graphs=not cfg.enforce_eager,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=self.max_model_len,
        )

    def _num_blocks(self, block_size: int) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = kv_bytes_per_block(self.model, block_size, self.dtype, cfg.kv_cache_dtype)
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
            if budget <= 1.0:
                budget *= _device_memory(self.device)
            return max(1, int(budget) // per_block)
        wanted = cfg.max_num_seqs * -(-self.max_model_len // block_size)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.8)
        else:
            budget = min(_CPU_DEFAULT_KV_BYTES, _device_memory(self.device) // 4)
        return max(1, min(wanted, budget // per_block))

    # -- requests ------------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        index: int = 0,
    ) -> Request:
        """Validate and queue a request. ``ValueError`` for an empty, unknown-token or too-long
        prompt, with both lengths in the message."""
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self._tracked:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("text prompts need a tokenizer (skip_tokenizer_init=True)")
            prompt_ids = self.tokenizer.encode(prompt)
            text: str | None = prompt
        else:
            prompt_ids, text = list(prompt), None
        if not prompt_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt_ids) > self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens, more than the maximum context length "
                f"(max_model_len) of {self.max_model_len} tokens"
            )
        req = Request(
            request_id,
            prompt_ids,
            params,
            self.eos_token_ids,
            arrival_time=arrival_time if arrival_time is not None else time.monotonic(),
        )
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                params.skip_special_tokens,
                params.stop,
                params.include_stop_str_in_output,
            )
        self._tracked[request_id] = _Tracked(req, text, detok, index)
        self.num_prompt_tokens += len(prompt_ids)
        self.scheduler.add_request(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; its blocks return to the pool at once."""
        tracked = self._tracked.pop(request_id, None)
        if tracked is None or tracked.request.is_finished:
            return None
        self.scheduler.finish(tracked.request, RequestStatus.FINISHED_ABORTED)
        return self._output(tracked, [], "")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # -- the step ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; return outputs of requests that produced tokens or finished."""
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        self.last_num_scheduled = len(sched.requests)
        if not sched.requests:
            return []
        self.num_model_steps += 1
        now = time.monotonic()
        for req in sched.requests:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
        result = self.runner.execute(
            sched.requests, sched.num_new_tokens, self.kv, sched.num_padding_rows
        )
        self.num_padding_tokens += sched.num_padding_rows
        for req, n in zip(sched.requests, sched.num_new_tokens, strict=True):
            req.num_computed_tokens += n
        self.peak_kv_usage = max(self.peak_kv_usage, self.kv.usage)
        return self._update(result)

    def _propose(self) -> None:
        """Drafts for every running request that has caught up, as many as it may still use."""
        assert self.proposer is not None
        k = self.proposer.num_speculative_tokens
        reqs, limits = [], []
        for req in self.scheduler.running:
            req.clear_spec()
            if req.num_tokens - req.num_computed_tokens != 1:
                continue  # still prefilling
            p = req.sampling_params
            # a step emits up to drafts + 1 tokens: stay within max_tokens and max_model_len
            room = self.max_model_len - req.num_tokens - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - len(req.output_token_ids) - 1)
            if room >= 1:
                reqs.append(req)
                limits.append(min(k, room))
        if reqs:
            self.proposer.propose(reqs, limits)

    def _update(self, result: StepOutput) -> list[RequestOutput]:
        now = time.monotonic()
        outputs = []
        for req, tokens, lps, n_draft, n_acc in zip(
            result.requests,
            result.token_ids,
            result.logprobs,
            result.num_draft_tokens,
            result.num_accepted,
            strict=True,
        ):
            if n_draft:
                req.num_computed_tokens -= n_draft - n_acc  # roll back rejected positions
                self._record_spec(n_draft, n_acc)
            req.clear_spec()
            tracked = self._tracked[req.request_id]
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            delta = ""
            status = None
            emitted: list[int] = []
            for i, token in enumerate(tokens):
                req.output_token_ids.append(token)
                emitted.append(token)
                self.num_generation_tokens += 1
                if lps is not None:
                    req.logprobs.append(lps[i])
                    req.cumulative_logprob += lps[i][token]
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
                del self._tracked[req.request_id]
            outputs.append(self._output(tracked, emitted, delta))
        return outputs

    def _record_spec(self, num_draft: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_draft_tokens += num_draft
        self.spec_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.spec_accepted_per_position[j] += 1

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        n_out = len(req.output_token_ids)
        is_stop_token = token in p.stop_token_ids or (
            not p.ignore_eos and token in req.eos_token_ids
        )
        if is_stop_token and n_out >= p.min_tokens:
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
        )

    # -- introspection -------------------------------------------------------------------------
    def metrics(self) -> dict[str, Any]:
        kv = self.kv
        return {
            "kv_cache_usage": kv.usage,
            "num_free_blocks": kv.num_free_blocks,
            "num_total_blocks": kv.num_blocks,
            "block_size": kv.block_size,
            "num_preemptions": self.scheduler.num_preemptions,
            "prefix_cache_queries": kv.prefix_cache_queries,
            "prefix_cache_hits": kv.prefix_cache_hits,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "prompt_tokens": self.num_prompt_tokens,
            "generation_tokens": self.num_generation_tokens,
            "peak_kv_cache_usage": self.peak_kv_usage,
            "num_model_steps": self.num_model_steps,
            "num_padding_tokens": self.num_padding_tokens,
            "spec_num_drafts": self.spec_num_drafts,
            "spec_draft_tokens": self.spec_draft_tokens,
            "spec_accepted_tokens": self.spec_accepted_tokens,
            "spec_accepted_per_position": list(self.spec_accepted_per_position),
            # tokens per verification step: accepted drafts plus the target's own token
            "spec_mean_acceptance_length": (
                1.0 + self.spec_accepted_tokens / self.spec_num_drafts
                if self.spec_num_drafts
                else 0.0
            ),
        }
